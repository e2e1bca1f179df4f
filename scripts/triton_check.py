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
must be a kernel listed in :data:`SPECS` or be called, directly or through other helpers,
by one; a kernel whose parameters differ from its entry here fails. The script exits 1
listing every failure; nothing is skipped. A kernel that compiles here can still fail at
run time, but one that fails here cannot run on that GPU with this Triton.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import importlib
import inspect
import math
import os
import pkgutil
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field

# Compile for a real target: the interpreter must be off before triton is imported.
os.environ.pop("TRITON_INTERPRET", None)
# Triton 3.9 warns while this is unset; 1 is its default (kernels launched without
# enable_fp_fusion contract multiply-adds)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import osd_kernels.triton as kernels_pkg  # noqa: E402


@dataclass(frozen=True)
class Ptr:
    """A tensor argument: its Triton element type (``fp32``, ``bf16``, ``i64``, ``u1``...)."""

    dtype: str


@dataclass
class Spec:
    """One compilation: a kernel, every runtime argument's representative value, the
    constexpr arguments and the launch options."""

    kernel: str  # "module.function" under osd_kernels.triton
    label: str
    args: dict
    constexprs: dict
    options: dict = field(default_factory=dict)


# Options the samplers launch with on a GPU (osd_kernels.triton.fpmath.launch_options).
SAMPLER_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}
FLOATS = ("fp32", "bf16", "fp16")


def _rejection_sample_specs():
    def spec(label, dtype, q_dtype, contiguous, block_v, block_k):
        vocab = 32000 if block_v == 1024 else 100
        lb, lk, lv = (5 * vocab, vocab, 1) if contiguous else (40 * vocab, 8 * vocab, 2)
        args = dict(
            logits_ptr=Ptr(dtype),
            stride_lb=lb,
            stride_lk=lk,
            stride_lv=lv,
            draft_ptr=Ptr("i64"),
            stride_db=4,
            stride_dk=1 if contiguous else 3,
            q_ptr=Ptr(q_dtype or dtype),
            stride_qb=4 * vocab,
            stride_qk=vocab,
            stride_qv=1 if contiguous else 3,
            num_draft_ptr=Ptr("i32"),
            temperature_ptr=Ptr("fp32"),
            top_k_ptr=Ptr("i32"),
            top_p_ptr=Ptr("fp32"),
            seed_ptr=Ptr("i64"),
            offset_ptr=Ptr("i64"),
            out_ptr=Ptr("i64"),
            accepted_ptr=Ptr("i32"),
            max_draft=4,
            vocab=vocab,
        )
        return Spec(
            "rejection_sample._rejection_sample_kernel",
            label,
            args,
            dict(HAS_Q=q_dtype is not None, BLOCK_V=block_v, BLOCK_K=block_k),
            SAMPLER_OPTIONS,
        )

    out = []
    for dtype in FLOATS:
        out.append(spec(f"{dtype} logits, draft probs {dtype}", dtype, dtype, True, 1024, 8))
        out.append(spec(f"{dtype} logits, one-hot drafts", dtype, None, True, 1024, 8))
    out.append(spec("fp32 logits, fp32 probs, strided, V=100", "fp32", "fp32", False, 128, 2))
    out.append(spec("bf16 logits, fp32 probs", "bf16", "fp32", True, 1024, 8))
    return out


