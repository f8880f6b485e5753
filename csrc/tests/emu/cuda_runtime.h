// A CUDA emulator for the C++ unit tests on machines without a GPU: csrc's kernels compiled by the host compiler
// run here, every thread of a block as a coroutine of one OS thread, so that test_cuda.cu (the CUDA kernels
// against the CPU kernels) runs in CI. The *_emu.cpp files beside this one include the .cu files (kernels with
// __CUDA_ARCH__ defined: their device code paths, __fmaf_rn and the like, run here); CMakeLists.txt builds them
// as the ctest `cuda_emulated` (tests/test_quant.py's cmake test runs it), or by hand:
//
//   g++ -std=c++17 -O2 -I csrc/tests/emu -I csrc csrc/tests/emu/*.cpp csrc/cpu_kernels.cpp
//
// What it emulates, and how faithfully:
// - Blocks run one after another; a block's threads run one at a time, each until it reaches a barrier
//   (__syncthreads, or a warp's rendezvous inside __shfl_xor_sync) or returns. Warps go in a random order, each
//   as far as the block's barriers let it (run_block), so a read of shared memory that misses a barrier reads
//   another warp's later data or unwritten memory. Threads that returned count as arrived. A barrier that can
//   never complete (threads of one block waiting at different barriers) aborts with a message: divergent
//   __syncthreads is undefined behaviour on a GPU.
// - Shared memory (FASTOPT_SHARED, FASTOPT_SHARED_ARRAY) is statics, which one block at a time uses, filled
//   with 0xFF bytes by the first thread of each block that declares them.
// - Global memory is host memory (cudaMalloc is aligned_alloc), copies are memcpy, streams and
//   synchronization do nothing, launches run to completion before returning.
// - The device has FASTOPT_EMU_SMS multiprocessors (default 3) with room for one block each, so the persistent
//   kernels' grid-stride loops take several tiles per block.
// - Arithmetic is the host's: g++ does not contract a * b + c into an fma (nvcc does), so the emulated
//   kernels agree with the CPU kernels bit for bit where a GPU agrees to a few ulp.
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <unordered_map>
#include <vector>

#define FASTOPT_CUDA_EMULATOR 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }

