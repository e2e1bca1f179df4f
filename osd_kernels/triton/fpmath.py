"""Correctly rounded division and CUDA's exp/log for the Triton samplers.

On a GPU (Triton 3.6 and 3.9, sm_90) Triton compiles ``a / b`` on float32 to
``div.full.f32`` (up to 2 ulp off) and ``tl.exp`` to ``ex2.approx.f32`` after a multiply by
log2(e); ``tl.log`` becomes libdevice's logf with subnormals flushed to zero. The C++ and
CUDA kernels divide with IEEE rounding and call ``expf`` / ``logf``. Wherever a token
decision depends on the value (accept tests, race keys, probabilities compared with a
top-p threshold) the samplers use these helpers instead:

- :func:`div`: ``tl.math.div_rn``, IEEE round-to-nearest (``div.rn.f32``), as in C++ and
  CUDA;
- :func:`exp`, :func:`log`: libdevice's ``__nv_expf`` / ``__nv_logf``, the functions CUDA's
  ``expf`` / ``logf`` are, so the Triton and CUDA samplers compute the same floats. Launch
  with :func:`launch_options` so that libdevice keeps subnormals (as CUDA does without
  ``-ftz``) and no multiply-add is contracted into an FMA.

The Triton interpreter (``TRITON_INTERPRET=1``) cannot call libdevice, so there the
helpers run ``tl.exp`` / ``tl.log`` (NumPy's float32 functions, within 2.52 and 3.83 ulp).
The C++ CPU kernels use their own exp polynomial, so on CPU the backends agree token for
token up to float rounding, as the samplers' docstrings state; ``tests/test_rejection_sample.py``
checks the helpers' error bounds on every device.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def div(a, b):
    """``a / b`` in float32 with IEEE round-to-nearest, broadcast over the arguments."""
    a, b = tl.broadcast(tl.cast(a, tl.float32), tl.cast(b, tl.float32))
    return tl.math.div_rn(a, b)


@triton.jit
def exp(x):
    """``expf(x)``: libdevice's ``__nv_expf`` on a GPU, NumPy's float32 exp interpreted."""
    if INTERPRETED:
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def log(x):
    """``logf(x)``: libdevice's ``__nv_logf`` on a GPU, NumPy's float32 log interpreted."""
    if INTERPRETED:
        y = tl.log(x)
    else:
        y = libdevice.log(x)
    return y


# True when @triton.jit functions run in the interpreter (``triton.jit`` then returns an
# InterpretedFunction); a constexpr, so the compiler only sees the libdevice branches.
INTERPRETED = tl.constexpr(not isinstance(div, triton.runtime.JITFunction))


def launch_options(device) -> dict:
    """Compiler options for a sampler launch on ``device``: no FMA contraction and no
    flush-to-zero in libdevice on a GPU; nothing under the interpreter (CPU tensors)."""
    if device.type == "cpu":
        return {}
    return {"enable_fp_fusion": False, "enable_reflect_ftz": False}
