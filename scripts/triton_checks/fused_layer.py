"""The fused decoder-layer kernels: add_rms_norm, silu_mul, rope_kv_write and decode_gemv."""

from __future__ import annotations

import triton

from osd_kernels.triton.add_rms_norm import MAX_HIDDEN
from osd_kernels.triton.add_rms_norm import num_warps_for as norm_warps
from osd_kernels.triton.decode_gemv import blocks_for as gemv_blocks
from osd_kernels.triton.rope_kv_write import num_warps_for as rope_warps
from osd_kernels.triton.silu_mul import block_for
from triton_checks.common import FLOATS, Ptr, Spec


def fused_layer_specs():
    """add_rms_norm, silu_mul, rope_kv_write and decode_gemv with the sizes and launch
    options their wrappers pick (osd_kernels/triton/{add_rms_norm,silu_mul,rope_kv_write,
    decode_gemv}.py)."""

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


SPEC_BUILDERS = (fused_layer_specs,)
