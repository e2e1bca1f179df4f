"""The EAGLE draft: a small decoder that drafts from the target's own features.

EAGLE (seed paper ``../shared/seeds``; Li et al. 2024) drafts at the feature level: the
*feature* ``f_i`` is the output of the target's last decoder layer at position ``i``
(before the final norm), which the target's norm and head turn into the distribution of
``x_{i+1}``. The draft's input at its position ``i`` is ``f_i`` together with the token
``x_{i+1}`` (which resolves the sampling uncertainty ``f_i`` alone cannot); one (or a few)
decoder layers predict ``g_{i+1} ~ f_{i+1}``, and the target's own final norm and (rows of
its) output head turn ``g_{i+1}`` into the draft distribution of ``x_{i+2}``. Deeper
drafts feed the predicted feature back in: ``(g_{i+1}, x_{i+2}) -> g_{i+2}``.

:class:`EagleLM` is a :class:`~osd.models.DecoderLM` whose first-layer input is
``fc([embed(x); feature_norm(f)])`` instead of ``embed(x)``; it shares the target's
embedding, final norm and output head (kept frozen), so a checkpoint stores only
``feature_norm``, ``fc`` and the layers. It needs ``features=`` in every forward; the
drafter ``osd.spec_decode.eagle_drafter.EagleDrafter`` supplies the target's features from
prefill and verify forwards.

Checkpoint directory (:func:`save_eagle`, :func:`load_eagle`): ``config.json``
(``"architectures": ["OsdEagleDraft"]`` with the layer shape and the target's hidden and
vocabulary sizes), ``model.safetensors`` and optionally ``head_vocab.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from safetensors.torch import load_file, save_file

from osd.models.layers import RMSNorm
from osd.models.llama import DecoderLM
from osd.models.loading import HEAD_VOCAB_FILE, read_head_vocab
from osd.models.quant import QuantLinear

ARCHITECTURE = "OsdEagleDraft"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class EagleLM(DecoderLM):
    """EAGLE draft layers on top of a target's embedding, final norm and head.

    Build with :meth:`from_target` (fresh) or :func:`load_eagle` (a checkpoint). Its
    config is the target's with ``num_layers`` (and optionally ``intermediate_size``) of
    the draft. ``state_dict()`` leaves the shared (frozen) tensors out.
    """

    def __init__(
        self, config, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(config, device=device, dtype=dtype)
        H = config.hidden_size
        self.feature_norm = RMSNorm(H, config.rms_norm_eps).to(device=self.device, dtype=dtype)
        self.fc = nn.Linear(2 * H, H, bias=False, device=self.device, dtype=dtype)
        # The target's tensors stay out of state_dict(): snapshots, checkpoints and the
        # online learner's published weights hold the draft's own tensors only.
        self.register_state_dict_post_hook(_drop_shared)

    @classmethod
    def from_target(
        cls,
        target: DecoderLM,
        *,
        num_layers: int = 1,
        intermediate_size: int | None = None,
        head_ids=None,
    ) -> "EagleLM":
        """A fresh EAGLE draft for ``target``: uninitialised layers (call
        :meth:`init_draft`), the target's embedding, final norm and head shared (a
        restricted head, ``head_ids``, copies the kept rows)."""
        if isinstance(target, EagleLM):
            raise TypeError("an EAGLE draft drafts for a plain DecoderLM target")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        # the draft's own layers all use RoPE and full attention, whatever the target's
        # NoPE (SmolLM3) and sliding-window layers
        config = dataclasses.replace(  # dense layers, also for a mixture-of-experts target
            target.config,
            num_layers=num_layers,
            nope_layers=(),
            window_layers=(),
            intermediate_size=intermediate_size or target.config.intermediate_size,
            num_experts=0,
            moe_layers=None,
        )
        model = cls(config, device=target.device, dtype=target.dtype)
        model.embed_tokens.weight = target.embed_tokens.weight
        model.norm.weight = target.norm.weight
        if isinstance(target.lm_head, QuantLinear):
            model.lm_head = target.lm_head  # block-quantized: shared as it is
        else:
            model.lm_head.weight = target.lm_head.weight
        for p in model.shared_parameters():
            p.requires_grad_(False)
        if head_ids is not None:
            model.restrict_head(head_ids)
            for p in model.lm_head.parameters():
                p.requires_grad_(False)
        return model

    def shared_parameters(self) -> list[nn.Parameter]:
        """The target's tensors this draft uses (embedding, final norm, head): frozen."""
        return [self.embed_tokens.weight, self.norm.weight, *self.lm_head.parameters()]

    def shared_modules(self) -> list[nn.Module]:
        """Shared target layers without parameters (a block-quantized head): a copy of the
        draft (the online learner's) keeps using them rather than copying them."""
        return [self.lm_head] if isinstance(self.lm_head, QuantLinear) else []

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """The draft's own weights (what a checkpoint stores)."""
        return {
            k: v
            for k, v in self.state_dict().items()
            if k.startswith(("fc.", "feature_norm.", "layers."))
        }

    def init_draft(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Fresh draft weights (the shared target tensors are left alone): normal(0, std)
        matrices, unit norms; ``fc`` starts as ``[I, I]``: the token's embedding plus the
        normed feature."""
        H = self.config.hidden_size
        self.init_weights(std, generator, only=("layers.", "feature_norm."))
        with torch.no_grad():
            eye = torch.eye(H, device=self.device, dtype=self.dtype)
            self.fc.weight.copy_(torch.cat([eye, eye], 1))

    def _embed(self, input_ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        if features is None:
            raise ValueError("an EAGLE draft needs the target's features (features=...)")
        if features.shape[:-1] != input_ids.shape or features.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"features must be [*{tuple(input_ids.shape)}, "
                f"{self.config.hidden_size}], got {tuple(features.shape)}"
            )
        f = self.feature_norm(features.to(self.dtype))
        return self.fc(torch.cat([self.embed_tokens(input_ids), f], -1))


SHARED = ("embed_tokens.weight", "norm.weight", "lm_head.")


def _drop_shared(module, state_dict, prefix, local_metadata) -> None:
    for name in [k for k in state_dict if k.startswith(tuple(prefix + s for s in SHARED))]:
        state_dict.pop(name)


def is_eagle_checkpoint(source) -> bool:
    """Whether ``source`` is a directory holding an EAGLE draft's ``config.json``."""
    if not isinstance(source, (str, os.PathLike)):
        return False
    file = Path(source) / CONFIG_FILE
    if not file.is_file():
        return False
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    return ARCHITECTURE in (config.get("architectures") or [])


def save_eagle(model: EagleLM, path: str | os.PathLike, meta: dict | None = None) -> None:
    """Write ``model``'s own weights (fp16), its config and head vocabulary to ``path``."""

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.config
    config = {
        "architectures": [ARCHITECTURE],
        "num_layers": c.num_layers,
        "intermediate_size": c.intermediate_size,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "num_heads": c.num_heads,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
    }
    if meta:
        config["build"] = meta
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {
        k: v.detach().to(torch.float16).contiguous() for k, v in model.own_state_dict().items()
    }
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    head = path / HEAD_VOCAB_FILE
    if model.head_ids is not None:
        head.write_text(json.dumps(model.head_ids.tolist(), separators=(",", ":")))
    elif head.exists():
        head.unlink()


def load_eagle(source: str | os.PathLike, target: DecoderLM, *, head_vocab: bool = True) -> EagleLM:
    """The EAGLE draft at ``source`` for ``target`` (on its device and dtype). ValueError
    when the checkpoint was built for another hidden size, vocabulary or head shape."""
    path = Path(source)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no EAGLE draft at {str(path)!r}: {CONFIG_FILE} is missing")
    if not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"EAGLE draft {str(path)!r} has no {WEIGHTS_FILE}")
    config = json.loads((path / CONFIG_FILE).read_text())
    if ARCHITECTURE not in (config.get("architectures") or []):
        raise ValueError(
            f"{str(path)!r} is not an EAGLE draft (architectures {config.get('architectures')})"
        )
    tc = target.config
    for key, have in (
        ("hidden_size", tc.hidden_size),
        ("vocab_size", tc.vocab_size),
        ("num_heads", tc.num_heads),
        ("num_kv_heads", tc.num_kv_heads),
        ("head_dim", tc.head_dim),
    ):
        if config.get(key) != have:
            raise ValueError(
                f"EAGLE draft {str(path)!r} was built for {key} = "
                f"{config.get(key)}, but the target has {have}"
            )
    ids = read_head_vocab(path) if head_vocab else None
    model = EagleLM.from_target(
        target,
        num_layers=int(config["num_layers"]),
        intermediate_size=int(config["intermediate_size"]),
        head_ids=ids,
    )
    state = load_file(str(path / WEIGHTS_FILE))
    own = model.own_state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"EAGLE draft {str(path)!r} does not match its config: missing "
            f"{missing[:4]}, unexpected {unexpected[:4]}"
        )
    with torch.no_grad():
        for name, value in state.items():
            if own[name].shape != value.shape:
                raise ValueError(
                    f"EAGLE draft {str(path)!r}: {name} has shape "
                    f"{tuple(value.shape)}, expected {tuple(own[name].shape)}"
                )
            own[name].copy_(value.to(own[name].dtype))
    return model.requires_grad_(False)


