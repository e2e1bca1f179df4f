"""Compile every Triton kernel of ``osd_kernels/triton`` for a GPU target, without a GPU.

Usage: python scripts/triton_check.py [--arch 90] [--triton-version 3.6.0] [-j 2] [-v]

Each kernel launched by the wrappers is compiled through Triton's whole pipeline
(TTIR, TTGIR, LLVM IR, PTX and, with the ptxas that Triton ships, a cubin) for
``sm_<arch>`` once per specialisation the wrappers produce: input dtypes (fp32, bf16,
fp16), the constexpr flags (``HAS_Q``, ``HAS_MASK``, ``LOSS``, ...) and the block sizes
the wrappers pick on a GPU, with the launch options they pass. Scalar arguments are typed
the way Triton's launcher types them (an int equal to 1 becomes the constexpr 1, other
ints i32 or i64, floats fp32; pointers and multiples of 16 carry the divisibility hint).

Coverage is checked too: every ``@triton.jit`` function defined under ``osd_kernels/triton``
must be a kernel some spec compiles or be called, directly or through other helpers, by
one; a kernel whose parameters differ from its spec fails. The script exits 1
listing every failure; nothing is skipped. A kernel that compiles here can still fail at
run time, but one that fails here cannot run on that GPU with this Triton.

The specs live in ``scripts/triton_checks/``, one module per kernel family; each module's
``SPEC_BUILDERS`` lists functions returning :class:`~triton_checks.common.Spec` lists.
To check a new kernel, add a module there (or a builder to an existing module).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import importlib
import inspect
import multiprocessing
import os
import pkgutil
import sys
import textwrap
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The package clears TRITON_INTERPRET before triton is imported, so it comes first.
import triton_checks  # noqa: E402, I001
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import osd_kernels.triton as kernels_pkg  # noqa: E402
from triton_checks.common import Ptr, Spec, load  # noqa: E402


def _signature(spec: Spec, kernel: JITFunction):
    """(signature, constexprs, attrs) as Triton's launcher derives them from the arguments."""
    names = list(kernel.arg_names)
    given = set(spec.args) | set(spec.constexprs)
    if given != set(names):
        missing = [n for n in names if n not in given]
        extra = sorted(given - set(names))
        raise ValueError(
            f"spec does not match the kernel's parameters: missing {missing}, unknown {extra}"
        )
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in spec.constexprs:
            signature[name] = "constexpr"
            constexprs[name] = spec.constexprs[name]
            continue
        value = spec.args[name]
        if isinstance(value, Ptr):
            signature[name] = "*" + value.dtype
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif isinstance(value, bool):
            signature[name] = "u1"
        elif isinstance(value, int):
            if value == 1:  # the launcher turns an int 1 into a constexpr
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"argument {name}: unsupported value {value!r}")
    return signature, constexprs, attrs


def compile_spec(spec: Spec, arch: int) -> tuple[str, float, str]:
    """Compile one spec; returns (stage reached or 'FAILED', seconds, error text)."""
    start = time.perf_counter()
    try:
        kernel = load(spec.kernel)
        signature, constexprs, attrs = _signature(spec, kernel)
        src = triton.compiler.ASTSource(
            fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs
        )
        compiled = triton.compile(
            src, target=GPUTarget("cuda", arch, 32), options=dict(spec.options)
        )
        stages = [s for s in ("ttir", "ttgir", "llir", "ptx", "cubin") if s in compiled.asm]
        if "ptx" not in stages:
            raise RuntimeError(f"compilation stopped before PTX (stages: {stages})")
        return stages[-1], time.perf_counter() - start, ""
    except Exception:  # every failure is reported, none is fatal to the others
        return "FAILED", time.perf_counter() - start, traceback.format_exc(limit=6)


def _callees(fn: JITFunction) -> set:
    """The @triton.jit functions ``fn`` calls (names resolved in its module's globals)."""

    def resolve(node):
        if isinstance(node, ast.Name):
            return fn.fn.__globals__.get(node.id)
        if isinstance(node, ast.Attribute):
            base = resolve(node.value)
            return getattr(base, node.attr, None) if base is not None else None
        return None

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            obj = resolve(node.func)
            if isinstance(obj, JITFunction):
                found.add(obj)
    return found


def coverage_errors(specs: list) -> list:
    """Names of @triton.jit functions under osd_kernels/triton that no spec compiles."""
    defined = {}
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        module = importlib.import_module(f"osd_kernels.triton.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__:
                defined[obj] = f"{info.name}.{name}"
    reached, todo = set(), [load(s.kernel) for s in specs]
    while todo:
        fn = todo.pop()
        if fn not in reached:
            reached.add(fn)
            todo.extend(_callees(fn))
    return sorted(path for fn, path in defined.items() if fn not in reached)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, 90 = sm_90")
    ap.add_argument("--triton-version", help="fail unless this Triton version is imported")
    ap.add_argument("-j", "--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per compilation")
    args = ap.parse_args()
    tag = f"triton-check (Triton {triton.__version__}, sm_{args.arch})"
    if args.triton_version and triton.__version__ != args.triton_version:
        print(f"{tag}: expected Triton {args.triton_version} ({triton.__file__})")
        return 1
    start = time.perf_counter()
    specs = []
    spec_builders, failures = triton_checks.builders()
    for build in spec_builders:
        try:
            specs += build()
        except Exception:
            failures.append((f"{build.__module__}.{build.__name__}", traceback.format_exc(limit=4)))
    failures += [
        (f"{name}: no spec compiles it (add one under scripts/triton_checks/)", "")
        for name in coverage_errors(specs)
    ]
    # fork: the workers inherit the imported kernels; Triton compiles in the child only
    with cf.ProcessPoolExecutor(
        max_workers=args.jobs, mp_context=multiprocessing.get_context("fork")
    ) as pool:
        results = list(pool.map(compile_spec, specs, [args.arch] * len(specs)))
    stages = {}
    for spec, (stage, seconds, error) in zip(specs, results):
        if stage == "FAILED":
            failures.append((f"{spec.kernel} [{spec.label}]", error))
        else:
            stages[stage] = stages.get(stage, 0) + 1
        if args.verbose or stage == "FAILED":
            print(f"{tag}: {spec.kernel} [{spec.label}]: {stage} ({seconds:.1f} s)")
    for what, error in failures:
        print(f"{tag}: FAILED {what}\n{textwrap.indent(error.rstrip(), '    ')}".rstrip())
    kernels = len({s.kernel for s in specs})
    reached = ", ".join(f"{n} to {stage}" for stage, n in sorted(stages.items()))
    print(
        f"{tag}: {len(specs) - sum(r[0] == 'FAILED' for r in results)}/{len(specs)} "
        f"compilations of {kernels} kernels ({reached or 'none'}), {len(failures)} failures, "
        f"{time.perf_counter() - start:.0f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
