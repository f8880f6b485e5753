"""Just-in-time build of the C++/CUDA extension in `csrc/` (8-bit block-wise quantization, fused 8-bit AdamW).

`load()` builds the extension with `torch.utils.cpp_extension` and ninja the first time it is needed, then
loads the shared library, which registers the ops under `torch.ops.fastopt` (TORCH_LIBRARY; no Python
module). The build is cached under `$TORCH_EXTENSIONS_DIR` (default `$XDG_CACHE_HOME/torch_extensions`, else
`~/.cache/torch_extensions`, as torch's own extensions) in a folder
named by a hash of the sources, the torch, CUDA and Python versions, the C++ compiler (`CXX`), whether the CUDA
kernels are built and for which architectures, and the libstdc++ the process runs with, so a change of any of
them rebuilds and a warm cache loads in about the time it takes to `dlopen` the library. A cached
library that `dlopen` refuses (cut short on disk) is built again, from nothing.

Several processes (ranks) starting together on a cold cache take an exclusive file lock (`fcntl.flock`,
released by the kernel even if the holder dies): one builds, the others wait and then load its result.

CUDA kernels are compiled when `torch.cuda.is_available()` (for the visible GPUs' architectures unless
`TORCH_CUDA_ARCH_LIST` is set); otherwise the build is CPU-only. `FASTOPT_EXT_CUDA=0|1` overrides that
(false/true, no/yes, off/on too; auto or unset: the default; anything else is refused), `FASTOPT_EXT_VERBOSE=1`
shows the compiler output. Nothing is downloaded at run time: a missing compiler,
ninja or nvcc raises an error that says what to install, an unwritable cache one that says what to set.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

__all__ = ["load", "is_available", "load_error", "how_loaded", "has_cuda_kernels", "source_dir", "build_key"]

_lock = threading.Lock()
_loaded = False
_error: BaseException | None = None
_how: str | None = None

_SOURCES_CPU = ("bindings.cpp", "cpu_kernels.cpp")
_SOURCES_CUDA = ("quant_cuda.cu", "adamw_cuda.cu")
_HEADERS = ("fastopt_core.h", "cpu_kernels.h", "cuda_kernels.h", "cuda_common.cuh")


def source_dir() -> Path:
    """csrc/: inside the installed package (`fastopt/csrc`), or next to the package in a source checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "csrc", here.parent / "csrc"):
        if (cand / "bindings.cpp").is_file():
            return cand
    raise RuntimeError(f"fastopt.ext: the C++ sources (csrc/bindings.cpp) are not in {here / 'csrc'} or "
                       f"{here.parent / 'csrc'}; reinstall fastopt (pip install fastopt) so that csrc/ ships with it")


_FLAG_VALUES = {"0": False, "false": False, "no": False, "off": False, "1": True, "true": True, "yes": True,
                "on": True, "": None, "auto": None}


def _env_flag(name: str) -> bool | None:
    """An on/off environment variable, case and blanks aside: 0/false/no/off, 1/true/yes/on, or unset/empty/auto
    (None); anything else is refused, naming it (a typo must not quietly mean the default)."""
    flag = os.environ.get(name, "").strip().lower()
    if flag not in _FLAG_VALUES:
        raise ValueError(f"{name}={os.environ[name]!r} must be one of 0, 1 (or false/true, no/yes, off/on), or auto "
                         "or unset for the default")
    return _FLAG_VALUES[flag]


def _with_cuda() -> bool:
    flag = _env_flag("FASTOPT_EXT_CUDA")
    if flag is not None:
        return flag
    return torch.cuda.is_available() and torch.version.cuda is not None


def _cuda_arch_list() -> str:
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return env
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{a}.{b}" for a, b in caps)


