"""osd_kernels: the native ops of osd, registered as ``torch.ops.osd.*``.

Each op has a pure-PyTorch reference (``<op>_reference``), a C++ CPU kernel and CUDA
kernel behind ``torch.ops.osd.<op>``, and (where useful) a Triton kernel. The public
function of the same name checks its inputs and dispatches (``backend="auto"``).
"""
from osd_kernels._ops import native_available
from osd_kernels.kv_rollback import chain_rollback, kv_rollback, kv_rollback_reference

__all__ = [
    "native_available",
    "kv_rollback",
    "kv_rollback_reference",
    "chain_rollback",
]
