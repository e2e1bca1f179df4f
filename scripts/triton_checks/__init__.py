"""Compilation specs for ``scripts/triton_check.py``, one module per kernel family.

Every module here (other than :mod:`.common`) defines ``SPEC_BUILDERS``: a tuple of
functions that each return a list of :class:`~triton_checks.common.Spec`, one per
specialisation its wrappers launch on a GPU. :func:`builders` finds them, so checking a
new kernel means adding a module (or a function to an existing module's ``SPEC_BUILDERS``);
the driver needs no edit.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import traceback

# Compile for a real target: the interpreter must be off before triton is imported.
os.environ.pop("TRITON_INTERPRET", None)
# Triton 3.9 warns while this is unset; 1 is its default (kernels launched without
# enable_fp_fusion contract multiply-adds)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def builders() -> tuple[list, list]:
    """(spec builders of every check module, [(module, traceback)] for modules that failed
    to import). A module that fails to import is reported, not fatal to the others."""
    found, failures = [], []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "common":
            continue
        try:
            module = importlib.import_module(f"{__name__}.{info.name}")
        except Exception:
            failures.append((f"{__name__}.{info.name}", traceback.format_exc(limit=4)))
            continue
        found.extend(getattr(module, "SPEC_BUILDERS", ()))
    return found, failures
