// The only file of csrc/ that includes torch: checks the arguments, builds the multi-tensor tables and calls
// the torch-free kernels (cpu_kernels.h; cuda_kernels.h when built with FASTOPT_WITH_CUDA). Registers the
// ops under torch.ops.fastopt with TORCH_LIBRARY, with CPU and (when built with CUDA) CUDA kernels.
//
// Ops (`map` is a 256-entry fp32 dynamic map on the tensors' device; see fastopt/reference/quant.py):
//   quantize_blockwise(x, map, block_size) -> (codes uint8 [x.shape], absmax fp32 [ceil(n / block_size)])
//   dequantize_blockwise(codes, absmax, map, block_size, dtype) -> Tensor [codes.shape]
//   quantize_blockwise_multi_(xs, codes, absmax, map, block_size, found_inf?)   in place, one launch
//   dequantize_blockwise_multi_(codes, absmax, out, map, block_size)           in place, one launch
//   adamw8bit_step_(params, grads, state1, state2, absmax1, absmax2, steps, map1, map2, lr, beta1, beta2, eps,
//                   weight_decay, block_size, inv_scale?, found_inf?, table?)
//   adamw32_step_(params, grads, exp_avg, exp_avg_sq, steps, lr, beta1, beta2, eps, weight_decay,
//                 inv_scale?, found_inf?, table?)
//   adamw8bit_table(params, grads, state1, state2, absmax1, absmax2, steps, block_size) -> Tensor int64
//   adamw32_table(params, grads, exp_avg, exp_avg_sq, steps) -> Tensor int64
//
// The AdamW steps read a table of the tensors' addresses on the device. Without `table` each call builds it
// and copies it from pinned memory; a caller that steps the same tensors again (the optimizer, keyed by their
// addresses) builds it once with the *_table op and passes it: such a step copies nothing from the host, so a
// CUDA graph captured after warm-up replays with a table that stays valid (a per-call copy from a pinned
// buffer would replay reading whatever reused that buffer). A table is checked against the call's tensors:
// in full on CPU, by dtype, device and size on CUDA (reading it there would sync).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "cpu_kernels.h"

#ifdef FASTOPT_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_kernels.h"
#endif

namespace fastopt {
namespace {

using at::Tensor;
using at::TensorList;

DType dtype_of(at::ScalarType st, const char* op, const char* what) {
  switch (st) {
    case at::kFloat: return DType::F32;
    case at::kDouble: return DType::F64;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default:
      TORCH_CHECK_VALUE(false, "fastopt.", op, ": ", what, " has dtype ", st,
                        "; expected a floating-point dtype (float32, float64, bfloat16 or float16)");
  }
  return DType::F32;
}

DType dtype_of(const Tensor& t, const char* op, const char* what) { return dtype_of(t.scalar_type(), op, what); }

#ifndef FASTOPT_WITH_CUDA
// A tensor on another device than the CPU, in a build without the CUDA kernels (FASTOPT_EXT_CUDA=0, or a torch
// without CUDA): what to do about it.
void no_cuda_kernels(const char* op, const at::Device& device) {
  TORCH_CHECK(device.is_cuda(), "fastopt.", op, ": unsupported device ", device);
  TORCH_CHECK(false, "fastopt.", op, ": this build of the extension has no CUDA kernels (device ", device,
              "): it was built for the CPU only (FASTOPT_EXT_CUDA=0, or a torch without CUDA); unset "
              "FASTOPT_EXT_CUDA to build them, or set FASTOPT_BACKEND=torch to run the 8-bit optimizers in plain "
              "torch, much slower");
}
#endif

void check_block_size(int64_t block_size, const char* op) {
  TORCH_CHECK_VALUE(valid_block_size(block_size), "fastopt.", op, ": block_size=", block_size,
                    " must be a power of two from 64 to 4096");
}

void check_map(const Tensor& map, const at::Device& device, const char* op, const char* name) {
  TORCH_CHECK(map.scalar_type() == at::kFloat && map.numel() == kCodeSize && map.is_contiguous(), "fastopt.", op,
              ": ", name, " must be a contiguous float32 tensor of 256 values, got ", map.scalar_type(), " ",
              map.sizes());
  TORCH_CHECK(map.device() == device, "fastopt.", op, ": ", name, " is on ", map.device(), ", expected ", device);
}

void check_tensor(const Tensor& t, const at::Device& device, const char* op, const char* name, size_t i) {
  TORCH_CHECK(t.device() == device, "fastopt.", op, ": ", name, "[", i, "] is on ", t.device(), ", expected ",
              device);
  TORCH_CHECK(t.is_contiguous(), "fastopt.", op, ": ", name, "[", i, "] must be contiguous");
}

void check_scalar(const c10::optional<Tensor>& t, const at::Device& device, const char* op, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1 && t->device() == device, "fastopt.", op, ": ",
              name, " must be a float32 tensor of one element on ", device, ", got ", t->scalar_type(), " ",
              t->sizes(), " on ", t->device());
}

// One int64 buffer: tile_start (n + 1 values), then the n entries. On CUDA it is copied to the device from
// pinned memory on the current stream (no host sync); on CPU the host buffer is used as is.
template <typename Entry>
struct Tables {
  std::vector<int64_t> buf;
  int n = 0;
  int64_t total = 0;
  Tensor device_copy;

