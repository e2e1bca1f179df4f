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

The layer and its parts (:class:`RMSNorm`, :func:`project`, :class:`MoE`,
:class:`DecoderLayer`) are in :mod:`osd.models.layers`; RoPE and the position buffers the
cached forwards read (:class:`~osd.models.rope.PositionBuffers`) in :mod:`osd.models.rope`;
the fused layers (CUDA, and CPU forwards of few rows) in :mod:`osd.models.fused_layers`.
Their names are importable from here too.

A draft may keep only some rows of its output head (:meth:`DecoderLM.restrict_head`, the
reduced draft vocabulary of EAGLE-3): a small draft's head is most of its cost. Its
logits still come back over the whole vocabulary, ``-inf`` outside the kept tokens, so
that a proposal is an ordinary distribution the verifier can score; training asks for
the kept columns only (``full_vocab=False``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from osd.cache import KVCache
import osd.models.fused_layers as fused_layers
from osd.models.attention import attention, causal_attention, resolve_attention_backend
from osd.models.config import ModelConfig
from osd.models.layers import (
    DecoderLayer,
    MoE,
    RMSNorm,
    gelu_tanh,
    project,
    weight_version,
)
from osd.models.quant import QuantLinear
from osd.models.rope import PositionBuffers, apply_rope, rope_inv_freq, rope_tables
from osd_kernels.decode_linear import PANEL, pack_weight

MAX_TREE = 64  # tree_mask is one int64 bitmask per query


class DecoderLM(PositionBuffers, nn.Module):
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
        self._init_position_buffers()
        # [V_head] int64 vocabulary ids of the head's rows; None: the head covers every id.
        self.register_buffer("head_ids", None)
        # The K/V dtype of the caches new_cache makes; None: the model's dtype. float16
        # under a float32 model on the CPU halves the bytes attention reads per key (the
        # kernels widen it as they read; osd_kernels.tree_attention).
        self.kv_dtype: torch.dtype | None = None

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
            if old is None or old[0] is not w or old[1] != weight_version(w):
                module.osd_packed = (w, weight_version(w), pack_weight(w))
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
        """A :class:`~osd.cache.KVCache` for this model on its device, in its
        :attr:`kv_dtype` (``context``: the longest sequence it will serve, default
        ``max_seq_len``)."""
        cache = KVCache.for_model(
            self.config,
            max_batch_size,
            max_seq_len,
            dtype=self.kv_dtype or self.dtype,
            device=self.device,
            context=context,
        )
        self.reserve(cache.capacity, max_batch_size, cache.context)
        return cache

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
        max_kv_len = cache.bound + T
        x = self._embed(input_ids, features)
        # the fused layers (osd/models/fused_layers.py): Triton on CUDA, C++ for few CPU rows
        if fused_layers.use_fused(self, x):
            return fused_layers.fused_hidden(
                self, x, cache, ropes, slots, tree_mask, depths, skip_layers, max_kv_len
            )
        rows = self._iota(B)[:, None]  # [B, 1]
        for index, layer in enumerate(self.layers):
            if index in skip_layers:
                continue
            q, k, v = layer.qkv(x, *ropes[layer.local_rope])
            kv = cache.kv[index]  # [2, B_max, H, S, D]
            # write K/V at [row, slot]: a [B_max, S, 2, H, D] view indexed by (rows, slots)
            kv.permute(1, 3, 0, 2, 4).index_put_(
                (rows, slots), torch.stack((k, v), dim=2).to(kv.dtype)
            )
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


__all__ = [
    "MAX_TREE",
    "DecoderLM",
    "DecoderLayer",
    "MoE",
    "RMSNorm",
    "apply_rope",
    "gelu_tanh",
    "project",
    "rope_inv_freq",
    "rope_tables",
    "weight_version",
    "without_layers",
]