@functools.lru_cache(maxsize=None)
def _runtime_libstdcxx() -> tuple[str, ...]:
    """The libstdc++ this process already runs (torch's), for the linker ahead of the compiler's own. A toolchain
    like the gcc-toolset that builds torch's wheels (the lent H100's CC/CXX) links libstdc++ into the extension
    statically where the system has no libstdc++.so it accepts: the extension then holds a second copy of the
    locale machinery, and formatting a number into an error message crashed (SIGSEGV in num_put, torch 2.11).
    Named first, the shared library resolves every libstdc++ symbol; the static archive then adds none.
    Read once per process (the build key and the link must name the same file, whatever is loaded later); a
    path ninja could not take unquoted (whitespace, `$`) is left to the compiler's default."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.rstrip("\n").split(maxsplit=5)
                path = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
                if "/libstdc++.so" in path and os.path.isfile(path) and not any(c.isspace() or c == "$"
                                                                                  for c in path):
                    return (path,)
    except OSError:  # no /proc (not Linux): the compiler's default
        pass
    return ()


def build_key(with_cuda: bool | None = None) -> str:
    """Hash of everything the built library depends on: each source's name, length and bytes, torch, CUDA and
    Python versions, `CXX`, the CUDA kernels' architectures (or none) and the process's libstdc++."""
    with_cuda = _with_cuda() if with_cuda is None else with_cuda
    h = hashlib.sha256()
    src = source_dir()
    for name in _SOURCES_CPU + _HEADERS + (_SOURCES_CUDA if with_cuda else ()):
        data = (src / name).read_bytes()
        h.update(f"{name}:{len(data)}:".encode())  # the length: no two file sets give one byte stream
        h.update(data)
    parts = [torch.__version__, str(torch.version.cuda), f"py{sys.version_info[0]}{sys.version_info[1]}",
             os.environ.get("CXX", "c++"), f"cuda={with_cuda}", *_runtime_libstdcxx()]
    if with_cuda:
        parts.append(_cuda_arch_list())
    h.update("|".join(parts).encode())
    return h.hexdigest()[:16]


def _extensions_root() -> Path:
    """torch's: `$TORCH_EXTENSIONS_DIR`, else `torch_extensions` in the XDG cache folder (`$XDG_CACHE_HOME`, which
    the XDG spec ignores when it is not an absolute path, else `~/.cache`)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(xdg) if os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    return cache / "torch_extensions"


_ESCAPE = " (or set FASTOPT_BACKEND=torch to run the 8-bit optimizers in plain torch, much slower)"


def _check_toolchain(with_cuda: bool) -> None:
    from torch.utils import cpp_extension

    if with_cuda and torch.version.cuda is None:  # FASTOPT_EXT_CUDA=1 with a torch built without CUDA
        raise RuntimeError(f"fastopt.ext: FASTOPT_EXT_CUDA=1 asks for the CUDA kernels, but torch {torch.__version__} "
                           "is a CPU-only build (torch.version.cuda is None): install a CUDA build of torch (the pip "
                           "command for your CUDA version: https://pytorch.org/get-started/locally/), or set "
                           "FASTOPT_EXT_CUDA=0 to build the CPU kernels only")
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as e:
        raise RuntimeError("fastopt.ext: building the C++ extension needs ninja: pip install ninja"
                           f"{_ESCAPE}") from e
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"fastopt.ext: building the C++ extension needs a C++17 compiler ({cxx!r} is not on "
                           f"PATH): install g++ (e.g. apt-get install g++) or set CXX{_ESCAPE}")
    if with_cuda and cpp_extension.CUDA_HOME is None:
        raise RuntimeError(f"fastopt.ext: CUDA tensors need the CUDA kernels, which need nvcc from the CUDA toolkit "
                           f"{torch.version.cuda} (set CUDA_HOME, or install the toolkit); FASTOPT_EXT_CUDA=0 builds "
                           "the CPU kernels only, for CPU tensors; CUDA tensors without nvcc: set "
                           "FASTOPT_BACKEND=torch to run the 8-bit optimizers in plain torch, much slower")