  Tables(const std::vector<Entry>& entries, int64_t tile) : n((int)entries.size()) {
    constexpr size_t words = sizeof(Entry) / sizeof(int64_t);
    buf.resize((size_t)n + 1 + (size_t)n * words);
    std::vector<int64_t> numels(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) numels[i] = entries[i].n;
    total = cpu::fill_tile_start(numels.data(), n, tile, buf.data());
    if (n > 0) std::memcpy(buf.data() + n + 1, entries.data(), (size_t)n * sizeof(Entry));
  }
  const int64_t* host_tile_start() const { return buf.data(); }
  const Entry* host_entries() const { return reinterpret_cast<const Entry*>(buf.data() + n + 1); }

  // `table`, built earlier by a *_table op, replaces the copy to_device would make (see the top of the file).
  void adopt(const Tensor& table, const at::Device& device, const char* op) {
    TORCH_CHECK_VALUE(table.scalar_type() == at::kLong && table.dim() == 1 && table.is_contiguous() &&
                          table.numel() == (int64_t)buf.size() && table.device() == device,
                      "fastopt.", op, ": table must be a contiguous int64 vector of ", buf.size(), " elements on ",
                      device, " (from the matching *_table op), got ", table.scalar_type(), " ", table.sizes(),
                      " on ", table.device());
    TORCH_CHECK_VALUE(!device.is_cpu() ||
                          std::memcmp(table.data_ptr<int64_t>(), buf.data(), buf.size() * sizeof(int64_t)) == 0,
                      "fastopt.", op, ": table was built for other tensors (an address or a size differs): build ",
                      "it again with the matching *_table op");
    device_copy = table;
  }

