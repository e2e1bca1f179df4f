"""The cached forward's decoder layers through the fused decode-layer kernels.

Per layer, the unfused cached forward launches an RMSNorm, the qkv projection, RoPE as
several elementwise kernels, a stack and an ``index_put`` for the KV write, attention, the
output projection, a residual add, a second RMSNorm, the gate-up projection, SiLU, a
multiply, the down projection and a second add, with views and slices between them. Here
three ops replace the glue between the projections and attention (``osd_kernels``: Triton
on CUDA, C++ on CPU), and on CUDA for few rows a fourth takes the projections too:

- ``rope_kv_write``: RoPE on q and k and the K/V write at ``[row, slot]`` in one kernel;
- ``add_rms_norm``: each residual add and the RMSNorm after it (the post-attention norm,
  and the next layer's input norm, which fuses with this layer's last add);
- ``silu_mul``: ``silu(gate) * up`` over the gate-up projection.

The residual stream therefore runs one block behind: after layer ``i`` the MLP output is
still pending, added by layer ``i + 1``'s ``add_rms_norm`` (or by a plain add after the
last layer, since the caller wants the hidden state before the final norm).

On CUDA, a forward of at most ``decode_gemv.MAX_ROWS`` (8) rows in all (decode, a short
verify) whose projections are plain ``nn.Linear`` runs its projections through
``decode_gemv`` instead, which takes the norms and adds into the projections: the qkv
projection with the input norm in front, ``wo`` adding into the residual, the gate-up
projection with the post-attention norm in front and SiLU x up behind, ``w_down`` adding
into the residual. A layer is then five kernels and attention, and the residual is never
pending.

On CPU, a float32 forward of at most :data:`CPU_MAX_ROWS` (16) rows in all (decode, verify,
short prefill pieces; :data:`CPU_MAX_ROWS_QUANTIZED` (4096) where every projection is
block-quantized: a batch's verify forwards, prefill pieces) runs the C++ ops on
``[B T, hidden]`` rows: per layer the four projections (``layers.project_rows``: ``decode_linear``,
or ``quant_linear`` for block-quantized :class:`~osd.models.quant.QuantLinear` weights,
called as torch ops with the first layer's input norm fused in), ``rope_kv_write_qkv`` on
the qkv projection as it comes, attention over per-layer views of the cache made once per
cache, two ``add_rms_norm`` and a ``silu_mul``: nine op calls and a view a layer, where the
unfused forward makes about 85 (``docs/benchmarks.md``, where a CPU step's time goes). Where
the layers fit it (no soft-capping or whole-width q/k norms; the default attention backend;
projections that ``decode_linear`` or ``quant_linear`` takes; Gemma's norms, GeGLU and
sliding windows included, except a tree past a window), one ``decoder_layers`` call runs
that loop in C++ over every layer (:data:`LOOP_IN_CPP`), its flat arguments built once per
model and rebuilt when a weight is replaced or repacked. Each C++ kernel rounds as the
unfused forward's ops do, so this path gives its logits and cache bit for bit.

:data:`FUSED_LAYERS` is the switch: ``"cpu"`` (the default) fuses on CPU only, ``"auto"``
on CPU and on CUDA (the CUDA path is off by default until these kernels have run on a
GPU: ``docs/gpu.md``; ``make gpu-check`` measures ``auto`` against the default), ``"off"``
never, ``"on"`` on any device with the ops' Triton backend (CPU tensors need
``TRITON_INTERPRET=1``: that is how the tests run the CUDA path, kernels included,
without a GPU). The environment variable ``OSD_FUSED_LAYERS`` sets its initial value.
Models outside the fused layer's shape keep the unfused forward: a layer must be
pre-norm only (no post-norms: OLMo-2, Gemma), dense (no mixture of experts) and
SiLU-gated (no GeGLU), except that the CPU path's loop in Python also takes Gemma's
layers (a norm before and after attention and the MLP, GeGLU: the unfused layer's ops
for those, bit for bit); the forward must run outside autograd (the kernels have no
backward) in the model's own dtype, and on CPU in float32 with the native build (other
dtypes and larger forwards keep the unfused one). On CUDA results equal the unfused
forward's within rounding (the kernels round where the unfused ops do;
``osd_kernels.add_rms_norm`` and friends).
"""

