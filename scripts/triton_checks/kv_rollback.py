"""kv_rollback: the KV-cache rollback and length-advance kernels."""

from __future__ import annotations

import triton

from triton_checks.common import FLOATS, Ptr, Spec


def kv_rollback_specs():
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


SPEC_BUILDERS = (kv_rollback_specs,)
