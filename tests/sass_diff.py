"""Whether a change to the Triton kernels changed the machine code they compile to, on a machine without a GPU.

    TRITON_CACHE_DIR=/tmp/tc_before python tests/compile_check.py    # at the parent
    TRITON_CACHE_DIR=/tmp/tc_after python tests/compile_check.py     # with the change
    python tests/sass_diff.py /tmp/tc_before /tmp/tc_after

Pairs the cubins of the two caches by kernel name and compares the multisets of their SASS (cuobjdump -sass,
Triton's own copy when none is on PATH; addresses and encodings left out): a refactor that every
specialization compiles to the same instructions needs no GPU to time it. Exit status 1 when any kernel
differs, naming it and how many of its specializations match.
"""
from __future__ import annotations

import collections
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys


def _cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass(cubin: str, tool: str) -> str:
    out = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    keep = []
    for line in out.splitlines():
        line = re.sub(r"/\*[0-9a-f]{4,}\*/|/\* 0x[0-9a-f]+ \*/", "", line).strip()
        if line and not line.startswith(("code for", "Function :", ".", "Fatbin", "=====", "arch", "code version",
                                         "host", "compile_size", "identifier")):
            keep.append(line)
    return "\n".join(keep)


def collect(cache: str, tool: str) -> dict:
    """kernel name -> Counter of the SASS digests of its specializations in a Triton cache."""
    found = collections.defaultdict(collections.Counter)
    for cubin in glob.glob(os.path.join(cache, "*", "*.cubin")):
        found[os.path.basename(cubin)[:-len(".cubin")]][hashlib.sha1(sass(cubin, tool).encode()).hexdigest()] += 1
    return found


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__)
        return 2
    tool = _cuobjdump()
    before, after = (collect(a, tool) for a in args)
    if not before or not after:
        print(f"no cubins in {args[0] if not before else args[1]}")
        return 2
    differ = 0
    for name in sorted(set(before) | set(after)):
        a, b = before[name], after[name]
        if a != b:
            differ += 1
            print(f"DIFF {name}: {sum(a.values())} specializations before, {sum(b.values())} after, "
                  f"{sum((a & b).values())} of them with the same SASS")
    print(f"{len(set(before) | set(after)) - differ} kernels compile to the same SASS, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