from __future__ import annotations

import functools
import operator
import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from osd.models.attention import attention
from osd.models.layers import gelu_tanh, project, project_rows, weight_version
from osd.models.quant import QuantLinear
from osd_kernels._ops import native_available, triton_available
from osd_kernels.add_rms_norm import add_rms_norm
from osd_kernels.decode_gemv import MAX_ROWS as GEMV_MAX_ROWS
from osd_kernels.decode_gemv import decode_gemv
from osd_kernels.decoder_layers import DENSE, layer_arguments
from osd_kernels.rope_kv_write import rope_kv_write
from osd_kernels.silu_mul import silu_mul
from osd_kernels.tree_attention import CPU_NATIVE_MAX_ROWS

MODES = ("auto", "cpu", "on", "off")
FUSED_LAYERS = os.environ.get("OSD_FUSED_LAYERS", "cpu")
# The CPU path ("cpu", "auto"): forwards of at most this many rows in all (decode, verify,
# short prefill pieces); larger ones keep the unfused forward, whose op calls are few per
# token there, and whose float32 projections (F.linear) round otherwise than
# ``decode_linear`` past this size.
CPU_MAX_ROWS = 16
# The same where every projection is block-quantized (``QuantLinear``): both forwards call
# ``quant_linear`` alike at any size, so the results are the same bit for bit, and the
# C++ layers stay faster up to a batch's prefill pieces (docs/benchmarks.md, forwards of
# many rows).
CPU_MAX_ROWS_QUANTIZED = 4096
# The CPU path loops over the layers in C++ (``osd_kernels.decoder_layers``) where the
# layers fit it (no soft-capping or whole-width q/k norms, no tree past a window; projections
# ``decode_linear`` or ``quant_linear`` takes); False keeps the same ops called from Python,
# bit for bit the same results (``OSD_LAYERS_IN_CPP=0``).
LOOP_IN_CPP = os.environ.get("OSD_LAYERS_IN_CPP", "1") != "0"


def _layer_fusable(layer) -> bool:
    return (
        layer.input_norm is not None
        and not layer.post_norm
        and layer.moe is None
        and layer.act is F.silu
    )


def _layer_cpu_fusable(layer) -> bool:
    """Whether the CPU path's Python loop takes the layer: a fused layer, or a dense
    pre-norm layer with post-norms too (Gemma's sandwich) and any gated activation."""
    return _layer_fusable(layer) or (
        layer.input_norm is not None
        and layer.pre_feedforward_norm is not None
        and layer.moe is None
    )


# model -> "all" (every layer fits the fused layer), "cpu" (every layer fits the CPU
# path's loop only), or "" (the unfused forward); the layers of a model do not change
_FUSABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fusable(model) -> str:
    fusable = _FUSABLE.get(model)
    if fusable is None:
        fusable = (
            "all"
            if all(_layer_fusable(layer) for layer in model.layers)
            else "cpu"
            if all(_layer_cpu_fusable(layer) for layer in model.layers)
            else ""
        )
        _FUSABLE[model] = fusable
    return fusable


def _quantized_projections(model) -> bool:
    """Whether every layer's four projections are block-quantized."""
    return all(
        isinstance(getattr(layer, name, None), QuantLinear)
        for layer in model.layers
        for name in ("wqkv", "wo", "w_gate_up", "w_down")
    )


def _cpu_native(model, x: torch.Tensor) -> bool:
    """Whether ``x [B, T, hidden]`` fits the C++ layers (with ``cpu`` and ``auto``)."""
    rows = x.shape[0] * x.shape[1]
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and (
            rows <= CPU_MAX_ROWS
            or (rows <= CPU_MAX_ROWS_QUANTIZED and _quantized_projections(model))
        )
        and native_available()
    )


