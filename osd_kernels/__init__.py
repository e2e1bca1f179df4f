"""osd_kernels: the native ops of osd, registered as ``torch.ops.osd.*``.

Each op has a pure-PyTorch reference (``<op>_reference``), a C++ CPU kernel and CUDA
kernel behind ``torch.ops.osd.<op>``, and (where useful) a Triton kernel. The public
function of the same name checks its inputs and dispatches (``backend="auto"``). The
fused decode-layer ops (``add_rms_norm``, ``silu_mul``, ``rope_kv_write``) have a
reference, a C++ CPU kernel and a Triton kernel, ``decode_gemv`` (a GPU GEMV) a reference
and a Triton kernel: no CUDA kernels, ``auto`` is Triton on CUDA. ``topk_probs`` (the
online learner's teacher rows) and ``argmax_finite`` (the greedy sampler and the check of
the target's logits) have a reference and a C++ CPU kernel; on CUDA they are the
references' device ops.
"""

from osd_kernels._ops import native_available, use_amx, use_avx512, use_vnni
from osd_kernels.decode_linear import decode_linear, decode_linear_reference, pack_weight
from osd_kernels.quant_linear import dequantize_weight, quant_linear, quant_linear_reference
from osd_kernels.kv_rollback import chain_rollback, kv_rollback, kv_rollback_reference
from osd_kernels.rejection_sample import rejection_sample, rejection_sample_reference
from osd_kernels.distill_loss import distill_loss, distill_loss_reference
from osd_kernels.tree_attention import (
    causal_tree_mask,
    tree_attention,
    tree_attention_reference,
    tree_mask_from_parents,
)
from osd_kernels.tree_rejection_sample import tree_rejection_sample, tree_rejection_sample_reference
from osd_kernels.add_rms_norm import add_rms_norm, add_rms_norm_reference
from osd_kernels.silu_mul import silu_mul, silu_mul_reference
from osd_kernels.rope_kv_write import rope_kv_write, rope_kv_write_reference
from osd_kernels.decode_gemv import decode_gemv, decode_gemv_reference
from osd_kernels.decoder_layers import decoder_layers, decoder_layers_reference
from osd_kernels.topk_probs import topk_probs, topk_probs_reference
from osd_kernels.argmax_finite import argmax_finite, argmax_finite_reference

__all__ = [
    "native_available",
    "use_avx512",
    "use_amx",
    "use_vnni",
    "decode_linear",
    "decode_linear_reference",
    "pack_weight",
    "quant_linear",
    "quant_linear_reference",
    "dequantize_weight",
    "kv_rollback",
    "kv_rollback_reference",
    "chain_rollback",
    "rejection_sample",
    "rejection_sample_reference",
    "tree_attention",
    "tree_attention_reference",
    "causal_tree_mask",
    "tree_mask_from_parents",
    "distill_loss",
    "distill_loss_reference",
    "tree_rejection_sample",
    "tree_rejection_sample_reference",
    "add_rms_norm",
    "add_rms_norm_reference",
    "silu_mul",
    "silu_mul_reference",
    "topk_probs",
    "topk_probs_reference",
    "argmax_finite",
    "argmax_finite_reference",
    "rope_kv_write",
    "rope_kv_write_reference",
    "decode_gemv",
    "decode_gemv_reference",
    "decoder_layers",
    "decoder_layers_reference",
]