  // The table on `device`: for a later call's `table` argument.
  Tensor on(const at::Device& device, const char* op) {
    if (device.is_cpu()) {
      Tensor t = at::empty({(int64_t)buf.size()}, at::TensorOptions().dtype(at::kLong));
      if (!buf.empty()) std::memcpy(t.data_ptr<int64_t>(), buf.data(), buf.size() * sizeof(int64_t));
      return t;
    }
#ifdef FASTOPT_WITH_CUDA
    c10::cuda::CUDAGuard guard(device);
    to_device(device);
    return device_copy;
#else
    no_cuda_kernels(op, device);
    return Tensor();
#endif
  }

#ifdef FASTOPT_WITH_CUDA
  void to_device(const at::Device& device) {
    Tensor pinned = at::empty({(int64_t)buf.size()}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(pinned.data_ptr<int64_t>(), buf.data(), buf.size() * sizeof(int64_t));
    device_copy = pinned.to(device, /*non_blocking=*/true);
  }
  const int64_t* dev_tile_start() const { return device_copy.data_ptr<int64_t>(); }
  const Entry* dev_entries() const { return reinterpret_cast<const Entry*>(device_copy.data_ptr<int64_t>() + n + 1); }
#endif
};

float host_scalar(const c10::optional<Tensor>& t, float dflt) { return t.has_value() ? t->item<float>() : dflt; }

const float* dev_ptr(const c10::optional<Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

template <typename F>
void parallel_tiles(int64_t total, int64_t tile_elems, F&& f) {
  const int64_t grain = std::max<int64_t>(1, (int64_t)32768 / tile_elems);
  at::parallel_for(0, total, grain, [&](int64_t b, int64_t e) { f(b, e); });
}

// ---- quantize / dequantize ------------------------------------------------------------------------------

void quantize_multi_impl(TensorList xs, TensorList codes, TensorList absmax, const Tensor& map, int64_t block_size,
                         const c10::optional<Tensor>& found_inf, const char* op) {
  check_block_size(block_size, op);
  TORCH_CHECK(xs.size() == codes.size() && xs.size() == absmax.size(), "fastopt.", op,
              ": xs, codes and absmax must have the same length, got ", xs.size(), ", ", codes.size(), ", ",
              absmax.size());
  if (xs.empty()) return;
  const at::Device device = xs[0].device();
  const DType dt = dtype_of(xs[0], op, "x");
  check_map(map, device, op, "map");
  check_scalar(found_inf, device, op, "found_inf");
  std::vector<QuantEntry> entries(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK_VALUE(xs[i].scalar_type() == xs[0].scalar_type(), "fastopt.", op, ": xs[", i, "] has dtype ",
                      xs[i].scalar_type(), ", xs[0] has ", xs[0].scalar_type(), "; one dtype per call");
    check_tensor(xs[i], device, op, "xs", i);
    check_tensor(codes[i], device, op, "codes", i);
    check_tensor(absmax[i], device, op, "absmax", i);
    const int64_t n = xs[i].numel();
    TORCH_CHECK(codes[i].scalar_type() == at::kByte && codes[i].numel() == n, "fastopt.", op, ": codes[", i,
                "] must be uint8 with ", n, " elements");
    TORCH_CHECK(absmax[i].scalar_type() == at::kFloat && absmax[i].numel() == ceil_div(n, block_size), "fastopt.",
                op, ": absmax[", i, "] must be float32 with ceil(", n, " / ", block_size, ") elements");
    entries[i] = QuantEntry{xs[i].data_ptr(), codes[i].data_ptr<uint8_t>(), absmax[i].data_ptr<float>(), nullptr, n};
  }
  Tables<QuantEntry> tab(entries, quant_tile(block_size));
  if (tab.total == 0) return;
  if (device.is_cpu()) {
    if (host_scalar(found_inf, 0.0f) != 0.0f) return;
    SearchTables st;
    cpu::build_search_tables(map.data_ptr<float>(), &st);
    parallel_tiles(tab.total, quant_tile(block_size), [&](int64_t b, int64_t e) {
      cpu::quantize_tiles(dt, tab.host_entries(), tab.host_tile_start(), tab.n, block_size, st, b, e);
    });
    return;
  }
#ifdef FASTOPT_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "fastopt.", op, ": unsupported device ", device);
  c10::cuda::CUDAGuard guard(device);
  tab.to_device(device);
  C10_CUDA_CHECK(cuda::quantize(dt, tab.dev_tile_start(), tab.dev_entries(), tab.n, tab.total, block_size,
                                map.data_ptr<float>(), dev_ptr(found_inf), c10::cuda::getCurrentCUDAStream().stream()));
#else
  no_cuda_kernels(op, device);
#endif
}

void dequantize_multi_impl(TensorList codes, TensorList absmax, TensorList out, const Tensor& map,
                           int64_t block_size, const char* op) {
  check_block_size(block_size, op);
  TORCH_CHECK(codes.size() == absmax.size() && codes.size() == out.size(), "fastopt.", op,
              ": codes, absmax and out must have the same length, got ", codes.size(), ", ", absmax.size(), ", ",
              out.size());
  if (codes.empty()) return;
  const at::Device device = codes[0].device();
  const DType dt = dtype_of(out[0], op, "out");
  check_map(map, device, op, "map");
  std::vector<QuantEntry> entries(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) {
    TORCH_CHECK_VALUE(out[i].scalar_type() == out[0].scalar_type(), "fastopt.", op, ": out[", i, "] has dtype ",
                      out[i].scalar_type(), ", out[0] has ", out[0].scalar_type(), "; one dtype per call");
    check_tensor(codes[i], device, op, "codes", i);
    check_tensor(absmax[i], device, op, "absmax", i);
    check_tensor(out[i], device, op, "out", i);
    const int64_t n = codes[i].numel();
    TORCH_CHECK(codes[i].scalar_type() == at::kByte, "fastopt.", op, ": codes[", i, "] must be uint8, got ",
                codes[i].scalar_type());
    TORCH_CHECK_VALUE(absmax[i].scalar_type() == at::kFloat && absmax[i].numel() == ceil_div(n, block_size),
                      "fastopt.", op, ": absmax[", i, "] must be float32 with ceil(", n, " / ", block_size,
                      ") = ", ceil_div(n, block_size), " elements, got ", absmax[i].scalar_type(), " with ",
                      absmax[i].numel());
    TORCH_CHECK(out[i].numel() == n, "fastopt.", op, ": out[", i, "] must have ", n, " elements");
    entries[i] = QuantEntry{nullptr, codes[i].data_ptr<uint8_t>(), absmax[i].data_ptr<float>(), out[i].data_ptr(), n};
  }
  Tables<QuantEntry> tab(entries, quant_tile(block_size));
  if (tab.total == 0) return;
  if (device.is_cpu()) {
    SearchTables st;
    fill_search_keys_only(st, map.data_ptr<float>());  // dequantize reads only the keys
    parallel_tiles(tab.total, quant_tile(block_size), [&](int64_t b, int64_t e) {
      cpu::dequantize_tiles(dt, tab.host_entries(), tab.host_tile_start(), tab.n, block_size, st, b, e);
    });
    return;
  }
#ifdef FASTOPT_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "fastopt.", op, ": unsupported device ", device);
  c10::cuda::CUDAGuard guard(device);
  tab.to_device(device);
  C10_CUDA_CHECK(cuda::dequantize(dt, tab.dev_tile_start(), tab.dev_entries(), tab.n, tab.total, block_size,
                                  map.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream()));
#else
  no_cuda_kernels(op, device);
#endif
}

std::tuple<Tensor, Tensor> quantize_blockwise(const Tensor& x, const Tensor& map, int64_t block_size) {
  check_block_size(block_size, "quantize_blockwise");
  dtype_of(x, "quantize_blockwise", "x");
  Tensor xc = x.contiguous();
  Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  Tensor absmax = at::empty({ceil_div(x.numel(), block_size)}, x.options().dtype(at::kFloat));
  quantize_multi_impl({xc}, {codes}, {absmax}, map, block_size, c10::nullopt, "quantize_blockwise");
  return {codes, absmax};
}

Tensor dequantize_blockwise(const Tensor& codes, const Tensor& absmax, const Tensor& map, int64_t block_size,
                            at::ScalarType dtype) {
  dtype_of(dtype, "dequantize_blockwise", "dtype");
  Tensor out = at::empty(codes.sizes(), codes.options().dtype(dtype));
  dequantize_multi_impl({codes.contiguous()}, {absmax.contiguous()}, {out}, map, block_size, "dequantize_blockwise");
  return out;
}

void quantize_blockwise_multi_(TensorList xs, TensorList codes, TensorList absmax, const Tensor& map,
                               int64_t block_size, const c10::optional<Tensor>& found_inf) {
  quantize_multi_impl(xs, codes, absmax, map, block_size, found_inf, "quantize_blockwise_multi_");
}

void dequantize_blockwise_multi_(TensorList codes, TensorList absmax, TensorList out, const Tensor& map,
                                 int64_t block_size) {
  dequantize_multi_impl(codes, absmax, out, map, block_size, "dequantize_blockwise_multi_");
}

// ---- AdamW ----------------------------------------------------------------------------------------------

AdamWHyper hyper(double lr, double beta1, double beta2, double eps, double weight_decay) {
  return AdamWHyper{lr, beta1, beta2, eps, weight_decay};
}

void check_params(TensorList params, TensorList grads, TensorList steps, const at::Device& device, const char* op) {
  TORCH_CHECK(params.size() == grads.size() && params.size() == steps.size(), "fastopt.", op,
              ": params, grads and steps must have the same length");
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(params[i].scalar_type() == params[0].scalar_type(), "fastopt.", op, ": params[", i,
                      "] has dtype ", params[i].scalar_type(), ", params[0] has ", params[0].scalar_type(),
                      "; one dtype per call");
    check_tensor(params[i], device, op, "params", i);
    check_tensor(grads[i], device, op, "grads", i);
    TORCH_CHECK(grads[i].scalar_type() == params[i].scalar_type() && grads[i].numel() == params[i].numel(),
                "fastopt.", op, ": grads[", i, "] must match params[", i, "] in dtype and size");
    TORCH_CHECK(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1 && steps[i].device() == device,
                "fastopt.", op, ": steps[", i, "] must be a float32 scalar tensor on ", device);
  }
}

// The 8-bit AdamW step's entries, its arguments checked; `device` and `dt` are the params' (params non-empty).
std::vector<AdamWEntry> adamw8bit_entries(TensorList params, TensorList grads, TensorList state1, TensorList state2,
                                          TensorList absmax1, TensorList absmax2, TensorList steps,
                                          int64_t block_size, const char* op) {
  check_block_size(block_size, op);
  TORCH_CHECK(state1.size() == params.size() && state2.size() == params.size() && absmax1.size() == params.size() &&
                  absmax2.size() == params.size(),
              "fastopt.", op, ": every list must have one entry per param");
  std::vector<AdamWEntry> entries(params.size());
  if (params.empty()) return entries;
  const at::Device device = params[0].device();
  dtype_of(params[0], op, "params[0]");
  check_params(params, grads, steps, device, op);
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel(), nb = ceil_div(n, block_size);
    const Tensor* st[4] = {&state1[i], &state2[i], &absmax1[i], &absmax2[i]};
    const char* names[4] = {"state1", "state2", "absmax1", "absmax2"};
    for (int k = 0; k < 4; ++k) {
      check_tensor(*st[k], device, op, names[k], i);
      const bool ok = k < 2 ? st[k]->scalar_type() == at::kByte && st[k]->numel() == n
                            : st[k]->scalar_type() == at::kFloat && st[k]->numel() == nb;
      TORCH_CHECK(ok, "fastopt.", op, ": ", names[k], "[", i, "] must be ", k < 2 ? "uint8" : "float32", " with ",
                  k < 2 ? n : nb, " elements, got ", st[k]->scalar_type(), " with ", st[k]->numel());
    }
    entries[i] = AdamWEntry{params[i].data_ptr(), grads[i].data_ptr(), state1[i].data_ptr(), state2[i].data_ptr(),
                            absmax1[i].data_ptr<float>(), absmax2[i].data_ptr<float>(), steps[i].data_ptr<float>(), n};
  }
  return entries;
}

// The fp32/fp64-state AdamW step's entries, its arguments checked.
std::vector<AdamWEntry> adamw32_entries(TensorList params, TensorList grads, TensorList exp_avg,
                                        TensorList exp_avg_sq, TensorList steps, const char* op) {
  TORCH_CHECK(exp_avg.size() == params.size() && exp_avg_sq.size() == params.size(), "fastopt.", op,
              ": every list must have one entry per param");
  std::vector<AdamWEntry> entries(params.size());
  if (params.empty()) return entries;
  const at::Device device = params[0].device();
  const at::ScalarType state_t = dtype_of(params[0], op, "params[0]") == DType::F64 ? at::kDouble : at::kFloat;
  check_params(params, grads, steps, device, op);
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    check_tensor(exp_avg[i], device, op, "exp_avg", i);
    check_tensor(exp_avg_sq[i], device, op, "exp_avg_sq", i);
    TORCH_CHECK(exp_avg[i].scalar_type() == state_t && exp_avg_sq[i].scalar_type() == state_t &&
                    exp_avg[i].numel() == n && exp_avg_sq[i].numel() == n,
                "fastopt.", op, ": exp_avg[", i, "] and exp_avg_sq[", i, "] must be ", state_t, " with ", n,
                " elements");
    entries[i] = AdamWEntry{params[i].data_ptr(), grads[i].data_ptr(), exp_avg[i].data_ptr(),
                            exp_avg_sq[i].data_ptr(), nullptr, nullptr, steps[i].data_ptr<float>(), n};
  }
  return entries;
}

