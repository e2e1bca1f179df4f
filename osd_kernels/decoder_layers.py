"""``decoder_layers``: a stack of decoder layers of a cached CPU forward, looped in C++.

A decode step of a small model is hundreds of op calls: per layer four projections,
``rope_kv_write_qkv``, attention, two ``add_rms_norm`` and a ``silu_mul``. Called from
Python each costs the interpreter's loop and the op's argument parsing, together more than
the small ops' own work at decode sizes. This op runs the same calls in C++ over every
layer at once, through the dispatcher below autograd, so its results are those of the
Python loop (``osd.models.fused_layers``) bit for bit.

Per layer (pre-norm, SiLU-gated, the residual stream one block behind as in the fused
layers): ``qkv = proj_qkv(input_norm(h))`` (from the second layer on, ``add_rms_norm``
adds the pending MLP output first), ``q = rope_kv_write_qkv(qkv)`` (with per-head q/k
norms, Qwen3's, an RMSNorm over each query and key head first), attention over the
layer's cache, ``h, n = add_rms_norm(proj_o(attn), h)``, pending ``proj_down(silu_mul(
proj_gate_up(n)))``; after the last layer ``h + pending`` (times the residual
multiplier). Gemma's layers also norm the output projection before its add and the down
projection's output (``post_attention_norm`` then ``pre_feedforward_norm`` in the add,
``post_feedforward_norm``), gate with GeGLU (``gelu_tanh(gate) * up``), and may have a
sliding window: where the call reaches past it (``max_kv_len > window``), each query
attends over its own window's slice of the cache in a ``tree_attention`` call of its
own, as a decode step at its position does (``osd.models.attention.windowed_rows``; no
tree mask there).

The arguments are flat lists so that one call carries a model (:func:`layer_arguments`
builds them): per layer ``TENSORS_PER_LAYER`` tensors (input norm, post-attention norm,
q and k head norms or None, then per projection weight, scales, mins, bias, then the pre-
and post-feedforward norms or None), ``INTS_PER_LAYER`` ints (cache index, query heads,
RoPE table or -1, 1 with head norms else 0, per projection -1 for ``decode_linear`` or
``quant_linear``'s ``ggml_type``, the window or 0, the activation: 0 SiLU, 1 gelu-tanh)
and ``FLOATS_PER_LAYER`` floats (the two norms' eps, the residual multiplier, the head
norms' eps, the feedforward norms' eps).

Backends: ``native`` (the C++ loop; float32 CPU tensors) and ``reference`` (the same loop
in Python over the ops' references); ``auto`` is native where it can run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from osd_kernels._ops import native_available
from osd_kernels.add_rms_norm import add_rms_norm_reference
from osd_kernels.decode_linear import PANEL, decode_linear_reference
from osd_kernels.quant_linear import quant_linear_reference
from osd_kernels.rope_kv_write import rope_kv_write_reference
from osd_kernels.silu_mul import silu_mul_reference
from osd_kernels.tree_attention import tree_attention_reference

TENSORS_PER_LAYER = 22
INTS_PER_LAYER = 10
FLOATS_PER_LAYER = 6
DENSE = -1  # a projection's kind: decode_linear (else quant_linear's ggml_type)
ACTIVATIONS = ("silu", "gelu_tanh")  # the gate's activation, by its int


def layer_arguments(layers) -> tuple[list, list[int], list[float]]:
    """The flat ``(tensors, ints, floats)`` of ``layers``: an iterable of dicts with
    ``cache_index``, ``num_heads``, ``rope_table`` (-1, 0 or 1), ``input_norm`` and
    ``post_norm`` (``(weight, eps)``), ``residual_multiplier``, optionally ``head_norms``
    (``(q_weight, k_weight, eps)``: per-head q/k RMSNorms), ``projections``: four
    ``(kind, weight, scales, mins, bias)`` (qkv, o, gate-up, down; ``kind`` ``DENSE`` or a
    ggml type), and optionally ``feedforward_norms`` (``(pre_weight, pre_eps, post_weight,
    post_eps)``: Gemma's norms, ``post_norm`` then being the norm after attention),
    ``window`` (the sliding window, None or 0 for none) and ``activation`` (one of
    :data:`ACTIVATIONS`, default SiLU)."""
    tensors, ints, floats = [], [], []
    for layer in layers:
        (w_in, eps_in), (w_post, eps_post) = layer["input_norm"], layer["post_norm"]
        heads = layer.get("head_norms")
        tensors += [w_in, w_post, *((None, None) if heads is None else heads[:2])]
        kinds = []
        for kind, weight, scales, mins, bias in layer["projections"]:
            tensors += [weight, scales, mins, bias]
            kinds.append(int(kind))
        ints += [int(layer["cache_index"]), int(layer["num_heads"]), int(layer["rope_table"])]
        ffw = layer.get("feedforward_norms")
        tensors += [None, None] if ffw is None else [ffw[0], ffw[2]]
        ints += [0 if heads is None else 1, *kinds, int(layer.get("window") or 0)]
        ints.append(ACTIVATIONS.index(layer.get("activation", "silu")))
        floats += [float(eps_in), float(eps_post), float(layer["residual_multiplier"])]
        floats.append(1e-6 if heads is None else float(heads[2]))
        floats += [1e-6, 1e-6] if ffw is None else [float(ffw[1]), float(ffw[3])]
    return tensors, ints, floats


def _project(x, tensors, ints, layer, p, norm, eps):
    base = TENSORS_PER_LAYER * layer + 4 + 4 * p
    w, scales, mins, bias = tensors[base : base + 4]
    kind = ints[INTS_PER_LAYER * layer + 4 + p]
    if kind == DENSE:
        if w.dim() == 3:  # decode_linear's panels [N / PANEL, K, PANEL]
            w = w.permute(0, 2, 1).reshape(w.shape[0] * PANEL, w.shape[1])
        return decode_linear_reference(x, w, bias, norm_weight=norm, eps=eps)
    return quant_linear_reference(
        x, w, scales, mins, bias, norm_weight=norm, eps=eps, ggml_type=kind
    )


def _windowed_reference(q, k_cache, v_cache, cache_lens, window, scale):
    """Each query over its window's slice of the cache (``decoder_layers``' windows)."""
    B, T = q.shape[:2]
    outs = []
    for b in range(B):
        for i in range(T):
            p = int(cache_lens[b]) + i
            start = max(0, p - window + 1)
            one = torch.tensor([p - start], dtype=torch.int32)
            outs.append(
                tree_attention_reference(
                    q[b : b + 1, i : i + 1],
                    k_cache[b : b + 1, :, start : p + 1],
                    v_cache[b : b + 1, :, start : p + 1],
                    one,
                    None,
                    scale=scale,
                )
            )
    return torch.cat(outs, 1).view(q.shape)


def decoder_layers_reference(
    x, tensors, ints, floats, kv, cache_lens, tree_mask, slots, rope, scale, max_kv_len=0
) -> torch.Tensor:
    """The layers in Python over the ops' references (arguments as :func:`decoder_layers`)."""
    B, T = slots.shape
    if max_kv_len <= 0 and B:
        max_kv_len = int(cache_lens[:B].max()) + T
    residual, pending, multiplier = x, None, 1.0
    for layer in range(len(ints) // INTS_PER_LAYER):
        lint = ints[INTS_PER_LAYER * layer : INTS_PER_LAYER * (layer + 1)]
        index, heads, table, head_norms = lint[:4]
        window, activation = lint[8:10]
        eps_in, eps_post, rm, eps_qk, eps_pre_ffw, eps_post_ffw = floats[
            FLOATS_PER_LAYER * layer : FLOATS_PER_LAYER * (layer + 1)
        ]
        lt = tensors[TENSORS_PER_LAYER * layer : TENSORS_PER_LAYER * (layer + 1)]
        w_in, w_post, w_q, w_k = lt[:4]
        w_pre_ffw, w_post_ffw = lt[20:22]
        if pending is None:
            qkv = _project(residual, tensors, ints, layer, 0, w_in, eps_in)
        else:
            residual, normed = add_rms_norm_reference(pending, residual, w_in, eps_in, multiplier)
            qkv = _project(normed, tensors, ints, layer, 0, None, 1e-6)
        layer_kv = kv[index]
        hkv, D = layer_kv.shape[2], layer_kv.shape[4]
        qkv = qkv.view(B, T, heads + 2 * hkv, D)
        q, k, v = qkv.split([heads, hkv, hkv], dim=2)
        if head_norms:
            q = F.rms_norm(q, (D,), w_q, eps_qk)
            k = F.rms_norm(k, (D,), w_k, eps_qk)
        cos, sin = (None, None) if table < 0 else (rope[2 * table], rope[2 * table + 1])
        q = rope_kv_write_reference(q, k, v, cos, sin, layer_kv, slots)
        if window > 0 and max_kv_len > window:
            if tree_mask is not None:
                raise ValueError(f"layer {layer}'s window takes no tree mask past the window")
            out = _windowed_reference(q, layer_kv[0], layer_kv[1], cache_lens, window, scale)
        else:
            out = tree_attention_reference(
                q, layer_kv[0], layer_kv[1], cache_lens, tree_mask, scale=scale
            )
        multiplier = rm
        o = _project(out.reshape(B * T, -1), tensors, ints, layer, 1, None, 1e-6)
        norm, eps = w_post, eps_post
        if w_pre_ffw is not None:  # Gemma: x + norm(attn), then the MLP's own pre-norm
            o = F.rms_norm(o, w_post.shape, w_post, eps_post)
            norm, eps = w_pre_ffw, eps_pre_ffw
        residual, normed = add_rms_norm_reference(o, residual, norm, eps, multiplier)
        gate_up = _project(normed, tensors, ints, layer, 2, None, 1e-6)
        if activation == 0:
            gated = silu_mul_reference(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            gated = F.gelu(gate, approximate="tanh") * up
        pending = _project(gated, tensors, ints, layer, 3, None, 1e-6)
        if w_pre_ffw is not None:
            pending = F.rms_norm(pending, w_post_ffw.shape, w_post_ffw, eps_post_ffw)
    if pending is None:
        return residual
    return residual + (pending if multiplier == 1.0 else pending * multiplier)


def decoder_layers(
    x: torch.Tensor,
    tensors: list,
    ints: list[int],
    floats: list[float],
    kv: torch.Tensor,
    cache_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    slots: torch.Tensor,
    rope: list,
    scale: float,
    max_kv_len: int = 0,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """The decoder layers of a cached forward on ``x [B T, H]``.

    Args:
        x: ``[B T, H]`` float32 rows in ``(b, t)`` order, the embedded input.
        tensors, ints, floats: the layers, flat (:func:`layer_arguments`).
        kv: the cache ``[L, 2, B_max, Hkv, S, D]``; each layer writes its keys and values
            at ``slots``.
        cache_lens: ``[B_max]`` int32 committed lengths, as ``tree_attention`` takes them.
        tree_mask: ``[B, T]`` int64 bitmask, or None for causal.
        slots: ``[B, T]`` int64 K/V slots of the new tokens.
        rope: ``[cos, sin]`` per RoPE table, ``[B, T, R]`` each.
        scale: the attention's softmax scale.
        max_kv_len: an upper bound of ``max(cache_lens[:B]) + T`` (0: computed exactly);
            a windowed layer attends query by query over its window where this exceeds
            the window.
        backend: ``auto`` | ``native`` | ``reference``.

    Returns:
        ``[B T, H]``, the last layer's output before the final norm.
    """
    if backend not in ("auto", "native", "reference"):
        raise ValueError(f"backend must be auto, native or reference, got {backend!r}")
    native = native_available() and x.device.type == "cpu" and x.dtype == torch.float32
    if backend == "native" and not native:
        raise ValueError(
            f"the native decoder_layers takes float32 CPU tensors with the native build, got "
            f"{x.dtype} on {x.device}"
        )
    if backend == "reference" or not native:
        return decoder_layers_reference(
            x, tensors, ints, floats, kv, cache_lens, tree_mask, slots, rope, scale, max_kv_len
        )
    return torch.ops.osd.decoder_layers(
        x, tensors, ints, floats, kv, cache_lens, tree_mask, slots, rope, scale, max_kv_len
    )


if native_available():

    @torch.library.register_fake("osd::decoder_layers")
    def _decoder_layers_fake(
        x, tensors, ints, floats, kv, cache_lens, tree_mask, slots, rope, scale, max_kv_len=0
    ):
        return torch.empty_like(x)
