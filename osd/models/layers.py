"""The decoder layer of :class:`~osd.models.llama.DecoderLM` and its parts: RMSNorm, the
projection helper :func:`project` (``decode_linear`` / ``quant_linear`` with the RMSNorm
in front fused in), the mixture-of-experts MLP and :class:`DecoderLayer`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from osd.models.config import ModelConfig
from osd.models.quant import QuantLinear
from osd.models.rope import apply_rope
from osd_kernels.decode_linear import MAX_ROWS as DECODE_MAX_ROWS
from osd_kernels.decode_linear import decode_linear
from osd_kernels.quant_linear import quant_linear


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


def weight_version(t: torch.Tensor) -> int:
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
        return quant_linear(
            x, layer.qweight, layer.scales, layer.mins, layer.bias, ggml_type=layer.ggml_type, **kw
        )
    w = layer.weight
    packed = getattr(layer, "osd_packed", None)
    # a packed copy is used only while it is of this very weight, unchanged since packing
    if packed is not None and packed[0] is w and packed[1] == weight_version(w):
        return decode_linear(x, w, layer.bias, packed=packed[2], **kw)
    return decode_linear(x, w, layer.bias, **kw)


def project_rows(x: torch.Tensor, layer: nn.Module, norm: RMSNorm | None = None) -> torch.Tensor:
    """:func:`project` for rows ``x [M, K]`` (float32, CPU, last dim contiguous, outside
    autograd, with the native build: the caller's guarantee) straight through the C++
    op, without the op's Python entry point and its reshapes (the fused CPU layers call it
    four times a layer). Same arguments to the same kernels as :func:`project`, so the
    same results bit for bit; keep the two in step."""
    norm_weight, eps = (None, 1e-6) if norm is None else (norm.weight, norm.eps)
    if isinstance(layer, QuantLinear):
        return torch.ops.osd.quant_linear(
            x,
            layer.qweight,
            layer.scales,
            layer.mins,
            layer.bias,
            norm_weight,
            eps,
            layer.ggml_type,
        )
    w = layer.weight
    if x.shape[0] > DECODE_MAX_ROWS or not w.is_contiguous() or w.dtype != torch.float32:
        return project(x, layer, norm)  # decode_linear's auto would take F.linear
    packed = getattr(layer, "osd_packed", None)
    if packed is not None and packed[0] is w and packed[1] == weight_version(w):
        w = packed[2]
    return torch.ops.osd.decode_linear(x, w, layer.bias, norm_weight, eps)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
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
        self.act = F.silu if c.hidden_act == "silu" else gelu_tanh
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
