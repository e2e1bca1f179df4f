"""The samplers: rejection_sample and tree_rejection_sample, launched with
:data:`~triton_checks.common.SAMPLER_OPTIONS`."""

from __future__ import annotations

from triton_checks.common import FLOATS, SAMPLER_OPTIONS, Ptr, Spec


def rejection_sample_specs():
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


def tree_rejection_sample_specs():
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


SPEC_BUILDERS = (
    rejection_sample_specs,
    tree_rejection_sample_specs,
)
