"""distill_loss: the full-vocabulary and top-k distillation loss kernels."""

from __future__ import annotations

import math

import triton

from osd_kernels.distill_loss import LOSSES, RKL_LOG_P_FLOOR, TOPK_LEFTOVER_EPS
from triton_checks.common import Ptr, Spec


def distill_loss_specs():
    beta = 0.5
    scalars = dict(beta=beta, log_beta=math.log(beta), log_1mb=math.log1p(-beta))

    def full(dtype, target, loss, has_mask, block_v=4096):
        V = 32000 if block_v == 4096 else 111
        args = dict(
            z_ptr=Ptr(dtype),
            t_ptr=Ptr(target),
            mask_ptr=Ptr("u1" if has_mask else "fp32"),
            loss_ptr=Ptr("fp32"),
            grad_ptr=Ptr(dtype),
            vocab=V,
            sz_n=V,
            sz_v=1,
            st_n=V,
            st_v=1,
            **scalars,
        )
        return Spec(
            "distill_loss._distill_full_kernel",
            f"{LOSSES[loss]}, draft {dtype}, target {target}, V={V}{', mask' if has_mask else ''}",
            args,
            dict(LOSS=loss, RKL_FLOOR=RKL_LOG_P_FLOOR, HAS_MASK=has_mask, BLOCK_V=block_v),
            {"num_warps": 8},
        )

    def topk(dtype, probs, loss, has_mask, k):
        V = 32000
        block_k = triton.next_power_of_2(k)
        block_v = min(max(64, 8192 // block_k), triton.next_power_of_2(V))
        args = dict(
            z_ptr=Ptr(dtype),
            ids_ptr=Ptr("i64"),
            probs_ptr=Ptr(probs),
            mask_ptr=Ptr("u1" if has_mask else "fp32"),
            loss_ptr=Ptr("fp32"),
            grad_ptr=Ptr(dtype),
            vocab=V,
            topk=k,
            sz_n=V,
            sz_v=1,
            si_n=k,
            si_k=1,
            sp_n=k,
            sp_k=1,
            **scalars,
        )
        return Spec(
            "distill_loss._distill_topk_kernel",
            f"{LOSSES[loss]}, draft {dtype}, top-{k} probs {probs}{', mask' if has_mask else ''}",
            args,
            dict(
                LOSS=loss,
                RKL_FLOOR=RKL_LOG_P_FLOOR,
                HAS_MASK=has_mask,
                LEFTOVER_EPS=TOPK_LEFTOVER_EPS,
                BLOCK_V=block_v,
                BLOCK_K=block_k,
            ),
            {"num_warps": 8},
        )

    out = []
    for loss in range(len(LOSSES)):
        out.append(full("fp32", "fp32", loss, loss % 2 == 0))
        out.append(topk("fp32", "fp32", loss, loss % 2 == 1, 50))
    for dtype in ("bf16", "fp16"):
        out.append(full(dtype, dtype, 0, True))
        out.append(full(dtype, "fp32", 2, False, block_v=128))
        out.append(topk(dtype, dtype, 1, False, 8))
    return out


SPEC_BUILDERS = (distill_loss_specs,)