def use_fused(model, x: torch.Tensor) -> bool:
    """Whether ``model``'s cached forward on ``x`` (the embedded input) takes this path."""
    mode = FUSED_LAYERS
    if mode not in MODES:
        raise ValueError(
            f"osd.models.fused_layers.FUSED_LAYERS must be one of {MODES}, got {mode!r}"
        )
    if mode == "off" or torch.is_grad_enabled() or x.dtype != model.dtype:
        return False
    if mode != "on":  # auto, cpu: the C++ layers on CPU; auto: Triton on CUDA too
        if x.device.type == "cpu":
            if not _cpu_native(model, x):
                return False
        elif mode == "cpu" or x.device.type != "cuda" or not triton_available():
            return False
    fusable = _fusable(model)
    return fusable == "all" or (fusable == "cpu" and mode != "on" and x.device.type == "cpu")


def fused_hidden(
    model,
    x: torch.Tensor,
    cache,
    ropes,
    slots: torch.Tensor,
    tree_mask: torch.Tensor | None,
    depths: torch.Tensor | None,
    skip_layers: frozenset[int],
    max_kv_len: int,
) -> torch.Tensor:
    """The layers of ``DecoderLM._hidden`` (same arguments: ``x [B, T, hidden]`` embedded,
    ``ropes`` the (global, local) ``cos, sin [B, T, 1, R]`` at each token's position,
    ``slots [B, T]`` the K/V slots); returns the last layer's output ``[B, T, hidden]``."""
    layers = [(i, layer) for i, layer in enumerate(model.layers) if i not in skip_layers]
    if FUSED_LAYERS != "on" and x.device.type == "cpu":
        return _cpu_layers(model, x, layers, cache, ropes, slots, tree_mask, depths, max_kv_len)
    backend = "triton" if FUSED_LAYERS == "on" else "auto"  # Triton on CUDA
    if x.shape[0] * x.shape[1] <= GEMV_MAX_ROWS and all(
        type(getattr(layer, name)) is nn.Linear and getattr(layer, name).weight.dtype == x.dtype
        for _, layer in layers
        for name in ("wqkv", "wo", "w_gate_up", "w_down")
    ):
        return _gemv_layers(
            model, x, layers, cache, ropes, slots, tree_mask, depths, max_kv_len, backend
        )
    residual, pending, scale = x, None, 1.0  # pending: the last MLP output, not yet added
    for index, layer in layers:
        norm = layer.input_norm
        if pending is None:
            normed = norm(residual)
        else:
            residual, normed = add_rms_norm(
                pending, residual, norm.weight, norm.eps, scale=scale, backend=backend
            )
        qk, v = layer.heads(project(normed, layer.wqkv))
        out = _attend(
            model, layer, index, qk, v, cache, ropes, slots, tree_mask, depths, max_kv_len, backend
        )
        scale = layer.residual_multiplier
        norm = layer.post_attention_norm
        residual, normed = add_rms_norm(
            project(out.flatten(2), layer.wo),
            residual,
            norm.weight,
            norm.eps,
            scale=scale,
            backend=backend,
        )
        pending = project(silu_mul(project(normed, layer.w_gate_up), backend=backend), layer.w_down)
    if pending is None:
        return residual
    return residual + (pending if scale == 1.0 else pending * scale)