def _tree_rejection_sample_specs():
    def spec(label, dtype, has_q, without_replacement, block=1024, t_block=16):
        V = 32000 if block == 1024 else 100
        args = dict(
            logits_ptr=Ptr(dtype),
            sl_b=16 * V,
            sl_t=V,
            sl_v=1,
            tok_ptr=Ptr("i64"),
            st_b=16,
            st_t=1,
            par_ptr=Ptr("i32"),
            sp_b=16,
            sp_t=1,
            q_ptr=Ptr(dtype),
            sq_b=16 * V,
            sq_t=V,
            sq_v=1,
            temp_ptr=Ptr("fp32"),
            topk_ptr=Ptr("i32"),
            topp_ptr=Ptr("fp32"),
            seed_ptr=Ptr("i64"),
            offset_ptr=Ptr("i64"),
            nodes_ptr=Ptr("i64"),
            out_ptr=Ptr("i64"),
            nacc_ptr=Ptr("i32"),
            work_ptr=Ptr("fp32"),
            T=13,
            V=V,
            D=4,
        )
        return Spec(
            "tree_rejection_sample._tree_rejection_sample_kernel",
            label,
            args,
            dict(
                HAS_Q=has_q, WITHOUT_REPLACEMENT=without_replacement, BLOCK=block, T_BLOCK=t_block
            ),
            SAMPLER_OPTIONS,
        )

    out = []
    for dtype in FLOATS:
        for has_q in (True, False):
            for wr in (True, False):
                if dtype != "fp32" and wr:
                    continue
                out.append(
                    spec(
                        f"{dtype}, {'draft probs' if has_q else 'point masses'}"
                        f"{', without replacement' if wr else ''}",
                        dtype,
                        has_q,
                        wr,
                    )
                )
    out.append(spec("fp32, draft probs, V=100", "fp32", True, False, block=128, t_block=8))
    return out


def _distill_loss_specs():
    from osd_kernels.distill_loss import LOSSES, RKL_LOG_P_FLOOR, TOPK_LEFTOVER_EPS

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


def _kv_rollback_specs():
    def spec(dtype, D, big):
        S, H, B = (1 << 16, 32, 64) if big else (256, 4, 3)
        s_s = D
        s_h = S * s_s
        s_b = H * s_h
        args = dict(
            kv_ptr=Ptr(dtype),
            lens_ptr=Ptr("i32"),
            slots_ptr=Ptr("i64"),
            keep_ptr=Ptr("i32"),
            num_heads=H,
            head_dim=D,
            stride_lk=B * s_b,
            stride_b=s_b,
            stride_h=s_h,
            stride_s=s_s,
            slots_stride_b=5,
        )
        return Spec(
            "kv_rollback._kv_rollback_kernel",
            f"{dtype}, D={D}{', strides past 2**31' if big else ''}",
            args,
            dict(BLOCK_D=min(triton.next_power_of_2(D), 256)),
        )

    out = [spec(dtype, 128, False) for dtype in FLOATS]
    out += [spec("bf16", 128, True), spec("fp32", 72, False)]
    for batch in (1, 3, 64):
        out.append(
            Spec(
                "kv_rollback._advance_lens_kernel",
                f"batch {batch}",
                dict(lens_ptr=Ptr("i32"), keep_ptr=Ptr("i32"), batch=batch),
                dict(BLOCK=triton.next_power_of_2(batch)),
            )
        )
    return out