def _build_and_load(verbose: bool) -> str:
    from torch.utils import cpp_extension

    with_cuda = _with_cuda()
    key = build_key(with_cuda)
    name = f"fastopt_ext_{key}"
    root = _extensions_root()
    build_dir = root / name
    lib = build_dir / f"{name}.so"
    done = build_dir / "BUILD_OK"
    refused = None  # the library's stamp when dlopen refused it: built again, unless another process did
    if done.is_file() and lib.is_file():  # warm cache: no compiler, no ninja, no lock
        seen = _stamp(lib)
        try:
            torch.ops.load_library(str(lib))
            return "cache"
        except OSError:  # cut short or damaged on disk (dlopen's error): built again below
            refused = seen
    _check_toolchain(with_cuda)
    try:  # the folder and our lock file: a cache that cannot be written says what to set, not a bare OSError
        build_dir.mkdir(parents=True, exist_ok=True)
        os.close(os.open(root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644))
    except OSError as e:
        raise RuntimeError(f"fastopt.ext: the extension cache {root} cannot be written to build the C++ extension "
                           f"({e.strerror}: {e.filename}): set TORCH_EXTENSIONS_DIR to a writable folder"
                           f"{_ESCAPE}") from e
    src = source_dir()
    sources = [str(src / s) for s in _SOURCES_CPU + (_SOURCES_CUDA if with_cuda else ())]
    defines = ["-DFASTOPT_WITH_CUDA"] if with_cuda else []
    with _FileLock(root / f"{name}.lock"):
        if done.is_file() and lib.is_file() and (refused is None or _stamp(lib) != refused):
            torch.ops.load_library(str(lib))  # another process built it while we waited
            return "waited"
        if refused is not None:  # from nothing: ninja would take the damaged library, newer than its objects, as built
            shutil.rmtree(build_dir)
            build_dir.mkdir(parents=True)
        # a mark left from a build whose library is gone: while the library is linked again, another process's
        # warm-cache check would take the mark and dlopen the file as it is being written.
        done.unlink(missing_ok=True)
        # torch's own build lock: left behind by a build that was killed, it would make load() wait forever;
        # under our lock no other process is building.
        (build_dir / "lock").unlink(missing_ok=True)
        old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if with_cuda:
            os.environ["TORCH_CUDA_ARCH_LIST"] = _cuda_arch_list()
        try:
            cpp_extension.load(
                name=name, sources=sources, build_directory=str(build_dir), is_python_module=False,
                with_cuda=with_cuda, extra_cflags=["-O3", *defines], extra_cuda_cflags=["-O3", *defines],
                extra_include_paths=[str(src)], extra_ldflags=list(_runtime_libstdcxx()), verbose=verbose)
        finally:
            if with_cuda:
                if old_arch is None:
                    os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
                else:
                    os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
        done.write_text(key + "\n")
    return "built"


def _stamp(path: Path) -> tuple | None:
    """Which file is at `path` (inode, modification time, size), or None: a rebuilt library is another one."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class _FileLock:
    """Exclusive advisory lock on a file (POSIX flock; on other systems no lock beyond torch's own)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            import fcntl
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _register_fakes() -> None:
    """Shapes for torch.compile / meta tensors."""
    lib = torch.library

    @lib.register_fake("fastopt::quantize_blockwise")
    def _(x, map, block_size):
        return (x.new_empty(x.shape, dtype=torch.uint8),
                x.new_empty((math.ceil(x.numel() / block_size),), dtype=torch.float32))

    @lib.register_fake("fastopt::dequantize_blockwise")
    def _(codes, absmax, map, block_size, dtype):
        return codes.new_empty(codes.shape, dtype=dtype)

    for op in ("quantize_blockwise_multi_", "dequantize_blockwise_multi_", "adamw8bit_step_", "adamw32_step_"):
        lib.register_fake(f"fastopt::{op}")(lambda *args, **kwargs: None)

    @lib.register_fake("fastopt::adamw8bit_table")
    def _(params, grads, state1, state2, absmax1, absmax2, steps, block_size):
        return params[0].new_empty((len(params) * 9 + 1,), dtype=torch.int64)  # tile starts, 8 words per entry

    @lib.register_fake("fastopt::adamw32_table")
    def _(params, grads, exp_avg, exp_avg_sq, steps):
        return params[0].new_empty((len(params) * 9 + 1,), dtype=torch.int64)


def load(verbose: bool | None = None) -> None:
    """Build (first use) and load the extension; after it returns, `torch.ops.fastopt.*` exist.

    Raises the build's error, the same one on every later call in this process.
    """
    global _loaded, _error, _how
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        if _error is not None:
            raise _error
        try:
            if verbose is None:
                verbose = bool(_env_flag("FASTOPT_EXT_VERBOSE"))
            _how = _build_and_load(verbose)
            _register_fakes()
        except Exception as e:  # remembered so that every caller sees the real cause
            _error = e
            raise
        _loaded = True


def is_available() -> bool:
    """Whether the extension loads here (builds it on first call); the cause of a failure: `load_error()`."""
    try:
        load()
    except Exception:
        return False
    return True


def load_error() -> BaseException | None:
    return _error


def how_loaded() -> str | None:
    """'built' (this process compiled it), 'waited' (another process did, this one waited on the lock),
    'cache' (found built), or None (not loaded)."""
    return _how


def has_cuda_kernels() -> bool:
    """Whether the loaded extension was built with its CUDA kernels."""
    load()
    return bool(torch.ops.fastopt.has_cuda())