def _attend(
    model,
    layer,
    index: int,
    qk: torch.Tensor,
    v: torch.Tensor,
    cache,
    ropes,
    slots: torch.Tensor,
    tree_mask,
    depths,
    max_kv_len: int,
    backend: str,
):
    """RoPE, the K/V write and attention of one layer: ``[B, T, Hq, D]``."""
    hq = layer.num_heads
    cos, sin = ropes[layer.local_rope] if layer.rope else (None, None)
    kv = cache.kv[index]  # [2, B_max, H, S, D]
    q = rope_kv_write(
        qk[:, :, :hq],
        qk[:, :, hq:],
        v,
        None if cos is None else cos.squeeze(2),
        None if sin is None else sin.squeeze(2),
        kv,
        slots,
        backend=backend,
    )
    return attention(
        q,
        kv[0],
        kv[1],
        cache.lens,
        tree_mask,
        scale=model.scale,
        max_kv_len=max_kv_len,
        backend=model.attention_backend,
        window=layer.window,
        depths=depths,
        softcap=layer.softcap,
    )


def _gemv_layers(
    model,
    x: torch.Tensor,
    layers,
    cache,
    ropes,
    slots: torch.Tensor,
    tree_mask,
    depths,
    max_kv_len: int,
    backend: str,
) -> torch.Tensor:
    """The layers of a forward of few rows, projections through ``decode_gemv``."""
    for index, layer in layers:
        norm, r = layer.input_norm, layer.residual_multiplier
        qkv = decode_gemv(
            x,
            layer.wqkv.weight,
            layer.wqkv.bias,
            norm_weight=norm.weight,
            eps=norm.eps,
            backend=backend,
        )
        qk, v = layer.heads(qkv)
        out = _attend(
            model, layer, index, qk, v, cache, ropes, slots, tree_mask, depths, max_kv_len, backend
        )
        x = decode_gemv(
            out.flatten(2), layer.wo.weight, layer.wo.bias, residual=x, scale=r, backend=backend
        )
        norm = layer.post_attention_norm
        mlp = decode_gemv(
            x,
            layer.w_gate_up.weight,
            layer.w_gate_up.bias,
            norm_weight=norm.weight,
            eps=norm.eps,
            gated=True,
            backend=backend,
        )
        x = decode_gemv(
            mlp, layer.w_down.weight, layer.w_down.bias, residual=x, scale=r, backend=backend
        )
    return x


@functools.lru_cache(maxsize=None)
def _native_ops():
    """The C++ ops' overloads, looked up once (a decode step makes ~150 calls)."""
    ops = torch.ops.osd
    return (
        ops.add_rms_norm.default,
        ops.rope_kv_write_qkv.default,
        ops.rope_kv_write.default,
        ops.silu_mul.default,
    )


def _cache_views(cache) -> list:
    """Per layer ``(kv, k, v)``: ``cache.kv[i]`` ``[2, B_max, Hkv, S, D]`` and its K and V
    halves, made once per cache tensor and kept on the cache (views die with it)."""
    views = getattr(cache, "_fused_views", None)
    if views is None or views[0] is not cache.kv:
        kv = cache.kv
        views = (kv, [(kv[i], kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])])
        cache._fused_views = views
    return views[1]


class _LayerPlan:
    """``decoder_layers``' flat arguments for some layers of a model, and what they were
    built from: ``checks`` ``(dict, key, tensor)`` (a module's ``_parameters``,
    ``_buffers`` or ``__dict__`` entry that must still be that object), ``versions``
    ``(weight, version)`` (a packed copy is valid while its weight is unchanged)."""

    __slots__ = (
        "tensors",
        "ints",
        "floats",
        "checks",
        "versions",
        "max_group",
        "min_window",
        "_columns",
    )

    def valid(self) -> bool:
        columns = getattr(self, "_columns", None)
        if columns is None:  # (dicts, keys, objects): one pass of C loops per forward
            columns = self._columns = tuple(map(list, zip(*self.checks))) or ([], [], [])
        dicts, keys, objects = columns
        return all(map(operator.is_, map(dict.get, dicts, keys), objects)) and all(
            weight_version(w) == v for w, v in self.versions
        )