def _tree_attention_specs():
    kernel = _load("tree_attention._tree_attention_kernel")
    module = sys.modules[kernel.fn.__module__]
    max_tree = getattr(module, "MAX_TREE", 64)

    def spec(dtype, has_mask, T, group, D):
        Hkv, S = 8, 4096
        Hq = Hkv * group
        block_m = max(16, min(64, triton.next_power_of_2(T * group)))
        args = dict(
            q_ptr=Ptr(dtype),
            k_ptr=Ptr(dtype),
            v_ptr=Ptr(dtype),
            out_ptr=Ptr(dtype),
            lens_ptr=Ptr("i32"),
            mask_ptr=Ptr("i64" if has_mask else "i32"),
            num_q=T,
            num_kv_heads=Hkv,
            group=group,
            head_dim=D,
            qk_scale=D**-0.5 * 1.4426950408889634,
            sq_b=T * Hq * D,
            sq_t=Hq * D,
            sq_h=D,
            sq_d=1,
            sk_b=Hkv * S * D,
            sk_h=S * D,
            sk_s=D,
            sk_d=1,
            sv_b=Hkv * S * D,
            sv_h=S * D,
            sv_s=D,
            sv_d=1,
            sm_b=T if has_mask else 0,
            sm_t=1 if has_mask else 0,
        )
        args = {k: v for k, v in args.items() if k in kernel.arg_names}
        return Spec(
            "tree_attention._tree_attention_kernel",
            f"{dtype}, T={T}, group {group}, D={D}{', tree mask' if has_mask else ''}",
            args,
            dict(
                HAS_MASK=has_mask,
                FP32_DOT=dtype == "fp32",
                BLOCK_M=block_m,
                BLOCK_N=64,
                BLOCK_T=max(16, min(max_tree, triton.next_power_of_2(T))),
                BLOCK_D=max(16, triton.next_power_of_2(D)),
            ),
        )

    split_configs = getattr(module, "SPLIT_CONFIGS", ((64, 4, 2),))
    split_align = getattr(module, "SPLIT_ALIGN_GPU", 128)

    def split(dtype, has_mask, T, group, D, splits, config):
        """_split_kv_kernel as the autotuner launches it with ``config``."""
        Hkv, S = 8, 32768
        Hq = Hkv * group
        block_n, warps, stages = config
        args = dict(
            q_ptr=Ptr(dtype),
            k_ptr=Ptr(dtype),
            v_ptr=Ptr(dtype),
            lens_ptr=Ptr("i32"),
            mask_ptr=Ptr("i64" if has_mask else "i32"),
            acc_ptr=Ptr("fp32"),
            m_ptr=Ptr("fp32"),
            l_ptr=Ptr("fp32"),
            num_q=T,
            num_kv_heads=Hkv,
            group=group,
            head_dim=D,
            qk_scale=D**-0.5 * 1.4426950408889634,
            num_splits=splits,
            kv_bucket=512,
            sq_b=T * Hq * D,
            sq_t=Hq * D,
            sq_h=D,
            sq_d=1,
            sk_b=Hkv * S * D,
            sk_h=S * D,
            sk_s=D,
            sk_d=1,
            sv_b=Hkv * S * D,
            sv_h=S * D,
            sv_s=D,
            sv_d=1,
            sm_b=T if has_mask else 0,
            sm_t=1 if has_mask else 0,
        )
        return Spec(
            "tree_attention._split_kv_kernel",
            f"{dtype}, T={T}, group {group}, D={D}, {splits} splits"
            f"{', tree mask' if has_mask else ''}, BLOCK_N={block_n}, {warps} warps, "
            f"{stages} stages",
            args,
            dict(
                HAS_MASK=has_mask,
                FP32_DOT=dtype == "fp32",
                SPLIT_ALIGN=split_align,
                BLOCK_M=max(16, min(64, triton.next_power_of_2(T * group))),
                BLOCK_N=block_n,
                BLOCK_T=max(16, min(max_tree, triton.next_power_of_2(T))),
                BLOCK_D=max(16, triton.next_power_of_2(D)),
            ),
            {"num_warps": warps, "num_stages": stages},
        )

    def combine(dtype, T, group, D, splits):
        """_split_kv_combine_kernel with the tile sizes the wrapper picks."""
        rows, parts = T * group, splits + 1
        block_s, block_d = triton.next_power_of_2(parts), max(16, triton.next_power_of_2(D))
        block_r = max(1, min(triton.next_power_of_2(rows), 8192 // (block_s * block_d)))
        args = dict(
            acc_ptr=Ptr("fp32"),
            m_ptr=Ptr("fp32"),
            l_ptr=Ptr("fp32"),
            out_ptr=Ptr(dtype),
            num_q=T,
            num_kv_heads=8,
            group=group,
            head_dim=D,
            num_parts=parts,
        )
        return Spec(
            "tree_attention._split_kv_combine_kernel",
            f"{dtype}, T={T}, group {group}, D={D}, {splits} splits",
            args,
            dict(BLOCK_S=block_s, BLOCK_R=block_r, BLOCK_D=block_d),
        )

    out = []
    for dtype in FLOATS:
        out.append(spec(dtype, True, 8, 4, 128))
        out.append(spec(dtype, False, 5, 1, 64))
    out.append(spec("bf16", True, 16, 4, 80))
    for config in split_configs:  # every autotune config, on the verify shape class
        out.append(split("bf16", True, 8, 4, 128, 33, config))
        out.append(split("bf16", False, 1, 4, 128, 16, config))
    for dtype in ("fp32", "fp16"):
        out.append(split(dtype, True, 8, 4, 128, 33, split_configs[0]))
        out.append(split(dtype, False, 1, 4, 128, 16, split_configs[0]))
    out.append(split("bf16", True, 64, 4, 128, 4, split_configs[-1]))
    out.append(split("bf16", False, 5, 3, 80, 6, split_configs[0]))
    for dtype in FLOATS:
        out.append(combine(dtype, 8, 4, 128, 33))
    out.append(combine("bf16", 1, 4, 128, 16))
    out.append(combine("bf16", 64, 4, 128, 4))
    out.append(combine("bf16", 5, 3, 80, 6))
    out.append(combine("bf16", 1, 1, 256, 63))
    return out


def _fused_layer_specs():
    """add_rms_norm, silu_mul, rope_kv_write and decode_gemv with the sizes and launch
    options their wrappers pick (osd_kernels/triton/{add_rms_norm,silu_mul,rope_kv_write,
    decode_gemv}.py)."""
    from osd_kernels.triton.add_rms_norm import MAX_HIDDEN
    from osd_kernels.triton.add_rms_norm import num_warps_for as norm_warps
    from osd_kernels.triton.decode_gemv import blocks_for as gemv_blocks
    from osd_kernels.triton.rope_kv_write import num_warps_for as rope_warps
    from osd_kernels.triton.silu_mul import block_for

    def norm(dtype, hidden, scale, row_stride=None):
        block = triton.next_power_of_2(hidden)
        args = dict(
            x_ptr=Ptr(dtype),
            res_ptr=Ptr(dtype),
            w_ptr=Ptr(dtype),
            res_out_ptr=Ptr(dtype),
            out_ptr=Ptr(dtype),
            hidden=hidden,
            eps=1e-5,
            scale=scale,
            sx_m=row_stride or hidden,
            sr_m=hidden,
        )
        return Spec(
            "add_rms_norm._add_rms_norm_kernel",
            f"{dtype}, H={hidden}{', scale' if scale != 1.0 else ''}",
            args,
            dict(HAS_SCALE=scale != 1.0, BLOCK=block),
            {"num_warps": norm_warps(block)},
        )

    def silu(dtype, inter):
        args = dict(gu_ptr=Ptr(dtype), out_ptr=Ptr(dtype), inter=inter, s_m=2 * inter)
        return Spec(
            "silu_mul._silu_mul_kernel",
            f"{dtype}, I={inter}",
            args,
            dict(BLOCK=block_for(inter)),
            {"num_warps": 4},
        )

    def rope(dtype, T, Hq, Hkv, D, R, big=False):
        B_max, S = (64, 32768) if big else (8, 2048)
        width = (Hq + 2 * Hkv) * D
        s_s, s_h = D, S * D
        s_b = Hkv * s_h
        args = dict(
            q_ptr=Ptr(dtype),
            k_ptr=Ptr(dtype),
            v_ptr=Ptr(dtype),
            cos_ptr=Ptr(dtype),
            sin_ptr=Ptr(dtype),
            kv_ptr=Ptr(dtype),
            slots_ptr=Ptr("i64"),
            out_ptr=Ptr(dtype),
            T=T,
            num_q_heads=Hq,
            head_dim=D,
            rot_dim=R,
            sq_b=T * width,
            sq_t=width,
            sq_h=D,
            sk_b=T * width,
            sk_t=width,
            sk_h=D,
            sv_b=T * width,
            sv_t=width,
            sv_h=D,
            sc_b=T * R,
            sc_t=R,
            ss_b=T * R,
            ss_t=R,
            sl_b=T,
            skv_kv=B_max * s_b,
            skv_b=s_b,
            skv_h=s_h,
            skv_s=s_s,
        )
        return Spec(
            "rope_kv_write._rope_kv_write_kernel",
            f"{dtype}, T={T}, Hq={Hq}, Hkv={Hkv}, D={D}, "
            f"{f'R={R}' if R else 'no RoPE'}{', strides past 2**31' if big else ''}",
            args,
            dict(ROPE=R > 0, BLOCK_D=triton.next_power_of_2(D)),
            {"num_warps": rope_warps(D)},
        )

    def gemv(dtype, M, K, N, bias=False, norm=False, gated=False, res=False, scale=1.0):
        block_m, block_n, block_k = gemv_blocks(M, K, gated)
        out_n = N // 2 if gated else N
        args = dict(
            x_ptr=Ptr(dtype),
            w_ptr=Ptr(dtype),
            b_ptr=Ptr(dtype),
            nw_ptr=Ptr(dtype),
            res_ptr=Ptr(dtype),
            out_ptr=Ptr(dtype),
            M=M,
            N=out_n,
            K=K,
            eps=1e-5,
            scale=scale,
            sx_m=K,
            sw_n=K,
            sr_m=out_n if res else 0,
        )
        flags = [
            f
            for f, on in (
                ("bias", bias),
                ("norm", norm),
                ("gated", gated),
                ("residual", res),
                ("scale", scale != 1.0),
            )
            if on
        ]
        return Spec(
            "decode_gemv._decode_gemv_kernel",
            f"{dtype}, M={M}, K={K}, N={N}{', ' if flags else ''}{', '.join(flags)}",
            args,
            dict(
                HAS_BIAS=bias,
                HAS_NORM=norm,
                GATED=gated,
                HAS_RES=res,
                HAS_SCALE=res and scale != 1.0,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_K=block_k,
            ),
            {"num_warps": 4},
        )

    out = []
    for dtype in FLOATS:  # a 1.1B Llama's layer at batch 1: qkv, wo, gate-up, down
        out += [
            gemv(dtype, 1, 2048, 2560, norm=True),
            gemv(dtype, 1, 2048, 2048, res=True),
            gemv(dtype, 1, 2048, 11264, norm=True, gated=True),
            gemv(dtype, 1, 5632, 2048, res=True),
        ]
    for M in (2, 4, 5, 8):
        out += [
            gemv("bf16", M, 2048, 2560, norm=True),
            gemv("bf16", M, 2048, 11264, norm=True, gated=True),
            gemv("bf16", M, 5632, 2048, res=True),
        ]
    out += [
        gemv("bf16", 1, 896, 1152, bias=True, norm=True),  # Qwen2 qkv
        gemv("bf16", 3, 2048, 2048, res=True, scale=0.22),  # Granite
        gemv("bf16", 1, 2048, 32000, norm=True),  # output head
        gemv("fp32", 7, 999, 77),
        gemv("bf16", 1, 999, 78, bias=True, gated=True),
    ]
    for dtype in FLOATS:
        out += [
            norm(dtype, 2048, 1.0),
            norm(dtype, 4096, 0.22),
            silu(dtype, 5632),
            rope(dtype, 1, 32, 4, 64, 64),
            rope(dtype, 8, 32, 8, 128, 128),
            rope(dtype, 1, 32, 8, 128, 0),
        ]
    out += [
        norm("bf16", 999, 1.0, row_stride=3 * 999),
        norm("bf16", MAX_HIDDEN, 1.0),
        silu("bf16", 45),
        silu("fp32", 14336),
        rope("bf16", 5, 24, 8, 96, 64),
        rope("bf16", 3, 16, 2, 24, 24),
        rope("bf16", 1, 64, 8, 256, 256, big=True),
        rope("fp16", 64, 32, 8, 128, 128, big=True),
    ]
    return out


SPEC_BUILDERS = (
    _rejection_sample_specs,
    _tree_rejection_sample_specs,
    _distill_loss_specs,
    _kv_rollback_specs,
    _tree_attention_specs,
    _fused_layer_specs,
)


def _load(path: str) -> JITFunction:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"osd_kernels.triton.{module}"), name)


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
        kernel = _load(spec.kernel)
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
    reached, todo = set(), [_load(s.kernel) for s in specs]
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
    specs, failures = [], []
    for build in SPEC_BUILDERS:
        try:
            specs += build()
        except Exception:
            failures.append((build.__name__, traceback.format_exc(limit=4)))
    failures += [
        (f"{name}: no spec compiles it (add one to scripts/triton_check.py)", "")
        for name in coverage_errors(specs)
    ]
    # fork: the workers inherit the imported kernels; Triton compiles in the child only
    with cf.ProcessPoolExecutor(
        max_workers=args.jobs, mp_context=__import__("multiprocessing").get_context("fork")
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
