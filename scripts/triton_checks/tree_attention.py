"""tree_attention: the one-pass kernel, the split-KV kernel under every autotune config,
and the split-KV combine kernel."""

from __future__ import annotations

import triton

from osd_kernels.triton.tree_attention import MAX_TREE, SPLIT_ALIGN_GPU, SPLIT_CONFIGS
from triton_checks.common import FLOATS, Ptr, Spec, load


def tree_attention_specs():
    kernel = load("tree_attention._tree_attention_kernel")
    # The launcher's constants: the tile sizes and autotune configs it launches with.
    max_tree = MAX_TREE

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

    split_configs = SPLIT_CONFIGS
    split_align = SPLIT_ALIGN_GPU

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


SPEC_BUILDERS = (tree_attention_specs,)