at::Device device_of(TensorList params) { return params.empty() ? at::Device(at::kCPU) : params[0].device(); }

Tensor adamw8bit_table(TensorList params, TensorList grads, TensorList state1, TensorList state2,
                       TensorList absmax1, TensorList absmax2, TensorList steps, int64_t block_size) {
  Tables<AdamWEntry> tab(adamw8bit_entries(params, grads, state1, state2, absmax1, absmax2, steps, block_size,
                                           "adamw8bit_table"),
                         quant_tile(block_size));
  return tab.on(device_of(params), "adamw8bit_table");
}

Tensor adamw32_table(TensorList params, TensorList grads, TensorList exp_avg, TensorList exp_avg_sq,
                     TensorList steps) {
  Tables<AdamWEntry> tab(adamw32_entries(params, grads, exp_avg, exp_avg_sq, steps, "adamw32_table"), kTile32);
  return tab.on(device_of(params), "adamw32_table");
}

void adamw8bit_step_(TensorList params, TensorList grads, TensorList state1, TensorList state2, TensorList absmax1,
                     TensorList absmax2, TensorList steps, const Tensor& map1, const Tensor& map2, double lr,
                     double beta1, double beta2, double eps, double weight_decay, int64_t block_size,
                     const c10::optional<Tensor>& inv_scale, const c10::optional<Tensor>& found_inf,
                     const c10::optional<Tensor>& table) {
  const char* op = "adamw8bit_step_";
  Tables<AdamWEntry> tab(adamw8bit_entries(params, grads, state1, state2, absmax1, absmax2, steps, block_size, op),
                         quant_tile(block_size));
  if (params.empty()) return;
  const at::Device device = params[0].device();
  const DType dt = dtype_of(params[0], op, "params[0]");
  check_map(map1, device, op, "map1");
  check_map(map2, device, op, "map2");
  check_scalar(inv_scale, device, op, "inv_scale");
  check_scalar(found_inf, device, op, "found_inf");
  const AdamWHyper h = hyper(lr, beta1, beta2, eps, weight_decay);
  if (tab.total == 0) return;
  if (table.has_value()) tab.adopt(*table, device, op);
  if (device.is_cpu()) {
    if (host_scalar(found_inf, 0.0f) != 0.0f) return;
    const float inv = host_scalar(inv_scale, 1.0f);
    SearchTables t1, t2;
    cpu::build_search_tables(map1.data_ptr<float>(), &t1);
    cpu::build_search_tables(map2.data_ptr<float>(), &t2);
    parallel_tiles(tab.total, quant_tile(block_size), [&](int64_t b, int64_t e) {
      cpu::adamw8bit_tiles(dt, tab.host_entries(), tab.host_tile_start(), tab.n, block_size, t1, t2, h, inv,
                           inv_scale.has_value(), b, e);
    });
    return;
  }
#ifdef FASTOPT_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "fastopt.", op, ": unsupported device ", device);
  c10::cuda::CUDAGuard guard(device);
  if (!table.has_value()) tab.to_device(device);
  C10_CUDA_CHECK(cuda::adamw8bit(dt, tab.dev_tile_start(), tab.dev_entries(), tab.n, tab.total, block_size,
                                 map1.data_ptr<float>(), map2.data_ptr<float>(), h, dev_ptr(inv_scale),
                                 dev_ptr(found_inf), c10::cuda::getCurrentCUDAStream().stream()));
#else
  no_cuda_kernels(op, device);
#endif
}

