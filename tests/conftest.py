"""Shared test setup. No device query at import time beyond torch.cuda.is_available()."""
import os

import torch

# Triton kernels run on CPU tensors through the interpreter; it must be set before triton
# is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def devices():
    """Devices every op test runs on: cpu, plus cuda when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=devices())
def device(request):
    return torch.device(request.param)


def backends_for(device: torch.device, has_triton: bool = True):
    """Backends to compare against the reference on ``device``."""
    out = ["native"]
    if has_triton:
        out.append("triton")
    return out
