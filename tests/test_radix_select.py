"""Radix selection of the top-k and top-p thresholds (csrc/kernels/radix_select.h, the code
the CPU and CUDA samplers share) against sort-based references, on rows with ties, odd
sizes, -inf, -0, 16-bit values, top_k >= V, top_p = 1 and tiny top_p. The header is
torch-free: tests/radix_select_driver.cpp is compiled with the host C++ compiler."""

import math
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CXX = shutil.which("c++") or shutil.which("g++")
LEVELS = {"float32": 4, "float16": 3, "bfloat16": 2}
SIZES = [1, 7, 1000, 50_257]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler")
    exe = str(tmp_path_factory.mktemp("radix") / "radix_select_driver")
    subprocess.run(
        [
            CXX,
            "-std=c++17",
            "-O2",
            "-I",
            os.path.join(ROOT, "csrc"),
            os.path.join(ROOT, "tests", "radix_select_driver.cpp"),
            "-o",
            exe,
        ],
        check=True,
    )
    return exe


def _run(exe, rows):
    """rows: (mode, levels, k, temperature, top_p, inv_z, values) -> [(key, floor)]."""
    buf = [struct.pack("<i", len(rows))]
    for mode, levels, k, t, top_p, inv_z, x in rows:
        x = np.ascontiguousarray(x, dtype=np.float32)
        buf.append(struct.pack("<iiqqfff", mode, levels, x.size, k, t, top_p, inv_z))
        buf.append(x.tobytes())
    out = subprocess.run([exe], input=b"".join(buf), capture_output=True, check=True).stdout
    return np.frombuffer(out, dtype=np.uint32).reshape(len(rows), 2).tolist()


def keys(x):
    """radix_key: order-preserving uint32 keys of float32 values (-0 as +0)."""
    u = (np.asarray(x, dtype=np.float32) + np.float32(0)).view(np.uint32)
    return np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)


def key_float(k):
    k = np.uint32(k)
    u = k & np.uint32(0x7FFFFFFF) if k & 0x80000000 else ~k
    return np.array([u], dtype=np.uint32).view(np.float32)[0]


def _row(rng, n, kind, dtype):
    x = rng.standard_normal(n).astype(np.float32) * 3
    if kind == "ties":
        x = rng.integers(-4, 5, n).astype(np.float32)
    elif kind == "neginf":
        x[rng.random(n) < 0.5] = -np.inf
    elif kind == "zeros":
        x = np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0))
        x[rng.random(n) < 0.2] = 1.0
    if dtype == "float16":
        x = x.astype(np.float16).astype(np.float32)
    elif dtype == "bfloat16":
        x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return x


def _ks(rng, n):
    return sorted({1, n, max(1, n - 1), int(rng.integers(1, n + 1)), min(n, 50)})


@pytest.mark.parametrize("dtype", list(LEVELS))
@pytest.mark.parametrize("kind", ["normal", "ties", "neginf", "zeros"])
def test_top_k_threshold_is_the_kth_largest(driver, dtype, kind):
    rng = np.random.default_rng(len(kind) * 10 + LEVELS[dtype])
    rows, want = [], []
    for n in SIZES:
        x = _row(rng, n, kind, dtype)
        ordered = np.sort(keys(x))[::-1]
        for k in _ks(rng, n):
            for t in (1.0, 0.7, 3.0, 1e-3):
                rows.append((0, LEVELS[dtype], k, t, 1.0, 1.0, x))
                want.append((int(ordered[k - 1]), x, k, t))
    for (key, floor), (kth, x, k, t) in zip(_run(driver, rows), want):
        assert key == kth
        # the floor turns "l / t >= the k-th largest of l / t" into a test on raw keys
        t = np.float32(t)
        kth_scaled = np.sort(x / t)[::-1][k - 1]
        assert kth_scaled == key_float(kth) / t
        with np.errstate(invalid="ignore"):
            assert np.array_equal(keys(x) >= floor, x / t >= kth_scaled)
            assert floor <= kth and key_float(floor) / t >= kth_scaled
            assert floor == 0 or not key_float(floor - 1) / t >= kth_scaled


def _top_p_reference(p, top_p):
    """Smallest key T with (fixed-point) mass(key > T) < top_p, by sorting."""
    k = keys(p)
    mass = np.array([int(float(v) * 2**48) for v in p], dtype=np.uint64)
    order = np.argsort(k, kind="stable")[::-1]
    cum = np.cumsum(mass[order], dtype=np.uint64)
    target = math.ceil(float(np.float32(top_p)) * 2**48)
    hit = np.nonzero(cum >= target)[0]
    return int(k[order[hit[0]]]) if hit.size else 0


@pytest.mark.parametrize("kind", ["normal", "ties", "neginf", "peaked"])
def test_top_p_threshold_matches_the_sorted_cumsum(driver, kind):
    rng = np.random.default_rng(len(kind))
    rows, want = [], []
    for n in SIZES:
        s = _row(rng, n, "ties" if kind == "ties" else "normal", "float32")
        if kind == "neginf":
            s[rng.random(n) < 0.7] = -np.inf
            s[0] = 0.0
        elif kind == "peaked":
            s = s * 8
        e = np.exp(s - s.max()).astype(np.float32)
        inv_z = np.float32(1) / e.sum(dtype=np.float32)
        p = e * inv_z
        for top_p in (1.0, 0.999, 0.9, 0.5, 1e-6, 1e-30, 1e-45):
            rows.append((1, 4, 0, 1.0, top_p, inv_z, e))
            want.append(_top_p_reference(p, top_p))
    for (key, _), ref in zip(_run(driver, rows), want):
        assert key == ref


def test_tiny_top_p_keeps_the_mode_and_its_ties(driver):
    p = np.array([0.1, 0.3, 0.3, 0.2, 0.1], dtype=np.float32)
    for top_p in (1e-6, 0.3):
        ((key, _),) = _run(driver, [(1, 4, 0, 1.0, top_p, 1.0, p)])
        assert np.array_equal(keys(p) >= key, [False, True, True, False, False])
    ((key, _),) = _run(driver, [(1, 4, 0, 1.0, 0.61, 1.0, p)])
    assert np.array_equal(keys(p) >= key, [False, True, True, True, False])
