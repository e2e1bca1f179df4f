"""Linear layers whose weights stay block-quantized in memory (GGUF's Q4_0, Q4_1, Q8_0,
and from files Q5_0, Q5_1, the K-quants Q2_K to Q6_K, IQ4_NL and IQ4_XS).

On a CPU a decode or verify forward is bound by reading the weights: a GGUF checkpoint's
4-bit weights read 0.5625 to 0.75 bytes each where their float32 copy reads 4. A
:class:`QuantLinear` keeps the file's blocks as stored (:data:`STORED_FORMATS`: Q4_0,
Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), or re-expressed as 4- or 8-bit codes with float32 factors
(the other types), and computes with ``osd_kernels.quant_linear``,
whose few-row kernel gives bit for bit what ``decode_linear`` gives on the dequantized
float32 matrix (so decode and verify forwards of up to 16 tokens match the dequantized
model exactly); longer inputs (prefill) go through dequantized tiles and a GEMM, equal to
float rounding, and autograd through ``F.linear`` on the dequantized matrix.

- :meth:`QuantLinear.from_gguf_blocks`: a layer from a GGUF tensor's stored blocks;
- :func:`quantize_gguf_linears`: swap a loaded GGUF model's linear layers (and output
  head) for quantized ones built from the file (``Engine.from_pretrained(...,
  quantized=True)``);
- :func:`quantize_linears`: quantize a float model's layers in place, with ggml's
  reference rounding (drafts kept quantized, ``quantize_draft``; tests);
- :func:`quantized_state`: a float model's weights for its quantized copy (an online
  learner trains the float draft and publishes them to the quantized serving draft);
- :func:`use_int8_activations`: regroup a model's Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K
  layers 16 rows at a time and multiply them with int8 activations
  (:mod:`osd_kernels.quant_x16`; AVX-512 VNNI): not the dequantized model's float32
  product, but a verify forward of 5 rows costs about 1.3 plain steps instead of 1.8
  (``quantized="int8"``, the engine's default on the CPU).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from osd.models.gguf.blocks import (
    BLOCK_LAYOUT,
    GGMLType,
    high_bits,
    iq4_parts,
    k_quant_parts,
    nibbles,
    quantize,
    type_name,
)
from osd.models.gguf.convert import ARCHITECTURES, unpermute_rope_rows
from osd_kernels import use_vnni
from osd_kernels.quant_linear import (
    BLOCK,
    STORED_TYPES,
    dequantize_blocks,
    dequantize_weight,
    quant_linear,
)
from osd_kernels.quant_x16 import (
    CODES_16,
    CODES_32,
    X16_TYPES,
    repack_codes,
    repack_x16,
    unpack_codes,
    unpack_x16,
    x16_block,
    x16_supported,
)

# Block types a float layer can be quantized to (ggml's reference rounding), by name.
FORMATS = ("Q4_0", "Q4_1", "Q8_0")
# GGUF block types a QuantLinear holds as codes: FORMATS, the 5-bit types (as 8-bit codes),
# the K-quants, whose 16- or 32-weight groups are affine in their codes, and IQ4_NL and
# IQ4_XS, whose 16 non-uniform levels are 8-bit codes times a scale per 32 weights.
GGUF_FORMATS = FORMATS + (
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
)
# GGUF block types a QuantLinear holds as the file's bytes (the kernel decodes them in
# registers): the K-quants of Q*_K_M files, the 32-weight types they fall back to, and the
# legacy 4- and 8-bit types. The others are re-expressed as codes with float32 factors.
STORED_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
# 32-weight types whose blocks are also exact Q8_0 blocks (the same fp16 scale, the signed
# code as int8): a fused projection of their mix is held as Q8_0 blocks.
_AS_Q8_0 = ("Q4_0", "Q5_0", "Q8_0")


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W [N, K]`` block-quantized (see ``osd_kernels.quant_linear``).

    Buffers: ``qweight`` (uint8 ``[N, K / 2]`` or int8 ``[N, K]`` codes; with ``ggml_type``
    a GGUF type's blocks as stored, uint8 ``[N, bytes a row]``), ``scales`` and ``mins``
    (float32 ``[N, K / G]``, ``G`` = 32 or 16; ``mins`` may be None; ``scales`` ``[N, 0]``
    and ``mins`` None with ``ggml_type``), ``bias`` (``[N]`` or None). Not trainable: the
    weights are fixed (a target model's, or a shared output head).
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        fmt: str = "",
        ggml_type: int = 0,
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("bias", bias)
        self.fmt = fmt
        self.ggml_type = int(ggml_type)
        if self.ggml_type:
            weights, size = (
                x16_block(self.ggml_type)
                if self.ggml_type in X16_TYPES
                else STORED_TYPES[self.ggml_type]
            )
            self._in_features = qweight.shape[1] // size * weights
        else:
            self._in_features = qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self._in_features

    def forward(
        self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6
    ) -> torch.Tensor:
        """``[..., K] -> [..., N]``, after the RMSNorm of ``norm_weight`` when given."""
        return quant_linear(
            x,
            self.qweight,
            self.scales,
            self.mins,
            self.bias,
            norm_weight=norm_weight,
            eps=eps,
            ggml_type=self.ggml_type,
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]``."""
        if self.ggml_type:
            return dequantize_blocks(self.qweight, self.ggml_type)
        return dequantize_weight(self.qweight, self.scales, self.mins)

    def select_rows(self, ids: torch.Tensor) -> "QuantLinear":
        """A layer of the output rows ``ids`` only (a restricted output head)."""

        def pick(t):
            return None if t is None else t.index_select(0, ids.to(t.device))

        if self.ggml_type in (CODES_32, CODES_16):  # codes and factors, regrouped again
            codes, scales, mins = unpack_codes(self.qweight, self.ggml_type)
            layer = QuantLinear(codes, scales, mins, self.bias, self.fmt).select_rows(ids)
            layer.use_int8_activations()
            return layer
        if self.ggml_type in X16_TYPES:  # rows of the file's blocks, regrouped again
            blocks, t = unpack_x16(self.qweight, self.ggml_type)
            layer = QuantLinear(blocks, self.scales, None, self.bias, self.fmt, t)
            layer = layer.select_rows(ids)
            layer.use_int8_activations()
            return layer
        return QuantLinear(
            pick(self.qweight),
            pick(self.scales),
            pick(self.mins),
            pick(self.bias),
            self.fmt,
            self.ggml_type,
        )

    def use_int8_activations(self) -> bool:
        """Regroup Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K blocks, or codes and factors,
        for int8 activations (:mod:`osd_kernels.quant_x16`) in place; False (unchanged)
        for a number of rows not a multiple of 16, other block types or a layer off the
        CPU."""
        on_cpu = self.qweight.device.type == "cpu"
        if not on_cpu or not x16_supported(self.ggml_type, self.out_features):
            return False
        if self.ggml_type == 0:
            self.qweight, self.ggml_type = repack_codes(self.qweight, self.scales, self.mins)
            self.scales = self.scales.new_empty((self.out_features, 0))
            self.mins = None
            return True
        self.qweight, self.ggml_type = repack_x16(self.qweight, self.ggml_type)
        return True

    @classmethod
    def from_gguf_blocks(
        cls,
        raw: torch.Tensor,
        fmt: str,
        shape: tuple[int, int],
        bias: torch.Tensor | None = None,
        stored: bool | None = None,
    ) -> "QuantLinear":
        """A layer from one GGUF tensor's stored bytes (``raw`` uint8, ``shape = (N, K)``
        in torch order) of block type ``fmt`` (one of :data:`GGUF_FORMATS`), holding them as
        stored when ``stored`` (default: ``fmt`` in :data:`STORED_FORMATS`), else as codes
        and float32 factors."""
        if fmt not in GGUF_FORMATS:
            raise ValueError(f"QuantLinear holds {', '.join(GGUF_FORMATS)} weights, not {fmt}")
        N, K = shape
        if fmt in STORED_FORMATS if stored is None else stored:
            t = int(GGMLType[fmt])
            weights, size = STORED_TYPES[t]
            if K % weights:
                unit = "super-blocks" if weights == 256 else "blocks"
                raise ValueError(f"{fmt} rows hold whole {unit} of {weights} weights, got K = {K}")
            blocks = raw.reshape(N, K // weights * size).contiguous()
            return cls(blocks, blocks.new_empty((N, 0), dtype=torch.float32), None, bias, fmt, t)
        if fmt.endswith("_K"):
            return cls(*_k_quant_codes(raw, fmt, N, K), bias, fmt)
        if fmt.startswith("IQ4"):
            return cls(*_iq4_codes(raw, fmt, N, K), None, bias, fmt)
        blocks = raw.reshape(N, K // BLOCK, -1)
        d = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
        if fmt in ("Q5_0", "Q5_1"):
            # 5-bit codes as 8-bit ones: (q - 16) d = q d + (-16 d) for Q5_0, q d + m for
            # Q5_1; a 5-bit code times a float16 scale is exact in float32.
            lo = 2 if fmt == "Q5_0" else 4
            flat = blocks.reshape(N * (K // BLOCK), -1)
            q = nibbles(flat[:, lo + 4 :]) | (high_bits(flat[:, lo : lo + 4]) << 4)
            m = (
                -16.0 * d
                if fmt == "Q5_0"
                else blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
            )
            return cls(
                q.to(torch.int8).reshape(N, K).contiguous(),
                d.contiguous(),
                m.contiguous(),
                bias,
                fmt,
            )
        if fmt == "Q8_0":
            q = blocks[..., 2:].contiguous().view(torch.int8).reshape(N, K)
            return cls(q, d.contiguous(), None, bias, fmt)
        if fmt == "Q4_0":  # (q - 8) * d = q * d + (-8 d), exact in float32
            return cls(
                blocks[..., 2:].reshape(N, K // 2).contiguous(),
                d.contiguous(),
                (-8.0 * d).contiguous(),
                bias,
                fmt,
            )
        m = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
        return cls(
            blocks[..., 4:].reshape(N, K // 2).contiguous(),
            d.contiguous(),
            m.contiguous(),
            bias,
            fmt,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.fmt}, bias={self.bias is not None}"
        )


def _fused(pieces: list[QuantLinear], bias: torch.Tensor | None) -> QuantLinear:
    """One layer of ``pieces`` stacked along the output rows (a fused projection whose
    parts a file stores apart, maybe in different types). Parts held as stored blocks of one
    type are stacked as they are; parts of Q4_0, Q5_0 and Q8_0 as Q8_0 blocks (exactly:
    :func:`_as_q8_0`). Otherwise every part is held as codes and factors, widened to the
    widest part's form first, exactly: 4-bit codes to 8-bit ones when another part has
    8-bit codes, a scale (and min) per 32 weights repeated per 16 when another part has
    groups of 16, zero mins where another part has mins."""
    if len(pieces) == 1:
        p = pieces[0]
        return QuantLinear(p.qweight, p.scales, p.mins, bias, p.fmt, p.ggml_type)
    fmts = "+".join(dict.fromkeys(p.fmt for p in pieces))
    if all(p.ggml_type for p in pieces):
        if len({p.ggml_type for p in pieces}) > 1 and all(p.fmt in _AS_Q8_0 for p in pieces):
            pieces = [_as_q8_0(p) for p in pieces]
        if len({p.ggml_type for p in pieces}) == 1:
            q = torch.cat([p.qweight for p in pieces])
            t = pieces[0].ggml_type
            return QuantLinear(
                q, q.new_empty((q.shape[0], 0), dtype=torch.float32), None, bias, fmts, t
            )
    K = pieces[0].in_features
    pieces = [
        QuantLinear.from_gguf_blocks(p.qweight, p.fmt, (p.out_features, K), stored=False)
        if p.ggml_type
        else p
        for p in pieces
    ]
    K = pieces[0].in_features
    wide = any(p.qweight.dtype == torch.int8 for p in pieces)
    groups = max(p.scales.shape[1] for p in pieces)
    with_mins = any(p.mins is not None for p in pieces)
    qs, scales, mins = [], [], []
    for p in pieces:
        q = p.qweight
        if wide and q.dtype == torch.uint8:  # nibbles j, j + 16 of each block of 32
            q = q.reshape(q.shape[0], -1, 16)
            q = torch.cat([q & 0xF, q >> 4], dim=-1).reshape(q.shape[0], K).to(torch.int8)
        repeat = groups // p.scales.shape[1]
        qs.append(q)
        scales.append(p.scales.repeat_interleave(repeat, dim=1))
        m = torch.zeros_like(p.scales) if p.mins is None else p.mins
        mins.append(m.repeat_interleave(repeat, dim=1))
    return QuantLinear(
        torch.cat(qs),
        torch.cat(scales).contiguous(),
        torch.cat(mins).contiguous() if with_mins else None,
        bias,
        fmts,
    )


def _as_q8_0(p: QuantLinear) -> QuantLinear:
    """A layer of Q4_0 / Q5_0 / Q8_0 blocks as stored, as Q8_0 blocks of the same weights:
    the fp16 scale as it is and each weight's signed code (``q - 8``, ``q - 16``) as an
    int8, so that ``code * scale`` is the same product."""
    t = GGMLType[p.fmt]
    if t == GGMLType.Q8_0:
        return p
    N = p.out_features
    weights, size = STORED_TYPES[int(t)]
    b = p.qweight.reshape(-1, size)
    if t == GGMLType.Q4_0:
        q = nibbles(b[:, 2:]).to(torch.int16) - 8
    else:  # Q5_0
        q = (nibbles(b[:, 6:]) | (high_bits(b[:, 2:6]) << 4)).to(torch.int16) - 16
    blocks = torch.cat([b[:, :2], q.to(torch.int8).view(torch.uint8)], dim=1).reshape(N, -1)
    return QuantLinear(blocks, p.scales, None, None, p.fmt, int(GGMLType.Q8_0))


def _k_quant_codes(raw: torch.Tensor, fmt: str, N: int, K: int):
    """K-quant super-blocks (256 weights) -> ``(qweight, scales, mins)``, from
    :func:`osd.models.gguf.blocks.k_quant_parts` (whose factors reproduce ggml's dequantization
    bit for bit): Q4_K's codes and Q2_K's as 4-bit codes, Q3_K's (-4..3) as 4-bit codes
    plus 4 with a min of ``-4 * scale`` (exact: every term is a multiple of the scale well
    inside float32's precision), Q5_K's and Q6_K's as 8-bit codes. Q4_K and Q5_K have a
    scale per 32 weights, the others per 16."""

    t = GGMLType[fmt]
    if K % 256:
        raise ValueError(f"{fmt} rows hold whole super-blocks of 256 weights, got K = {K}")
    q, scales, mins = k_quant_parts(raw.reshape(-1, BLOCK_LAYOUT[t][1]), t)
    groups = scales.shape[1] * (K // 256)  # per weight row
    if t == GGMLType.Q3_K:
        q, mins = q + 4, -4.0 * scales
    scales = scales.reshape(N, groups).contiguous()
    mins = None if mins is None else mins.reshape(N, groups).contiguous()
    if t in (GGMLType.Q5_K, GGMLType.Q6_K):
        return q.to(torch.int8).reshape(N, K).contiguous(), scales, mins
    q = q.to(torch.uint8).reshape(-1, 2, 16)  # blocks of 32: j | (j + 16) << 4
    return (q[:, 0] | (q[:, 1] << 4)).reshape(N, K // 2).contiguous(), scales, mins


def _iq4_codes(raw: torch.Tensor, fmt: str, N: int, K: int):
    """IQ4_NL / IQ4_XS blocks -> ``(qweight, scales)``: each weight's level (-127..113) as
    an 8-bit code and a scale per 32 weights, from :func:`osd.models.gguf.blocks.iq4_parts`."""

    t = GGMLType[fmt]
    per_block, size = BLOCK_LAYOUT[t]
    if K % per_block:
        raise ValueError(f"{fmt} rows hold whole blocks of {per_block} weights, got K = {K}")
    q, scales = iq4_parts(raw.reshape(-1, size), t)
    return (q.to(torch.int8).reshape(N, K).contiguous(), scales.reshape(N, K // 32).contiguous())


def _linear_slots(model) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(owner, attribute, layer)`` of every linear layer a forward reads: an EAGLE
    draft's input projection, each decoder layer's four fused projections (two in a
    mixture-of-experts layer, whose experts stay float) and the output head."""
    slots = [(model, "fc", model.fc)] if isinstance(getattr(model, "fc", None), nn.Linear) else []
    for layer in model.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            if hasattr(layer, name):
                slots.append((layer, name, getattr(layer, name)))
    slots.append((model, "lm_head", model.lm_head))
    return slots


def quantize_weight(w: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> QuantLinear:
    """A :class:`QuantLinear` of float weight ``w [N, K]`` (``K`` a multiple of 32) in
    ``fmt``, rounded as ggml's reference quantizer does."""

    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    w = w.detach()
    raw = torch.from_numpy(np.ascontiguousarray(quantize(w, GGMLType[fmt])))
    bias = None if bias is None else bias.detach().clone()
    return QuantLinear.from_gguf_blocks(raw, fmt, tuple(w.shape), bias).to(w.device)


def quantize_linears(model, fmt: str = "Q8_0"):
    """Replace ``model``'s linear layers and output head (not its embedding) by
    :class:`QuantLinear` layers of ``fmt``, rounding as ggml's reference quantizer does.
    Layers whose input width is not a multiple of 32 stay float. Returns ``model``."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    for owner, name, layer in _linear_slots(model):
        if not isinstance(layer, nn.Linear) or layer.in_features % BLOCK:
            continue
        setattr(owner, name, quantize_weight(layer.weight, fmt, layer.bias))
    return model


def own_quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """``model``'s :class:`QuantLinear` layers by module name, less the target layers it
    shares (``model.shared_modules()``: an EAGLE draft's quantized head)."""
    shared = {id(m) for m in getattr(model, "shared_modules", list)()}
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, QuantLinear) and id(m) not in shared
    }


def serving_drafts(drafts: list, fmt: str | None, device: torch.device, learning: bool) -> list:
    """The drafts an engine serves: copies quantized in ``fmt`` (``Engine(quantize_draft=
    ...)``; each shares the target tensors its draft shares), or ``drafts`` themselves when
    ``fmt`` is None. ValueError for a bad ``fmt``, no drafts, drafts that are not float32
    on the CPU, and, when ``learning``, a draft with quantized layers of its own (it could
    not learn; its float draft with ``fmt`` can)."""
    if fmt is None:
        for i, d in enumerate(drafts if learning else ()):
            if own_quant_layers(d):
                raise ValueError(
                    f"draft {i} keeps quantized layers, which cannot learn: pass "
                    f"the float draft with quantize_draft=... to serve it "
                    f"quantized while it learns"
                )
        return drafts
    if fmt not in FORMATS:
        raise ValueError(f"quantize_draft must be one of {FORMATS}, got {fmt!r}")
    if not drafts:
        raise ValueError("quantize_draft quantizes the drafts, but no draft was given")
    if torch.device(device).type != "cpu" or any(d.dtype != torch.float32 for d in drafts):
        raise ValueError(
            f"quantize_draft runs on the CPU kernels: it needs float32 drafts on "
            f"the CPU, got {drafts[0].dtype} on {device}"
        )
    copies = []
    for d in drafts:
        shared = list(getattr(d, "shared_parameters", list)()) + list(
            getattr(d, "shared_modules", list)()
        )
        q = quantize_linears(copy.deepcopy(d, memo={id(t): t for t in shared}), fmt)
        if not shared and use_vnni():
            # int8 activations, as a quantized target computes on such a CPU: the draft's
            # forwards of few rows and its prompt prefills multiply in integers (its
            # numerics change its drafts only, never the output)
            use_int8_activations(q)
        copies.append(q)
    return copies


def quantized_state(
    state: dict[str, torch.Tensor], layers: dict[str, QuantLinear]
) -> dict[str, torch.Tensor]:
    """A float model's ``state`` (its ``state_dict()``) for a copy of it whose ``layers``
    (:func:`own_quant_layers`) are quantized: each such layer's ``<name>.weight`` replaced
    by its buffers, quantized in the layer's format. Other entries pass through."""
    out = dict(state)
    for name, layer in layers.items():
        q = quantize_weight(out.pop(f"{name}.weight"), layer.fmt)
        if layer.ggml_type in X16_TYPES:  # regrouped for int8 activations, as the layer is
            q.use_int8_activations()
        for buf in ("qweight", "scales", "mins"):
            t = getattr(q, buf)
            if t is not None:
                out[f"{name}.{buf}"] = t
    return out


def use_int8_activations(model: nn.Module) -> int:
    """Regroup ``model``'s Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K :class:`QuantLinear` layers
    for int8 activations (:meth:`QuantLinear.use_int8_activations`); returns how many.

    All or nothing: only when every linear layer of the model (its projections and output
    head) is such a layer on the CPU, else none. A row's int8 result never depends on the
    call's other rows; a float32 layer's prefill pieces past 64 rows go through a GEMM
    whose rounding does, and an int8 layer after it could turn that last bit into a
    different code, so a request's output would depend on how its prompt was cut."""
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    if not linears or not all(
        isinstance(m, QuantLinear)
        and (m.ggml_type in X16_TYPES or x16_supported(m.ggml_type, m.out_features))
        and m.qweight.device.type == "cpu"
        for m in linears
    ):
        return 0
    return sum(m.use_int8_activations() for m in linears)


def quantize_gguf_linears(model, g) -> int:
    """Swap ``model``'s linear layers (and output head) for :class:`QuantLinear` layers
    holding the stored blocks of GGUF file ``g`` (a ``GGUFFile`` the model was loaded
    from). A fused projection is quantized when all its parts are in
    :data:`GGUF_FORMATS` (parts of different types are widened to one form, see
    :func:`_fused`); other layers stay float. Returns the number of layers swapped."""

    permuted = ARCHITECTURES[g.architecture][1]
    config = model.config

    def part(name: str, heads: int | None = None) -> tuple[str, torch.Tensor] | None:
        info = g.tensors.get(name)
        if info is None or type_name(info.type) not in GGUF_FORMATS:
            return None
        N, K = info.shape
        raw = g.raw(name).reshape(N, -1)
        if permuted and heads is not None:
            raw = unpermute_rope_rows(raw, heads)
        return type_name(info.type), raw

    swapped = 0
    for i, layer in enumerate(model.layers):
        groups = {
            "wqkv": [
                part(f"blk.{i}.attn_q.weight", config.num_heads),
                part(f"blk.{i}.attn_k.weight", config.num_kv_heads),
                part(f"blk.{i}.attn_v.weight"),
            ],
            "wo": [part(f"blk.{i}.attn_output.weight")],
            "w_gate_up": [part(f"blk.{i}.ffn_gate.weight"), part(f"blk.{i}.ffn_up.weight")],
            "w_down": [part(f"blk.{i}.ffn_down.weight")],
        }
        if g.architecture == "phi3":  # fused in the file: attn_qkv, ffn_up = [gate; up]
            groups["wqkv"] = [part(f"blk.{i}.attn_qkv.weight")]
            groups["w_gate_up"] = [part(f"blk.{i}.ffn_up.weight")]
        owners = dict.fromkeys(groups, layer)
        if layer.moe is not None:  # the routed experts stay float; a shared one not
            del groups["w_gate_up"], groups["w_down"]
            if layer.moe.shared_gate_up is not None:
                groups["shared_gate_up"] = [
                    part(f"blk.{i}.ffn_gate_shexp.weight"),
                    part(f"blk.{i}.ffn_up_shexp.weight"),
                ]
                groups["shared_down"] = [part(f"blk.{i}.ffn_down_shexp.weight")]
                owners.update(shared_gate_up=layer.moe, shared_down=layer.moe)
        for name, parts in groups.items():
            if any(p is None for p in parts):
                continue
            owner = owners[name]
            old = getattr(owner, name)
            K = old.weight.shape[1]
            pieces = [
                QuantLinear.from_gguf_blocks(raw, fmt, (raw.shape[0], K)) for fmt, raw in parts
            ]
            bias = None if old.bias is None else old.bias.detach()
            setattr(owner, name, _fused(pieces, bias).to(old.weight.device))
            swapped += 1
    head = part("output.weight") or (
        part("token_embd.weight") if "output.weight" not in g.tensors else None
    )
    if head is not None and model.head_ids is None:
        old = model.lm_head
        model.lm_head = QuantLinear.from_gguf_blocks(head[1], head[0], tuple(old.weight.shape)).to(
            old.weight.device
        )
        swapped += 1
    return swapped


__all__ = [
    "QuantLinear",
    "FORMATS",
    "GGUF_FORMATS",
    "STORED_FORMATS",
    "quantize_linears",
    "quantize_gguf_linears",
    "use_int8_activations",
]