def _projection(module, checks: list, versions: list):
    """``(kind, weight, scales, mins, bias)`` of a projection for ``decoder_layers``, or None
    when the C++ loop cannot take it (a weight that ``project_rows`` would not send to
    ``decode_linear`` or ``quant_linear``)."""
    if isinstance(module, QuantLinear):
        checks.append((module._buffers, "qweight", module.qweight))
        return (module.ggml_type, module.qweight, module.scales, module.mins, module.bias)
    if type(module) is not nn.Linear:
        return None
    w = module.weight
    if w.dtype != torch.float32 or not w.is_contiguous():
        return None
    checks.append((module._parameters, "weight", w))
    packed = module.__dict__.get("osd_packed")
    checks.append((module.__dict__, "osd_packed", packed))
    if packed is not None and packed[0] is w and packed[1] == weight_version(w):
        versions.append((w, packed[1]))
        w = packed[2]
    return (DENSE, w, None, None, module.bias)


def _build_plan(model, layers) -> _LayerPlan | None:
    if model.attention_backend != "auto":
        return None
    specs, versions, group = [], [], 1
    # the modules themselves first: a replaced layer or projection leaves the old one's
    # tensors as they were
    checks = [(model._modules, "layers", model.layers)]
    for index, layer in layers:
        if layer.qk_norm not in ("none", "head") or layer.softcap is not None:
            return None
        if not _layer_cpu_fusable(layer) or layer.act not in (F.silu, gelu_tanh):
            return None
        checks.append((model.layers._modules, str(index), layer))
        names = ["wqkv", "wo", "w_gate_up", "w_down", "input_norm", "post_attention_norm"]
        names += ["q_norm", "k_norm"] if layer.qk_norm == "head" else []
        names += ["pre_feedforward_norm", "post_feedforward_norm"] if layer.post_norm else []
        checks.extend((layer._modules, name, getattr(layer, name)) for name in names)
        projections = [_projection(getattr(layer, name), checks, versions) for name in names[:4]]
        if any(p is None for p in projections):
            return None
        norms = (layer.input_norm, layer.post_attention_norm)
        heads = (layer.q_norm, layer.k_norm) if layer.qk_norm == "head" else ()
        if heads and heads[0].eps != heads[1].eps:
            return None
        ffw = (layer.pre_feedforward_norm, layer.post_feedforward_norm) if layer.post_norm else ()
        checks.extend((n._parameters, "weight", n.weight) for n in (*norms, *heads, *ffw))
        group = max(group, layer.num_heads // layer.num_kv_heads)
        specs.append(
            {
                "cache_index": index,
                "num_heads": layer.num_heads,
                "rope_table": int(layer.local_rope) if layer.rope else -1,
                "input_norm": (norms[0].weight, norms[0].eps),
                "post_norm": (norms[1].weight, norms[1].eps),
                "residual_multiplier": layer.residual_multiplier,
                "head_norms": (heads[0].weight, heads[1].weight, heads[0].eps) if heads else None,
                "projections": projections,
                "feedforward_norms": (ffw[0].weight, ffw[0].eps, ffw[1].weight, ffw[1].eps)
                if ffw
                else None,
                "window": layer.window,
                "activation": "silu" if layer.act is F.silu else "gelu_tanh",
            }
        )
    plan = _LayerPlan()
    plan.tensors, plan.ints, plan.floats = layer_arguments(specs)
    plan.checks, plan.versions, plan.max_group = checks, versions, group
    windows = [layer.window for _, layer in layers if layer.window is not None]
    plan.min_window = min(windows) if windows else None
    return plan


_decoder_layers = torch.ops.osd.decoder_layers.default if native_available() else None

# model -> {skipped layers: its plan, or None where the C++ loop cannot take the layers}
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layer_plan(model, layers) -> _LayerPlan | None:
    """The model's ``decoder_layers`` arguments for ``layers`` (``(index, layer)`` pairs),
    built once and rebuilt when a weight was replaced, repacked or changed under its packed
    copy; None when the layers do not fit the C++ loop."""
    plans = _PLANS.get(model)
    if plans is None:
        plans = _PLANS[model] = {}
    key = tuple(index for index, _ in layers)
    plan = plans.get(key, False)
    if plan is False or (plan is not None and not plan.valid()):
        plan = plans[key] = _build_plan(model, layers)
    return plan


def _cpu_layers(
    model,
    x: torch.Tensor,
    layers,
    cache,
    ropes,
    slots: torch.Tensor,
    tree_mask,
    depths,
    max_kv_len: int,
) -> torch.Tensor:
    """The layers of a CPU forward of few rows through the C++ ops, on ``[B T, hidden]``
    rows throughout: per layer the four projections (``project_rows``: ``decode_linear`` /
    ``quant_linear``, the first layer's input norm fused in), ``rope_kv_write_qkv`` on the
    qkv projection as it comes, attention over views of the cache made once, and
    ``add_rms_norm`` / ``silu_mul`` between them. Each rounds as the unfused forward does,
    so the results are its own bit for bit."""
    tables = [(None, None) if r is None else (r[0].squeeze(2), r[1].squeeze(2)) for r in ropes]
    plan = _layer_plan(model, layers) if LOOP_IN_CPP else None
    B, T, H = x.shape
    if (
        plan is not None
        and T * plan.max_group <= CPU_NATIVE_MAX_ROWS
        # a tree past a window takes the masked attention of the Python loop
        and (tree_mask is None or plan.min_window is None or max_kv_len <= plan.min_window)
    ):
        rope_args = [t for pair in tables for t in pair]
        out = _decoder_layers(
            x.view(B * T, H),
            plan.tensors,
            plan.ints,
            plan.floats,
            cache.kv,
            cache.lens,
            tree_mask,
            slots,
            rope_args,
            model.scale,
            max_kv_len,
        )
        return out.view(B, T, H)
    add_norm, rope_qkv, rope, silu = _native_ops()
    views = _cache_views(cache)
    lens, scale_qk, backend = cache.lens, model.scale, model.attention_backend
    residual, pending, scale = x.view(B * T, H), None, 1.0  # pending: the last MLP output
    for index, layer in layers:
        norm = layer.input_norm
        if pending is None:
            qkv = project_rows(residual, layer.wqkv, norm)
        else:
            residual, normed = add_norm(pending, residual, norm.weight, norm.eps, scale)
            qkv = project_rows(normed, layer.wqkv)
        kv, k_cache, v_cache = views[index]
        cos, sin = tables[layer.local_rope] if layer.rope else (None, None)
        hq = layer.num_heads
        if layer.qk_norm == "none":
            q = rope_qkv(qkv, hq, cos, sin, kv, slots)
        else:
            qk, v = layer.heads(qkv.view(B, T, -1))
            q = rope(qk[:, :, :hq], qk[:, :, hq:], v, cos, sin, kv, slots)
        out = attention(
            q,
            k_cache,
            v_cache,
            lens,
            tree_mask,
            scale=scale_qk,
            max_kv_len=max_kv_len,
            backend=backend,
            window=layer.window,
            depths=depths,
            softcap=layer.softcap,
        )
        scale = layer.residual_multiplier
        o = project_rows(out.view(B * T, -1), layer.wo)
        if layer.post_norm:  # Gemma's sandwich: x + norm(attn), then the MLP's own pre-norm
            o = layer.post_attention_norm(o)
            norm = layer.pre_feedforward_norm
        else:
            norm = layer.post_attention_norm
        residual, normed = add_norm(o, residual, norm.weight, norm.eps, scale)
        gate_up = project_rows(normed, layer.w_gate_up)
        if layer.act is F.silu:
            gated = silu(gate_up)
        else:  # GeGLU: the unfused layer's ops
            gate, up = gate_up.chunk(2, dim=-1)
            gated = layer.act(gate) * up
        pending = project_rows(gated, layer.w_down)
        if layer.post_norm:
            pending = layer.post_feedforward_norm(pending)
    if pending is not None:
        residual = residual + (pending if scale == 1.0 else pending * scale)
    return residual.view(B, T, H)
