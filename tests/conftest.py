"""Shared test setup. No device query at import time beyond torch.cuda.is_available()."""

import os

import torch

# Triton kernels run on CPU tensors through the interpreter; it must be set before triton
# is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def devices():
    """Devices every op test runs on: cpu, plus cuda (marked ``gpu``) when present."""
    cuda = pytest.param("cuda", marks=pytest.mark.gpu)
    return ["cpu", cuda] if torch.cuda.is_available() else ["cpu"]


def slow_case(*values, **kwargs):
    """A ``parametrize`` case marked ``slow`` (left out of ``make test-fast``)."""
    return pytest.param(*values, marks=pytest.mark.slow, **kwargs)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(params=devices())
def device(request):
    return torch.device(request.param)


def set_isa(monkeypatch, env: dict) -> None:
    """Run the native CPU kernels on the instruction sets ``env`` leaves them
    (``{"OSD_NO_AVX512": "1"}``: AVX2 or portable; ``{}``: the best the CPU has); the
    kernels read these variables at each call."""
    for name in ("OSD_NO_AVX512", "OSD_NO_AVX2"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def backends_for(device: torch.device, has_triton: bool = True):
    """Backends to compare against the reference on ``device``."""
    out = ["native"]
    if has_triton:
        out.append("triton")
    return out


@pytest.fixture(autouse=True, scope="session")
def one_thread_session():
    """One intra-op thread for the module- and session-scoped fixtures too (built before
    ``one_thread`` runs): under load the trained EAGLE draft of ``tests/test_eagle.py``
    took 9 to 40 s to build with two threads."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def one_thread(one_thread_session):
    """Run every test with one intra-op thread: the tests use tiny shapes that gain nothing
    from threads, and on a shared 2-core machine OpenMP contention made small ops tens of
    times slower (measured: rms_norm 1 ms with 1 thread, 62 ms with 2 under load). Tests of
    the C++ kernels' parallel paths raise the count themselves (``threads`` fixture)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def threads():
    """Let a test use every core (exercises at::parallel_for in the C++ kernels)."""
    torch.set_num_threads(max(2, os_cpu_count()))
    yield


def os_cpu_count() -> int:
    return os.cpu_count() or 2