void adamw32_step_(TensorList params, TensorList grads, TensorList exp_avg, TensorList exp_avg_sq, TensorList steps,
                   double lr, double beta1, double beta2, double eps, double weight_decay,
                   const c10::optional<Tensor>& inv_scale, const c10::optional<Tensor>& found_inf,
                   const c10::optional<Tensor>& table) {
  const char* op = "adamw32_step_";
  Tables<AdamWEntry> tab(adamw32_entries(params, grads, exp_avg, exp_avg_sq, steps, op), kTile32);
  if (params.empty()) return;
  const at::Device device = params[0].device();
  const DType dt = dtype_of(params[0], op, "params[0]");
  check_scalar(inv_scale, device, op, "inv_scale");
  check_scalar(found_inf, device, op, "found_inf");
  const AdamWHyper h = hyper(lr, beta1, beta2, eps, weight_decay);
  if (tab.total == 0) return;
  if (table.has_value()) tab.adopt(*table, device, op);
  if (device.is_cpu()) {
    if (host_scalar(found_inf, 0.0f) != 0.0f) return;
    const float inv = host_scalar(inv_scale, 1.0f);
    parallel_tiles(tab.total, kTile32, [&](int64_t b, int64_t e) {
      cpu::adamw32_tiles(dt, tab.host_entries(), tab.host_tile_start(), tab.n, h, inv, inv_scale.has_value(), b, e);
    });
    return;
  }
#ifdef FASTOPT_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "fastopt.", op, ": unsupported device ", device);
  c10::cuda::CUDAGuard guard(device);
  if (!table.has_value()) tab.to_device(device);
  C10_CUDA_CHECK(cuda::adamw32(dt, tab.dev_tile_start(), tab.dev_entries(), tab.n, tab.total, h, dev_ptr(inv_scale),
                               dev_ptr(found_inf), c10::cuda::getCurrentCUDAStream().stream()));
#else
  no_cuda_kernels(op, device);
#endif
}

