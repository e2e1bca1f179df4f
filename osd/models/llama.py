"""Our Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One class, :class:`DecoderLM`, serves ``LlamaForCausalLM`` (including Llama-3 RoPE
scaling), ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v bias) and
``Qwen3ForCausalLM`` (an RMSNorm over each query and key head); the differences are fields
of :class:`~osd.models.config.ModelConfig`. Weights are stored fused for a lean
forward: ``wqkv = [q; k; v]`` and ``w_gate_up = [gate; up]`` (``osd.models.loading`` maps
Hugging Face names onto them).

Forwards:

- ``model(input_ids, cache, *, tree_mask=None, depths=None)``: the cached forward of
  docs/design.md (decode, chain and tree verify, one piece of a prefill). It writes the
  new K/V at ``cache.lens[b] + i``, never changes ``cache.lens`` and needs no host sync.
  Causal forwards take any number of tokens; a tree mask allows at most 64.
- ``model.prefill(input_ids, cache, lengths)``: a ragged batch of prompts of any length
  (up to the cache capacity), fed in pieces of ``config.prefill_chunk`` tokens that each
  attend to the cache written by the pieces before, then committed.
- ``model.forward_train(input_ids, attention_mask=None)``: cacheless, causal, over whole
  sequences, differentiable (distillation of draft models).

All accept ``skip_layers`` (a set of layer indices to bypass, for self-speculation).

A draft may keep only some rows of its output head (:meth:`DecoderLM.restrict_head`, the
reduced draft vocabulary of EAGLE-3): a small draft's head is most of its cost. Its
logits still come back over the whole vocabulary, ``-inf`` outside the kept tokens, so
that a proposal is an ordinary distribution the verifier can score; training asks for
the kept columns only (``full_vocab=False``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from osd.cache import KVCache
from osd.models.attention import attention, causal_attention, resolve_attention_backend
from osd.models.config import ModelConfig
from osd.models.quant import QuantLinear
from osd_kernels.decode_linear import PANEL, decode_linear, pack_weight
from osd_kernels.quant_linear import quant_linear

MAX_TREE = 64  # tree_mask is one int64 bitmask per query


def rope_inv_freq(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` float32, as transformers computes them.

    ``default``: ``theta^(-2i/d)``; ``linear``: divided by ``factor``; ``llama3``: low
    frequencies divided by ``factor``, high ones kept, the band between interpolated;
    ``longrope``: divided by the short factors (``long``: the long ones). ``d`` is the
    rotated width
    (``config.rope_dim``: all of a head, or its leading ``rotary_dim`` dims).
    """
    dim = config.rope_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if config.rope_type == "longrope":
        factors = torch.tensor(
            config.rope_long_factor if long else config.rope_short_factor, dtype=torch.float32
        )
        return 1.0 / (factors * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_type == "linear":
        return inv_freq / config.rope_factor
    if config.rope_type == "llama3":
        factor, old_len = config.rope_factor, config.rope_original_max_positions
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(
    inv_freq: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0
):
    """``cos, sin`` tables ``[n, D]`` for positions ``0..n-1``, in the layout of
    :func:`apply_rope`: ``cos = [c, c]`` and ``sin = [-s, s]``, times ``scale`` (LongRoPE's
    attention factor; computed in float32 as transformers does, then cast)."""
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return (
        torch.cat((cos, cos), dim=-1).to(device=device, dtype=dtype),
        torch.cat((-sin, sin), dim=-1).to(device=device, dtype=dtype),
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, H, D]`` by ``cos, sin [B, T, 1, D]`` from :func:`rope_tables`.

    Half-split convention: ``[x1, x2] -> [x1 c - x2 s, x2 c + x1 s]``, written as
    ``x * cos + roll(x, D/2) * sin`` with ``sin = [-s, s]``. Tables narrower than ``D``
    (partial rotary, Phi-4-mini) rotate the leading dims and pass the rest through.
    """
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    return torch.addcmul(x * cos, x.roll(rot // 2, dims=-1), sin)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` (``F.rms_norm``; identical to transformers in
    fp32, within one rounding in half precision)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            # Under autocast a half input meets the fp32 weight: normalise in fp32 (what the
            # unfused mixed-dtype path computes) through the fused kernel.
            x = x.to(self.weight.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def fused(self) -> dict:
        """Keyword arguments that make ``decode_linear`` apply this norm to its input."""
        return {"norm_weight": self.weight, "eps": self.eps}


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place modification count (-1 for an inference tensor, which keeps none)."""
    return -1 if t.is_inference() else t._version


def project(x: torch.Tensor, layer: nn.Module, norm: RMSNorm | None = None) -> torch.Tensor:
    """``layer(norm(x))`` for an ``nn.Linear`` or a :class:`~osd.models.quant.QuantLinear`
    (block-quantized weights), through ``decode_linear`` / ``quant_linear``, which apply
    the RMSNorm themselves."""
    kw = {} if norm is None else norm.fused()
    if isinstance(layer, QuantLinear):
        # the op itself, not the module's __call__: a few microseconds a call, ~120 calls
        # a decode step
        return quant_linear(x, layer.qweight, layer.scales, layer.mins, layer.bias, **kw)
    w = layer.weight
    packed = getattr(layer, "osd_packed", None)
    # a packed copy is used only while it is of this very weight, unchanged since packing
    if packed is not None and packed[0] is w and packed[1] == _version(w):
        return decode_linear(x, w, layer.bias, packed=packed[2], **kw)
    return decode_linear(x, w, layer.bias, **kw)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh`` (Gemma's MLP gate)."""
    return F.gelu(x, approximate="tanh")


class MoE(nn.Module):
    """Routed SwiGLU experts (Mixtral, Qwen-MoE): each token goes to the
    ``num_experts_per_tok`` experts whose router softmax is highest, weighted by those
    probabilities (renormalized to sum 1 when ``norm_topk_prob``), plus, with
    ``shared_expert_intermediate_size``, a shared SwiGLU expert scaled by
    ``sigmoid(shared_gate(x))`` (Qwen2-MoE).

    Parameters: ``router.weight [E, H]``, ``gate_up [E, 2I, H]`` (each expert's gate rows,
    then its up rows), ``down [E, H, I]``; the shared expert's ``shared_gate_up``,
    ``shared_down`` and ``shared_gate`` linears. The forward groups the tokens by expert
    and runs only the experts that got tokens (one host sync per layer for that list).
    """

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.top_k, self.norm_topk = c.num_experts_per_tok, c.norm_topk_prob
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down = nn.Parameter(torch.empty(E, H, I))
        shared = c.shared_expert_intermediate_size
        self.shared_gate_up = nn.Linear(H, 2 * shared, bias=False) if shared else None
        self.shared_down = nn.Linear(shared, H, bias=False) if shared else None
        self.shared_gate = nn.Linear(H, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor, act) -> torch.Tensor:
        """``x [B, T, H]`` (already normed) -> ``[B, T, H]``."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a mixture-of-experts layer chooses its experts on the host and "
                "cannot be captured in a CUDA graph: pass cuda_graphs=False"
            )
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(F.linear(flat, self.router.weight).float(), dim=-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.norm_topk:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        weight = weight.to(flat.dtype).flatten()
        order = chosen.flatten().argsort()  # slots by expert
        counts = torch.bincount(chosen.flatten(), minlength=self.gate_up.shape[0]).tolist()
        out = torch.zeros_like(flat)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start : start + n]
            start += n
            tokens = slots // self.top_k
            gate, up = F.linear(flat[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(act(gate) * up, self.down[e]) * weight[slots, None]
            out.index_add_(0, tokens, y)
        if self.shared_gate_up is not None:
            gate, up = project(flat, self.shared_gate_up).chunk(2, dim=-1)
            shared = project(act(gate) * up, self.shared_down)
            out = out + torch.sigmoid(F.linear(flat, self.shared_gate.weight)) * shared
        return out.view_as(x)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + SwiGLU(norm(x))``; with
    ``config.post_norm`` and no pre-norms (OLMo-2) ``x + norm(attn(x))``, then
    ``x + norm(SwiGLU(x))``; with both (Gemma) ``x + norm(attn(norm(x)))`` and so on.

    The forward is split around attention (:meth:`qkv`, then :meth:`finish`) so that the
    cached and the training forward share everything but the attention call. Linear layers
    are called through :func:`project` (``decode_linear``, ``F.linear`` outside its few-row
    CPU case), which also applies the RMSNorm in front of them, to keep per-token overhead
    low. Any of them may be a :class:`~osd.models.quant.QuantLinear`.
    """

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.rope = index not in c.nope_layers  # SmolLM3: some layers have no RoPE
        self.window = (
            c.sliding_window if c.window_layers is None or index in c.window_layers else None
        )
        # Pre-norms: input_norm before attention; before the MLP post_attention_norm, or
        # pre_feedforward_norm when the block has post-norms too (Gemma). Post-norms
        # (OLMo-2, Gemma): post_attention_norm on attention's output, post_feedforward_norm
        # on the MLP's.
        self.post_norm = c.post_norm
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.pre_norm else None
        self.pre_feedforward_norm = (
            RMSNorm(c.hidden_size, c.rms_norm_eps) if c.pre_norm and c.post_norm else None
        )
        self.post_feedforward_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.post_norm else None
        self.act = F.silu if c.hidden_act == "silu" else _gelu_tanh
        # Gemma 3: the sliding-window layers rotate with a RoPE base of their own
        self.local_rope = self.window is not None and c.rope_local_theta is not None
        self.softcap = c.attn_logit_softcapping  # Gemma 2; None elsewhere
        self.wqkv = nn.Linear(
            c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=c.qkv_bias
        )
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.moe = MoE(c) if c.is_moe_layer(index) else None
        if self.moe is None:
            self.w_gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
            self.w_down = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.residual_multiplier = c.residual_multiplier  # Granite; 1 elsewhere
        # RMSNorms on queries and keys before RoPE: per head [D] (Qwen3) or over the whole
        # projection [Hq * D] and [Hkv * D] (OLMo-2)
        self.qk_norm = c.qk_norm
        full = c.qk_norm == "full"
        self.q_norm = (
            None
            if c.qk_norm == "none"
            else RMSNorm(c.num_heads * c.head_dim if full else c.head_dim, c.rms_norm_eps)
        )
        self.k_norm = (
            None
            if c.qk_norm == "none"
            else RMSNorm(c.num_kv_heads * c.head_dim if full else c.head_dim, c.rms_norm_eps)
        )

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries ``[B, T, Hq, D]`` and keys, values ``[B, T, Hkv, D]``, RoPE applied (in
        layers that have it)."""
        hq, hkv = self.num_heads, self.num_kv_heads
        qk, v = self.heads(project(x, self.wqkv, self.input_norm))
        q, k = (apply_rope(qk, cos, sin) if self.rope else qk).split((hq, hkv), dim=2)
        return q, k, v

    def heads(self, qkv: torch.Tensor):
        """The qkv projection ``[B, T, (Hq + 2 Hkv) D]`` -> queries and keys
        ``[B, T, Hq + Hkv, D]`` (q/k norms applied, no RoPE) and values ``[B, T, Hkv, D]``."""
        B, T, _ = qkv.shape
        hq, hkv = self.num_heads, self.num_kv_heads
        if self.qk_norm == "full":
            q, k, v = qkv.split((hq * self.head_dim, hkv * self.head_dim, hkv * self.head_dim), -1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        qkv = qkv.view(B, T, hq + 2 * hkv, self.head_dim)
        qk = qkv[:, :, : hq + hkv]
        if self.qk_norm == "head":
            qk = torch.cat((self.q_norm(qk[:, :, :hq]), self.k_norm(qk[:, :, hq:])), dim=2)
        return qk, qkv[:, :, hq + hkv :]

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual after attention output ``attn [B, T, Hq, D]``, then the gated MLP block
        (SwiGLU, or GeGLU for Gemma)."""
        r = self.residual_multiplier
        out = project(attn.flatten(2), self.wo)
        if self.post_norm:
            out = self.post_attention_norm(out)
        x = x + (out if r == 1.0 else out * r)
        norm = self.pre_feedforward_norm if self.post_norm else self.post_attention_norm
        if self.moe is not None:
            out = self.moe(x if norm is None else norm(x), self.act)
        else:
            gate, up = project(x, self.w_gate_up, norm).chunk(2, dim=-1)
            out = project(self.act(gate) * up, self.w_down)
        if self.post_norm:
            out = self.post_feedforward_norm(out)
        return x + (out if r == 1.0 else out * r)


class DecoderLM(nn.Module):
    """A Llama-family causal LM (``LlamaForCausalLM``, ``MistralForCausalLM``,
    ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``GraniteForCausalLM``,
    ``Olmo2ForCausalLM``, ``Phi3ForCausalLM``, ``SmolLM3ForCausalLM``,
    ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``).

    Parameters are created uninitialised on ``device`` in ``dtype``: load weights with
    ``osd.models.load_model`` (or ``load_hf_state_dict``), or call
    :meth:`init_weights` for a fresh model.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to_empty(device=torch.device(device))
        self.to(dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.scale = config.attention_scale
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.device, dtype
        )
        self._inv_freq = rope_inv_freq(config)
        # the sliding layers' RoPE (Gemma 3), or None
        self._inv_freq_local = (
            None
            if config.rope_local_theta is None
            else rope_inv_freq(
                dataclasses.replace(
                    config, rope_theta=config.rope_local_theta, rope_type="default", rope_factor=1.0
                )
            )
        )
        # (local, long) -> cos, sin; long: LongRoPE's long factors
        self._tables: dict[tuple[bool, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self._arange = torch.empty(0)
        # Set once CUDA graphs may have captured forwards that read ``_arange`` and
        # ``_tables`` (:meth:`pin_buffers`); from then on a forward never replaces them.
        self._pinned = False
        # Buffers replaced by :meth:`reserve` after pinning: graphs captured earlier still
        # read them, so they are kept alive for the model's lifetime.
        self._retired: list[torch.Tensor] = []
        # [V_head] int64 vocabulary ids of the head's rows; None: the head covers every id.
        self.register_buffer("head_ids", None)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def head_vocab_size(self) -> int:
        """Rows of the output head (the vocabulary size unless :meth:`restrict_head`)."""
        head = self.lm_head
        return head.out_features if isinstance(head, QuantLinear) else head.weight.shape[0]

    def restrict_head(self, token_ids) -> "DecoderLM":
        """Keep only the output head's rows of ``token_ids`` (distinct ids in
        ``[0, vocab_size)``), in that order; the head stops being tied to the embedding.
        Logits outside those tokens are ``-inf`` from then on. Returns ``self``."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten().cpu()
        V = self.vocab_size
        if ids.numel() == 0:
            raise ValueError("restrict_head needs at least one token id")
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(
                f"head token ids must lie in [0, {V}), got [{int(ids.min())}, {int(ids.max())}]"
            )
        if ids.unique().numel() != ids.numel():
            raise ValueError("head token ids must be distinct")
        if self.head_ids is not None:
            raise ValueError("the head is already restricted")
        self.head_ids = ids.to(self.device)
        if isinstance(self.lm_head, QuantLinear):
            self.lm_head = self.lm_head.select_rows(ids)
            return self
        old = self.lm_head.weight.detach()
        head = nn.Linear(
            self.config.hidden_size, ids.numel(), bias=False, device=self.device, dtype=self.dtype
        )
        with torch.no_grad():
            head.weight.copy_(old.index_select(0, ids.to(self.device)))
        head.weight.requires_grad_(old.requires_grad or self.embed_tokens.weight.requires_grad)
        self.lm_head = head
        return self

    def pack_weights(self) -> int:
        """Keep a copy of every float32 CPU linear weight (output head included) packed
        for ``decode_linear`` (``osd_kernels.pack_weight``): faster decode and verify
        forwards at the memory of a second copy. For weights that are only read (a
        target's); a copy stops being used once its weight is replaced or changed in place.
        Returns the bytes added."""
        added = 0
        for module in self.modules():
            w = getattr(module, "weight", None)
            if (
                not isinstance(module, nn.Linear)
                or w.device.type != "cpu"
                or w.dtype != torch.float32
                or w.shape[0] % PANEL
            ):
                continue
            old = getattr(module, "osd_packed", None)
            if old is None or old[0] is not w or old[1] != _version(w):
                module.osd_packed = (w, _version(w), pack_weight(w))
                added += w.numel() * w.element_size()
        return added

    def init_weights(
        self,
        std: float = 0.02,
        generator: torch.Generator | None = None,
        only: tuple[str, ...] | None = None,
    ) -> None:
        """Fresh weights: normal(0, std) matrices and embeddings, zero biases, unit norms;
        ``only``: the parameters whose names start with one of these prefixes."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if only is not None and not name.startswith(only):
                    continue
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=generator)

    def new_cache(
        self, max_batch_size: int, max_seq_len: int, *, context: int | None = None
    ) -> KVCache:
        """A :class:`~osd.cache.KVCache` for this model on its device and dtype (``context``:
        the longest sequence it will serve, default ``max_seq_len``)."""
        cache = KVCache.for_model(
            self.config,
            max_batch_size,
            max_seq_len,
            dtype=self.dtype,
            device=self.device,
            context=context,
        )
        self.reserve(cache.capacity, max_batch_size, cache.context)
        return cache

    # -- constant buffers read by cached forwards ----------------------------------
    # Invariant: a CUDA graph reads ``_arange`` and the RoPE tables at every replay, so no
    # buffer it captured may be freed. Every cache made by :meth:`new_cache` sizes them for
    # its capacity and batch before any capture (each forward's ``T`` fits the capacity
    # and its ``B`` the batch); after :meth:`pin_buffers` a forward that would need a
    # larger one raises instead of replacing it, and :meth:`reserve` keeps the buffers it
    # replaces alive.

    def reserve(self, positions: int, rows: int = 1, context: int | None = None) -> None:
        """Size ``_arange`` for ``max(positions, rows)`` and the RoPE tables (the variant
        ``context`` selects) for ``positions``. Called by :meth:`new_cache`."""
        # Growth at least doubles, so a pinned model retires few buffers.
        n = max(int(positions), int(rows))
        if self._arange.shape[0] < n or self._arange.device != self.device:
            self._retire(self._arange)
            self._arange = torch.arange(max(n, 2 * self._arange.shape[0], 64), device=self.device)
        for local in (False, True) if self._inv_freq_local is not None else (False,):
            key = self._rope_key(local, positions if context is None else context)
            cos, sin = self._tables.get(key, (torch.empty(0), None))
            if cos.shape[0] < positions or cos.device != self.device or cos.dtype != self.dtype:
                self._retire(cos, sin)
                self._tables[key] = self._new_tables(
                    key, max(int(positions), 2 * cos.shape[0], 256)
                )

    def pin_buffers(self) -> None:
        """From now on forwards read the reserved buffers only (CUDA graphs capture them):
        a forward that would grow one raises a ``RuntimeError`` naming it."""
        self._pinned = True

    def _retire(self, *tensors) -> None:
        if self._pinned:
            self._retired.extend(t for t in tensors if t is not None and t.numel())

    def _grow_error(self, name: str, have: int, need: int) -> RuntimeError:
        return RuntimeError(
            f"{type(self).__name__}.{name} holds {have} entries but a forward needs {need}, "
            f"and CUDA graphs may have captured it (the buffer cannot be replaced): make the "
            f"model's caches with new_cache() before capturing graphs, sized for the longest "
            f"sequence and the largest batch"
        )

    def _iota(self, n: int) -> torch.Tensor:
        """``arange(n)`` int64 on the model's device, a slice of the reserved buffer."""
        if self._arange.shape[0] < n or self._arange.device != self.device:
            if self._pinned:
                raise self._grow_error("_arange", self._arange.shape[0], n)
            self.reserve(n)
        return self._arange[:n]

    def _rope_key(self, local: bool, context: int) -> tuple[bool, bool]:
        """The table variant: ``(local, long)``, long for LongRoPE past its original context."""
        c = self.config
        return local, (
            c.rope_type == "longrope" and not local and context > c.rope_original_max_positions
        )

    def _new_tables(self, key: tuple[bool, bool], n: int):
        local, long = key
        inv_freq = (
            self._inv_freq_local
            if local
            else rope_inv_freq(self.config, long=True)
            if long
            else self._inv_freq
        )
        return rope_tables(inv_freq, n, self.dtype, self.device, self.config.rope_attention_factor)

    def _rope_tables(
        self,
        positions: torch.Tensor,
        needed: int,
        local: bool = False,
        context: int | None = None,
        cached: bool = True,
    ):
        """``cos, sin [B, T, 1, D]`` at ``positions [B, T]`` (``local``: the sliding layers'
        RoPE) from tables covering ``needed`` positions. A LongRoPE model uses its long
        factors when ``context`` (a cache's, default ``needed``) exceeds the original
        context, as llama.cpp chooses by its context size. Tables too small (or on another
        device or dtype) grow, unless pinned: then a cached forward raises, and an uncached
        one (``cached=False``, training) builds a table of its own."""
        key = self._rope_key(local, needed if context is None else context)
        cos, sin = self._tables.get(key, (torch.empty(0), None))
        if cos.shape[0] < needed or cos.device != self.device or cos.dtype != self.dtype:
            n = max(needed, 2 * cos.shape[0], 256)
            if not self._pinned:
                cos, sin = self._tables[key] = self._new_tables(key, n)
            elif cached:
                raise self._grow_error(f"RoPE table {key}", cos.shape[0], needed)
            else:
                cos, sin = self._new_tables(key, needed)
        return cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)

    def _layer_ropes(
        self, positions: torch.Tensor, needed: int, context: int | None = None, cached: bool = True
    ):
        """``(global, local)`` RoPE tables at ``positions`` (local None without one)."""
        local = (
            None
            if self._inv_freq_local is None
            else self._rope_tables(positions, needed, local=True, cached=cached)
        )
        return self._rope_tables(positions, needed, context=context, cached=cached), local

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        *,
        tree_mask: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
        skip_layers: frozenset[int] = frozenset(),
        logits_index: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
        return_hidden: bool = False,
    ):
        """Cached forward of ``T`` new tokens per row (decode, verify, a prefill piece).

        Args:
            input_ids: ``[B, T]`` int64 token ids, rows ``0..B-1`` of ``cache``.
            cache: the model's :class:`~osd.cache.KVCache`. Token ``i`` of row ``b`` writes
                its K/V at slot ``cache.lens[b] + i``; ``cache.lens`` is not changed (the
                caller commits). ``cache.bound + T`` must fit the capacity.
            tree_mask: ``[B, T]`` int64, bit ``i'`` of ``tree_mask[b, i]`` lets token ``i`` see
                token ``i'`` of the same forward (``T <= 64``). None is causal (any ``T``).
            depths: ``[B, T]`` int64 tree depth of each token: its position is
                ``cache.lens[b] + depths[b, i]``. None is ``arange(T)``.
            skip_layers: indices of decoder layers to bypass (their cache is not written).
            logits_index: ``[B, K]`` int64, compute logits only at these token indices.
            features: ``[B, T, hidden]`` per-token input features, for models that take
                them (the EAGLE draft, ``osd.models.eagle``); None for a plain decoder.
            return_hidden: also return the last layer's output before the final norm.

        Returns:
            ``[B, T, V]`` float32 logits (``[B, K, V]`` with ``logits_index``); with
            ``return_hidden``, ``(logits, hidden [B, T, hidden])`` in the model's dtype.
        """
        x = self._hidden(input_ids, cache, tree_mask, depths, skip_layers, features)
        logits = self._logits(x, logits_index)
        return (logits, x) if return_hidden else logits

    def prefill(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        lengths: torch.Tensor,
        *,
        logits_index: torch.Tensor | None = None,
        skip_layers: frozenset[int] = frozenset(),
        chunk: int | None = None,
        features: torch.Tensor | None = None,
        return_hidden: bool = False,
    ):
        """Feed a ragged batch of prompts in pieces and commit them.

        Piece ``s`` is ``input_ids[:, s * chunk : (s + 1) * chunk]``: one causal forward over
        the cache that the pieces before it wrote and committed, so peak activation memory
        (and the attention's ``[T, S]`` working set) grows with ``chunk``, not with the
        prompt. The result equals one forward over the whole prompt up to rounding.

        Args:
            input_ids: ``[B, T]`` int64; row ``b``'s prompt is its first ``lengths[b]``
                entries, the rest is padding (its K/V land past the row's length).
            cache: rows ``0..B-1`` continue from ``cache.lens`` (zero for new rows).
            lengths: ``[B]`` int32 on the model's device, ``1 <= lengths[b] <= T``.
            logits_index: ``[B, K]`` int64 prompt positions (``< lengths[b]``) whose logits
                are returned; None returns all ``T`` positions.
            skip_layers: as in :meth:`forward`.
            chunk: most tokens per forward; default ``config.prefill_chunk``.
            features: ``[B, T, hidden]`` input features, as in :meth:`forward`.
            return_hidden: also return the hidden states of every position.

        Returns:
            ``[B, K, V]`` float32 logits (``[B, T, V]`` without ``logits_index``); with
            ``return_hidden``, ``(logits, hidden [B, T, hidden])``. On return
            ``cache.lens[:B]`` has grown by ``lengths`` and ``cache.bound`` by ``T``.
        """
        B, T = input_ids.shape
        chunk = self.config.prefill_chunk if chunk is None else int(chunk)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        lengths = lengths.to(torch.int32)
        pieces = []  # logits per piece, without logits_index
        picked = None  # [B, K, hidden]: hidden states at logits_index
        hidden = []  # [B, width, hidden] per piece (return_hidden)
        for start in range(0, T, chunk):
            ids = input_ids[:, start : start + chunk]
            width = ids.shape[1]
            feats = None if features is None else features[:, start : start + chunk]
            x = self._hidden(ids, cache, None, None, skip_layers, feats)
            if return_hidden:
                hidden.append(x)
            if logits_index is None:
                pieces.append(self._logits(x, None))
            else:
                local = logits_index - start
                here = ((local >= 0) & (local < width))[..., None]
                rows = x.gather(1, local.clamp(0, width - 1)[..., None].expand(-1, -1, x.shape[-1]))
                # The first piece fills every slot; later ones overwrite the slots they hold.
                picked = rows if picked is None else torch.where(here, rows, picked)
            # Each row advances by its own tokens in this piece (padding stays uncommitted).
            cache.commit((lengths - start).clamp(0, width).to(torch.int32), width)
        logits = torch.cat(pieces, dim=1) if logits_index is None else self._logits(picked, None)
        return (logits, torch.cat(hidden, dim=1)) if return_hidden else logits

    def _embed(self, input_ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input ``[B, T, hidden]``: the token embeddings. Models that
        take input features (``osd.models.eagle``) combine them here."""
        if features is not None:
            raise ValueError(f"{type(self).__name__} takes no input features")
        x = self.embed_tokens(input_ids)
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * m

    def _hidden(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        tree_mask: torch.Tensor | None,
        depths: torch.Tensor | None,
        skip_layers: frozenset[int],
        features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The cached forward up to the final norm: hidden states ``[B, T, hidden]``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if B > cache.max_batch_size:
            raise ValueError(f"batch of {B} rows but the cache holds {cache.max_batch_size}")
        if cache.bound + T > cache.capacity:
            raise ValueError(
                f"{T} new tokens on top of up to {cache.bound} cached ones exceed "
                f"the cache capacity {cache.capacity}"
            )
        if tree_mask is not None and T > MAX_TREE:
            raise ValueError(f"a tree mask allows at most {MAX_TREE} tokens per row, got {T}")
        lens = cache.lens[:B, None].to(torch.int64)  # [B, 1]
        slots = lens + self._iota(T)  # [B, T] K/V slots
        positions = slots if depths is None else lens + depths
        ropes = self._layer_ropes(positions, cache.capacity, cache.context)
        rows = self._iota(B)[:, None]  # [B, 1]
        max_kv_len = cache.bound + T
        x = self._embed(input_ids, features)
        from osd.models import fused_layers  # it imports this module

        if fused_layers.use_fused(self, x):  # fused kernels on CUDA (osd/models/fused_layers.py)
            return fused_layers.fused_hidden(
                self, x, cache, ropes, slots, tree_mask, depths, skip_layers, max_kv_len
            )
        for index, layer in enumerate(self.layers):
            if index in skip_layers:
                continue
            q, k, v = layer.qkv(x, *ropes[layer.local_rope])
            kv = cache.kv[index]  # [2, B_max, H, S, D]
            # write K/V at [row, slot]: a [B_max, S, 2, H, D] view indexed by (rows, slots)
            kv.permute(1, 3, 0, 2, 4).index_put_((rows, slots), torch.stack((k, v), dim=2))
            out = attention(
                q,
                kv[0],
                kv[1],
                cache.lens,
                tree_mask,
                scale=self.scale,
                max_kv_len=max_kv_len,
                backend=self.attention_backend,
                window=layer.window,
                depths=depths,
                softcap=layer.softcap,
            )
            x = layer.finish(x, out)
        return x

    def forward_train(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        skip_layers: frozenset[int] = frozenset(),
        rows: torch.Tensor | None = None,
        full_vocab: bool = True,
        features: torch.Tensor | None = None,
        return_hidden: bool = False,
    ):
        """Cacheless causal forward over whole sequences; supports autograd.

        Args:
            input_ids: ``[N, T]`` int64.
            attention_mask: ``[N, T]`` (1 = token, 0 = padding) or None. Positions count
                only real tokens, so left padding works as in transformers.
            skip_layers: indices of decoder layers to bypass.
            rows: ``[M]`` int64 indices into the ``N * T`` flattened positions, or None.
                Given, the output head runs on those rows only: a small draft's head is
                most of its cost, and training needs logits only where a target is.
            full_vocab: False returns a restricted head's own columns (``V_head``, in the
                order of ``head_ids``) instead of ``V`` with ``-inf`` outside them.
            features: ``[N, T, hidden]`` input features, as in :meth:`forward`.
            return_hidden: also return the hidden states ``[N, T, hidden]`` of every
                position (before the final norm).

        Returns:
            ``[N, T, V]`` float32 logits, or ``[M, V]`` with ``rows``; with
            ``return_hidden``, ``(logits, hidden)``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [N, T], got {tuple(input_ids.shape)}")
        N, T = input_ids.shape
        if attention_mask is None:
            positions = torch.arange(T, device=input_ids.device).expand(N, T)
            key_mask = None
        else:
            key_mask = attention_mask.to(device=input_ids.device).bool()
            positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
        ropes = self._layer_ropes(positions, T, cached=False)
        x = self._embed(input_ids, features)
        for index, layer in enumerate(self.layers):
            if index in skip_layers:
                continue
            q, k, v = layer.qkv(x, *ropes[layer.local_rope])
            x = layer.finish(
                x,
                causal_attention(
                    q, k, v, key_mask, scale=self.scale, window=layer.window, softcap=layer.softcap
                ),
            )
        hidden = x
        if rows is not None:
            x = x.reshape(N * T, x.shape[-1]).index_select(0, rows)
        logits = self._logits(x, None, full_vocab)
        return (logits, hidden) if return_hidden else logits

    def _logits(
        self, x: torch.Tensor, logits_index: torch.Tensor | None, full_vocab: bool = True
    ) -> torch.Tensor:
        if logits_index is not None:
            x = x.gather(1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
        y = project(x, self.lm_head, self.norm).float()
        if self.config.logits_scaling != 1.0:
            y = y / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:
            y = torch.tanh(y / cap) * cap
        if self.head_ids is None or not full_vocab:
            return y
        out = y.new_full((*y.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.head_ids, y)


def without_layers(model: DecoderLM, skip: frozenset[int]) -> DecoderLM:
    """A standalone copy of ``model`` without the layers in ``skip``: the self-speculative
    draft as a model of its own (its embeddings, kept layers, norm and head copied)."""
    keep = [i for i in range(model.config.num_layers) if i not in skip]
    c = model.config

    def renumbered(layers):
        return (
            None if layers is None else tuple(new for new, old in enumerate(keep) if old in layers)
        )

    config = dataclasses.replace(
        c,
        num_layers=len(keep),
        nope_layers=renumbered(c.nope_layers),
        window_layers=renumbered(c.window_layers),
    )
    sub = DecoderLM(config, device=model.device, dtype=model.dtype)
    # Block-quantized layers are shared (they are never trained).
    for new, old in enumerate(keep):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            if isinstance(getattr(model.layers[old], name), QuantLinear):
                setattr(sub.layers[new], name, getattr(model.layers[old], name))
    if isinstance(model.lm_head, QuantLinear):
        sub.lm_head = model.lm_head
    state = {}
    for name, value in model.state_dict().items():
        if name.startswith("layers."):
            index, rest = name.split(".", 2)[1:]
            if int(index) not in keep:
                continue
            name = f"layers.{keep.index(int(index))}.{rest}"
        state[name] = value
    sub.load_state_dict(state)
    return sub.requires_grad_(False)
