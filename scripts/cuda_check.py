"""Compile every torch-free CUDA source with nvcc for sm_90a and fail on any error.

Usage: python scripts/cuda_check.py --nvcc nvcc csrc/kernels/*.cu
"""

import argparse
import concurrent.futures as cf
import os
import subprocess
import sys
import tempfile

ARCH = "-gencode=arch=compute_90a,code=sm_90a"


def compile_one(nvcc: str, src: str, outdir: str) -> tuple[str, int, str]:
    out = os.path.join(outdir, os.path.basename(src) + ".o")
    cmd = [nvcc, ARCH, "-std=c++17", "-O3", "-Icsrc", "-c", src, "-o", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return src, proc.returncode, proc.stdout + proc.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("sources", nargs="*")
    args = ap.parse_args()
    if not args.sources:
        print("cuda-check: no .cu sources")
        return 0
    failed = 0
    with tempfile.TemporaryDirectory() as tmp, cf.ThreadPoolExecutor(max_workers=2) as pool:
        for src, rc, log in pool.map(lambda s: compile_one(args.nvcc, s, tmp), args.sources):
            status = "ok" if rc == 0 else "FAILED"
            print(f"cuda-check: {src}: {status}")
            if rc != 0:
                failed += 1
                print(log)
    print(f"cuda-check: {len(args.sources) - failed}/{len(args.sources)} compiled for sm_90a")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