bool has_cuda() {
#ifdef FASTOPT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace fastopt

TORCH_LIBRARY(fastopt, m) {
  m.def("quantize_blockwise(Tensor x, Tensor map, int block_size) -> (Tensor, Tensor)");
  m.def("dequantize_blockwise(Tensor codes, Tensor absmax, Tensor map, int block_size, ScalarType dtype) -> Tensor");
  m.def("quantize_blockwise_multi_(Tensor[] xs, Tensor(a!)[] codes, Tensor(b!)[] absmax, Tensor map, "
        "int block_size, Tensor? found_inf=None) -> ()");
  m.def("dequantize_blockwise_multi_(Tensor[] codes, Tensor[] absmax, Tensor(a!)[] out, Tensor map, "
        "int block_size) -> ()");
  m.def("adamw8bit_step_(Tensor(a!)[] params, Tensor(f!)[] grads, Tensor(b!)[] state1, Tensor(c!)[] state2, "
        "Tensor(d!)[] absmax1, Tensor(e!)[] absmax2, Tensor[] steps, Tensor map1, Tensor map2, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, int block_size, Tensor? inv_scale=None, "
        "Tensor? found_inf=None, Tensor? table=None) -> ()");
  m.def("adamw32_step_(Tensor(a!)[] params, Tensor(d!)[] grads, Tensor(b!)[] exp_avg, Tensor(c!)[] exp_avg_sq, "
        "Tensor[] steps, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "Tensor? inv_scale=None, Tensor? found_inf=None, Tensor? table=None) -> ()");
  m.def("adamw8bit_table(Tensor[] params, Tensor[] grads, Tensor[] state1, Tensor[] state2, Tensor[] absmax1, "
        "Tensor[] absmax2, Tensor[] steps, int block_size) -> Tensor");
  m.def("adamw32_table(Tensor[] params, Tensor[] grads, Tensor[] exp_avg, Tensor[] exp_avg_sq, Tensor[] steps) "
        "-> Tensor");
  m.def("has_cuda() -> bool", &fastopt::has_cuda);
}

#define FASTOPT_REGISTER(m)                                                    \
  m.impl("quantize_blockwise", &fastopt::quantize_blockwise);                  \
  m.impl("dequantize_blockwise", &fastopt::dequantize_blockwise);              \
  m.impl("quantize_blockwise_multi_", &fastopt::quantize_blockwise_multi_);    \
  m.impl("dequantize_blockwise_multi_", &fastopt::dequantize_blockwise_multi_);\
  m.impl("adamw8bit_step_", &fastopt::adamw8bit_step_);                        \
  m.impl("adamw32_step_", &fastopt::adamw32_step_);                            \
  m.impl("adamw8bit_table", &fastopt::adamw8bit_table);                        \
  m.impl("adamw32_table", &fastopt::adamw32_table);

TORCH_LIBRARY_IMPL(fastopt, CPU, m) { FASTOPT_REGISTER(m) }

#ifdef FASTOPT_WITH_CUDA
TORCH_LIBRARY_IMPL(fastopt, CUDA, m) { FASTOPT_REGISTER(m) }
#endif
