"""Query routing across several drafts.

Each request is described by cheap prompt features: hashed unigram and bigram counts of
its token ids, L2-normalised (``prompt_features``). Per draft, a ridge regression
predicts that draft's acceptance α from the features (LinUCB, Li et al. 2010), kept with
Sherman-Morrison updates so each update is O(dim^2) and no matrix is ever inverted.

Two kinds of feedback (``RouterConfig.feedback``):

- ``"bandit"``: only the draft that served the request learns its observed α; the
  choice adds an upper-confidence bonus ``explore * sqrt(x^T A^-1 x)`` to explore.
- ``"score"`` (default): after a request, every draft is scored on the tokens the target
  already verified (a draft forward over the committed sequence against the stored target
  distributions; no extra target cost, as in HedgeSpec), so all drafts learn from every
  request (full information) and no exploration is needed.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass
class RouterConfig:
    feedback: str = "score"   # "score" (full information) or "bandit" (chosen draft only)
    dim: int = 512            # hashed feature dimension
    ridge: float = 1.0        # prior precision lambda of each draft's regression
    explore: float = 0.5      # UCB bonus weight (bandit feedback only)
    prior_alpha: float = 0.5  # predicted alpha before any data

    def __post_init__(self):
        if self.feedback not in ("score", "bandit"):
            raise ValueError(f"RouterConfig.feedback must be 'score' or 'bandit', got "
                             f"{self.feedback!r}")
        if self.dim < 8:
            raise ValueError(f"RouterConfig.dim must be >= 8, got {self.dim}")


_MULT1, _MULT2 = 0x9E3779B1, 0x85EBCA77


def prompt_features(tokens, dim: int) -> torch.Tensor:
    """Hashed unigram + bigram counts of ``tokens`` -> ``[dim]`` float64, unit L2 norm.

    A constant bias feature sits in slot 0 so the regression has an intercept.
    """
    t = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    x = torch.zeros(dim, dtype=torch.float64)
    if t.numel():
        uni = (t * _MULT1) % (dim - 1) + 1
        x.index_add_(0, uni, torch.ones_like(uni, dtype=torch.float64))
        if t.numel() > 1:
            bi = ((t[:-1] * _MULT1) ^ (t[1:] * _MULT2)) % (dim - 1) + 1
            x.index_add_(0, bi, torch.ones_like(bi, dtype=torch.float64))
        x = x / x.norm()
    x[0] = 1.0
    return x / x.norm()


class Router:
    """Chooses a draft per request and learns from observed acceptance."""

    def __init__(self, num_drafts: int, config: RouterConfig | None = None):
        if num_drafts < 1:
            raise ValueError("Router needs at least one draft")
        self.config = config or RouterConfig()
        self.num_drafts = num_drafts
        d = self.config.dim
        self._a_inv = torch.eye(d, dtype=torch.float64).repeat(num_drafts, 1, 1) / self.config.ridge
        self._b = torch.zeros(num_drafts, d, dtype=torch.float64)
        self._bias = self.config.prior_alpha
        self._lock = threading.Lock()
        self.choices = [0] * num_drafts

    def features(self, prompt_tokens) -> torch.Tensor:
        return prompt_features(prompt_tokens, self.config.dim)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted α of every draft for features ``x [dim]`` -> ``[num_drafts]``."""
        with self._lock:
            theta = torch.einsum("nij,nj->ni", self._a_inv, self._b)
            return self._bias + theta @ x

    def choose(self, x: torch.Tensor) -> int:
        with self._lock:
            theta = torch.einsum("nij,nj->ni", self._a_inv, self._b)
            score = self._bias + theta @ x
            if self.config.feedback == "bandit":
                var = torch.einsum("i,nij,j->n", x, self._a_inv, x).clamp(min=0)
                score = score + self.config.explore * var.sqrt()
            choice = int(torch.argmax(score))
            self.choices[choice] += 1
            return choice

    def update(self, x: torch.Tensor, draft: int, alpha: float) -> None:
        """Learn that ``draft`` achieved acceptance ``alpha`` on a request with features x."""
        with self._lock:
            a_inv = self._a_inv[draft]
            ax = a_inv @ x
            self._a_inv[draft] = a_inv - torch.outer(ax, ax) / (1.0 + x @ ax)
            self._b[draft] += (float(alpha) - self._bias) * x

    def update_all(self, x: torch.Tensor, alphas) -> None:
        """Full-information update: the α every draft would have had on this request."""
        for d, a in enumerate(alphas):
            if a is not None:
                self.update(x, d, a)

    def state_dict(self) -> dict:
        return {"a_inv": self._a_inv.clone(), "b": self._b.clone(), "choices": list(self.choices)}

    def load_state_dict(self, state: dict) -> None:
        self._a_inv = state["a_inv"].clone()
        self._b = state["b"].clone()
        self.choices = list(state["choices"])