inline uint32_t __float_as_uint(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
inline float __uint_as_float(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }

namespace fastopt_emu {

enum State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

// A thread of a block is a fiber with a stack of its own, kept from block to block (thread t of every block runs
// on fiber t). Switches go through the compiler's __builtin_setjmp/__builtin_longjmp: glibc's swapcontext saves
// and restores the signal mask with a system call each time (19.7 million of them in one run of test_cuda_emu),
// and longjmp checks that it jumps up its own stack (_FORTIFY_SOURCE), which a switch between stacks is not.
struct Thread {
  void* resume[5];  // where the fiber continues (__builtin_setjmp's buffer), once started
  State state = kRunnable;
  bool started = false;
  std::unique_ptr<char[]> stack;
};

struct Block {
  std::vector<Thread> threads;  // the fibers (reserved for 1024: a suspended fiber's Thread never moves)
  int n = 0;                    // this block's threads: the first n fibers
  std::vector<uint64_t> shuffle;  // one slot per thread for __shfl_xor_sync
  void* scheduler[5];
  int current = 0;
  std::function<void()> body;
  std::mt19937 rng{12345};
};

inline Block& block() {
  static Block b;
  return b;
}

[[gnu::noinline]] inline void jump(void** to) { __builtin_longjmp(to, 1); }

// The current fiber stops here; the scheduler continues from where it last resumed a fiber.
[[gnu::noinline]] inline void park() {
  Block& b = block();
  if (__builtin_setjmp(b.threads[b.current].resume) == 0) jump(b.scheduler);
}

inline void yield_at(State s) {
  Block& b = block();
  b.threads[b.current].state = s;
  park();
}

// A fiber's life: the current block's thread `current` (its own index), then, once resumed for the next block
// that has as many threads, that block's, and so on.
inline void fiber_main() {
  for (;;) {
    Block& b = block();
    b.body();
    b.threads[b.current].state = kDone;
    park();
  }
}

// Runs thread t until it parks (at a barrier, or done).
[[gnu::noinline]] inline void resume(int t) {
  constexpr size_t kStack = 64 * 1024;
  Block& b = block();
  b.current = t;
  threadIdx = dim3((unsigned)t);
  if (__builtin_setjmp(b.scheduler) != 0) return;
  Thread& th = b.threads[t];
  if (th.started) jump(th.resume);
  th.started = true;
  th.stack.reset(new char[kStack]);
  ucontext_t uc;  // a fiber's first entry: the only context switch that goes through the C library
  getcontext(&uc);
  uc.uc_stack.ss_sp = th.stack.get();
  uc.uc_stack.ss_size = kStack;
  uc.uc_link = nullptr;
  makecontext(&uc, fiber_main, 0);
  setcontext(&uc);
}

// The live threads of warp `w` (threads [w, w + 32)) all wait at a warp rendezvous: release them.
inline bool release_warp(Block& b, int w) {
  const int n = b.n, end = std::min(n, w + 32);
  bool some = false;
  for (int t = w; t < end; ++t) {
    if (b.threads[t].state != kAtWarpBarrier && b.threads[t].state != kDone) return false;
    some = some || b.threads[t].state == kAtWarpBarrier;
  }
  for (int t = w; t < end; ++t)
    if (b.threads[t].state == kAtWarpBarrier) b.threads[t].state = kRunnable;
  return some;
}

inline int& last_error() {
  static int e = 0;
  return e;
}

// Blocks begun so far: shared memory a block has not poisoned yet is poisoned by its first thread (poison).
inline uint64_t& block_epoch() {
  static uint64_t e = 0;
  return e;
}

// Fills shared memory at p with 0xFF bytes (NaN floats, all-ones codes, -1) the first time a thread of the
// current block declares it, so that a read of what no thread of the block wrote yet shows.
inline void poison(void* p, size_t bytes) {
  static std::unordered_map<void*, uint64_t> done;
  uint64_t& e = done[p];
  if (e != block_epoch()) {
    memset(p, 0xFF, bytes);
    e = block_epoch();
  }
}

// One block: warps in a random order, each run as far as it goes (its lanes in a random order, its warp
// rendezvous released as soon as every live lane reached it) before the next: warps drift as far apart as
// the block's barriers allow, which is where a missing __syncthreads shows.
inline void run_block(int n_threads) {
  Block& b = block();
  ++block_epoch();
  if (b.threads.capacity() < 1024) b.threads.reserve(1024);  // launch() refuses more threads than that
  if ((int)b.threads.size() < n_threads) b.threads.resize(n_threads);
  b.n = n_threads;
  for (int t = 0; t < n_threads; ++t) b.threads[t].state = kRunnable;
  b.shuffle.assign(n_threads, 0);
  std::vector<int> warps, lanes;
  for (;;) {
    warps.clear();
    for (int w = 0; w < n_threads; w += 32) {
      for (int t = w; t < std::min(n_threads, w + 32); ++t) {
        if (b.threads[t].state == kRunnable) {
          warps.push_back(w);
          break;
        }
      }
    }
    if (warps.empty()) {
      bool done = true, at_barrier = true;
      for (int t = 0; t < n_threads; ++t) {
        done = done && b.threads[t].state == kDone;
        at_barrier = at_barrier && (b.threads[t].state == kAtBlockBarrier || b.threads[t].state == kDone);
      }
      if (done) return;
      if (!at_barrier) {
        fprintf(stderr, "cuda emulator: block %u deadlocked: its threads wait at different barriers\n", blockIdx.x);
        abort();
      }
      for (int t = 0; t < n_threads; ++t)
        if (b.threads[t].state == kAtBlockBarrier) b.threads[t].state = kRunnable;
      continue;
    }
    const int w = warps[std::uniform_int_distribution<int>(0, (int)warps.size() - 1)(b.rng)];
    do {
      lanes.clear();
      for (int t = w; t < std::min(n_threads, w + 32); ++t)
        if (b.threads[t].state == kRunnable) lanes.push_back(t);
      std::shuffle(lanes.begin(), lanes.end(), b.rng);
      for (int t : lanes) resume(t);
    } while (release_warp(b, w));
  }
}

template <typename F>
void launch(dim3 grid, dim3 threads, F&& kernel_call) {
  if (grid.x == 0 || threads.x == 0 || threads.x > 1024 || grid.y != 1 || threads.y != 1) {
    last_error() = 1;
    return;
  }
  Block& b = block();
  b.body = kernel_call;
  gridDim = grid;
  blockDim = threads;
  for (unsigned i = 0; i < grid.x; ++i) {
    blockIdx = dim3(i);
    run_block((int)threads.x);
  }
  b.body = nullptr;
}

inline int sms() {
  const char* s = getenv("FASTOPT_EMU_SMS");
  const int n = s != nullptr ? atoi(s) : 3;
  return n > 0 ? n : 1;
}

}  // namespace fastopt_emu

#define FASTOPT_LAUNCH(kernel, grid, threads, stream, ...) \
  ::fastopt_emu::launch((grid), (threads), [&] { kernel(__VA_ARGS__); })
#define FASTOPT_SHARED(T, name) \
  static T name;                \
  ::fastopt_emu::poison(&name, sizeof(name))
#define FASTOPT_SHARED_ARRAY(T, name, n) \
  static T name[n];                      \
  ::fastopt_emu::poison(name, sizeof(name))

inline void __syncthreads() { fastopt_emu::yield_at(fastopt_emu::kAtBlockBarrier); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8, "__shfl_xor_sync: 8 bytes at most");
  if (mask != 0xffffffffu) {
    fprintf(stderr, "cuda emulator: __shfl_xor_sync with a partial mask\n");
    abort();
  }
  fastopt_emu::Block& b = fastopt_emu::block();
  const int t = (int)threadIdx.x;
  memcpy(&b.shuffle[t], &v, sizeof(T));
  fastopt_emu::yield_at(fastopt_emu::kAtWarpBarrier);  // every lane has written its value
  T out;
  memcpy(&out, &b.shuffle[(t & ~31) | ((t & 31) ^ (lane_mask & 31))], sizeof(T));
  fastopt_emu::yield_at(fastopt_emu::kAtWarpBarrier);  // every lane has read before the next shuffle writes
  return out;
}

inline int atomicMax(int* p, int v) {
  const int old = *p;
  *p = old > v ? old : v;
  return old;
}

// ---- runtime API ----------------------------------------------------------------------------------------

typedef int cudaError_t;
typedef void* cudaStream_t;
enum : int { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };

inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument" : "out of memory";
}
inline cudaError_t cudaGetLastError() {
  const int e = fastopt_emu::last_error();
  fastopt_emu::last_error() = 0;
  return e;
}
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = a == cudaDevAttrMultiProcessorCount ? fastopt_emu::sms() : 0;
  return cudaSuccess;
}
template <typename K>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, K, int, size_t) {
  *n = 1;
  return cudaSuccess;
}
template <typename T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  *p = static_cast<T*>(aligned_alloc(256, (bytes + 255) / 256 * 256));
  return *p != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFree(void* p) {
  free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  memcpy(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