def eagle_inputs(tokens: torch.Tensor, features: torch.Tensor):
    """Training pairs of a sequence: draft inputs ``(tokens[:, 1:], features[:, :-1])``.

    ``tokens [N, T]`` and the target's ``features [N, T, H]`` at them; draft position
    ``j`` then predicts ``features[:, j + 1]`` and the distribution of ``tokens[:, j + 2]``
    (the target's logits at position ``j + 1``)."""
    return tokens[:, 1:], features[:, :-1]


def head_probs(draft: EagleLM, logits: torch.Tensor) -> torch.Tensor:
    """The target's distribution from its ``logits [..., V]`` over the draft's head
    columns ``[..., V_head]`` (the mass outside the head is dropped: the draft can never
    propose those tokens)."""
    p = torch.softmax(logits.float(), -1)
    return p if draft.head_ids is None else p.index_select(-1, draft.head_ids)


def eagle_loss(
    draft: EagleLM,
    tokens: torch.Tensor,
    features: torch.Tensor,
    target_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    feature_weight: float = 1.0,
    unroll: int = 2,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> dict:
    """The EAGLE training loss of ``draft`` on teacher-forced sequences.

    Args:
        tokens: ``[N, T]`` int64 sequences.
        features: ``[N, T, H]`` the target's features at them (no grad).
        target_probs: ``[N, T, V_head]`` the target's distribution at each position over
            the draft's head columns (position ``i``: of ``tokens[:, i + 1]``;
            :func:`head_probs`).
        mask: ``[N, T]`` bool, the positions whose token is real and whose target is
            known (right padding and unscored positions False), or None for all.
        feature_weight: weight of the smooth-L1 feature regression next to the token
            loss (cross-entropy from the target's distribution). Features are compared
            at unit RMS: only their direction reaches the head (through the target's final
            norm) and the draft's next input (through ``feature_norm``), while their scale
            is dominated by a few outlier channels.
        unroll: passes; pass ``u > 1`` feeds the draft its own predicted features of the
            pass before (detached), as it drafts several tokens deep at serving time.
        noise: uniform noise ``U(-noise, noise) * rms(feature)`` on the teacher features
            of the first pass (EAGLE's data augmentation).

    Returns:
        ``{"loss": scalar with grad, "token": float, "feature": float, "agree": float}``
        (``agree``: the share of positions where the draft's top-1 is the target's, first
        pass).
    """
    ids, feats = eagle_inputs(tokens, features)
    N, T1 = ids.shape
    # Draft position j reads tokens[:, j + 1]; the target's feature and distribution at
    # position j + 1 are its goals.
    real = (
        torch.ones(N, T1, dtype=torch.bool, device=ids.device)
        if mask is None
        else mask[:, 1:].bool()
    )
    attn = None if mask is None else _right_padding(mask[:, 1:])
    rows = real.reshape(-1).nonzero()[:, 0]
    H = features.shape[-1]
    goal_feat = _unit_rms(features[:, 1:].reshape(-1, H).index_select(0, rows).float())
    goal_p = target_probs[:, 1:].reshape(-1, target_probs.shape[-1]).index_select(0, rows).float()
    x_feats = feats
    if noise > 0:
        scale = feats.float().pow(2).mean(-1, keepdim=True).sqrt()
        u = torch.rand(feats.shape, generator=generator, device=feats.device) * 2 - 1
        x_feats = feats + (noise * scale * u).to(feats.dtype)
    passes = max(1, unroll)
    total, tok_sum, feat_sum, agree = 0.0, 0.0, 0.0, 0.0
    for u_pass in range(passes):
        logits, g = draft.forward_train(
            ids, attn, rows=rows, full_vocab=False, features=x_feats, return_hidden=True
        )
        tok = -(goal_p * torch.log_softmax(logits, -1)).sum(-1).mean()
        pred = g.reshape(-1, H).index_select(0, rows).float()
        feat = torch.nn.functional.smooth_l1_loss(_unit_rms(pred), goal_feat)
        total = total + tok + feature_weight * feat
        tok_sum += float(tok.detach())
        feat_sum += float(feat.detach())
        if u_pass == 0:
            agree = float((logits.argmax(-1) == goal_p.argmax(-1)).float().mean())
        # The next pass reads the feature predicted for position j at input j.
        x_feats = torch.cat([feats[:, :1], g[:, :-1].detach().to(feats.dtype)], 1)
    return {
        "loss": total / passes,
        "token": tok_sum / passes,
        "feature": feat_sum / passes,
        "agree": agree,
    }


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-6)


def _right_padding(mask: torch.Tensor) -> torch.Tensor:
    """An attention mask that keeps every position up to a row's last True one (unscored
    positions inside a row are still real tokens to attend to)."""
    idx = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask.bool(), idx, -1).max(1, keepdim=True).values
    return (idx <= last).long()
