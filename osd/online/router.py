"""Query routing across several drafts.

Each request is described by cheap prompt features: which hashed unigrams and bigrams
of its token ids occur, L2-normalised (``prompt_features``). The router remembers the
features of recent requests together with the acceptance α each draft achieved (or
would have achieved) on them, and predicts a draft's α on a new request as the
similarity-weighted geometric mean over its ``neighbors`` most similar remembered
requests, shrunk towards a prior (a k-nearest-neighbour contextual bandit). Similar
prompts (same domain, same kind of text) have similar drafts' fortunes, and nothing is
lost to a linear model's shared intercept.

Two kinds of feedback (``RouterConfig.feedback``):

- ``"bandit"``: only the draft that served the request learns its observed α; the
  choice adds an exploration bonus ``explore / sqrt(1 + neighbours that saw the draft)``.
- ``"score"`` (default): after a request, every draft is scored on the tokens the target
  already verified (a draft forward over the committed sequence against the stored target
  distributions; no extra target cost, as in HedgeSpec), so all drafts learn from every
  request (full information) and no exploration is needed.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch


@dataclass
class RouterConfig:
    feedback: str = "score"  # "score" (full information) or "bandit" (chosen draft only)
    dim: int = 4096  # hashed feature dimension (see prompt_features)
    memory: int = 2048  # remembered requests (oldest forgotten first; dim * memory
    # float32 features: 32 MiB at the defaults)
    neighbors: int = 16  # most similar remembered requests used per prediction
    temperature: float = 0.1  # neighbour weight exp((cos - best cos) / temperature)
    prior_weight: float = 0.1  # weight of the prior in the shrunk mean
    explore: float = 0.2  # exploration bonus (bandit feedback only)
    prior_alpha: float = 0.5  # predicted alpha before any data

    def __post_init__(self):
        if self.feedback not in ("score", "bandit"):
            raise ValueError(
                f"RouterConfig.feedback must be 'score' or 'bandit', got {self.feedback!r}"
            )
        if self.dim < 8:
            raise ValueError(f"RouterConfig.dim must be >= 8, got {self.dim}")
        if not 0.0 < self.prior_alpha <= 1.0:
            raise ValueError(f"RouterConfig.prior_alpha must be in (0, 1], got {self.prior_alpha}")
        if self.memory < 1 or self.neighbors < 1:
            raise ValueError(
                f"RouterConfig.memory and neighbors must be >= 1, got "
                f"{self.memory}, {self.neighbors}"
            )


_MULT1, _MULT2 = 0x9E3779B1, 0x85EBCA77
_ALPHA_FLOOR = 1e-3  # α below this counts as this in the (log-space) mean


def prompt_features(tokens, dim: int) -> torch.Tensor:
    """Which hashed unigrams and bigrams of ``tokens`` occur -> ``[dim]`` float32, unit L2.

    Presence rather than counts, so that frequent tokens (spaces, newlines) do not
    dominate the similarity between two prompts. ``dim`` must be large against the
    number ``m`` of distinct n-grams of a prompt: two unrelated prompts share about
    ``m * m / dim`` buckets by chance, which adds up to about ``m / dim`` to their cosine.
    On the zoo's 48-token prompts (``query_stream(domain, n=36, prompt_tokens=48,
    seed=2)``, m = 76 on average) the mean cosine of prose/prose, code/code and
    prose/code pairs measured 0.128, 0.138, 0.099 at ``dim`` 1024; 0.086, 0.097, 0.054
    at 4096; 0.073, 0.086, 0.042 at 2**20 (almost no collisions). At 1024 the collision
    noise exceeded the gap between same-domain and cross-domain pairs.
    """
    t = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    x = torch.zeros(dim, dtype=torch.float32)
    if t.numel():
        x[(t * _MULT1) % dim] = 1.0
        if t.numel() > 1:
            x[((t[:-1] * _MULT1) ^ (t[1:] * _MULT2)) % dim] = 1.0
        x = x / x.norm()
    return x


class Router:
    """Chooses a draft per request and learns from observed acceptance."""

    def __init__(self, num_drafts: int, config: RouterConfig | None = None):
        if num_drafts < 1:
            raise ValueError("Router needs at least one draft")
        self.config = config or RouterConfig()
        self.num_drafts = num_drafts
        cfg = self.config
        self._x = torch.zeros(cfg.memory, cfg.dim, dtype=torch.float32)
        self._y = torch.full((cfg.memory, num_drafts), float("nan"), dtype=torch.float32)
        self._count = 0  # requests remembered so far (ring buffer)
        self._lock = threading.Lock()
        self.choices = [0] * num_drafts

    def features(self, prompt_tokens) -> torch.Tensor:
        return prompt_features(prompt_tokens, self.config.dim)

    def _neighbours(self, x: torch.Tensor):
        n = min(self._count, self.config.memory)
        if n == 0:
            return None, None
        sims = self._x[:n] @ x
        # Few neighbours while little is remembered (they must come from the request's own
        # kind of text), up to ``neighbors`` later; the most similar count most.
        k = max(1, min(self.config.neighbors, n // 4))
        top = torch.topk(sims, k)
        w = torch.exp((top.values - top.values[0]) / self.config.temperature)
        return w, self._y[top.indices]

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted α of every draft for features ``x [dim]`` -> ``[num_drafts]``."""
        with self._lock:
            return self._predict(x)[0]

    def _predict(self, x: torch.Tensor):
        cfg = self.config
        w, y = self._neighbours(x)
        prior = torch.full((self.num_drafts,), math.log(cfg.prior_alpha))
        if w is None:
            return prior.exp(), torch.zeros(self.num_drafts)
        seen = ~torch.isnan(y)  # [k, D]
        wk = w[:, None] * seen
        total = wk.sum(0)
        # Geometric, not arithmetic, mean: a score against top-k target distributions
        # misses the overlap outside the top k, so it is roughly the exact α times the
        # request's captured fraction, a factor shared by every draft on that request. In
        # log space that factor adds the same term to every draft and drops out of the
        # comparison; an arithmetic mean would let requests whose targets are peaked (more
        # mass captured) outweigh the rest.
        logy = torch.log(torch.nan_to_num(y).clamp_min(_ALPHA_FLOOR))
        mean = (cfg.prior_weight * prior + (wk * logy).sum(0)) / (cfg.prior_weight + total)
        return mean.exp(), seen.sum(0).float()

    def choose(self, x: torch.Tensor) -> int:
        with self._lock:
            score, support = self._predict(x)
            if self.config.feedback == "bandit":
                score = score + self.config.explore / torch.sqrt(1.0 + support)
            choice = int(torch.argmax(score))
            self.choices[choice] += 1
            return choice

    def _remember(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with self._lock:
            slot = self._count % self.config.memory
            self._x[slot] = x
            self._y[slot] = y
            self._count += 1

    def update(self, x: torch.Tensor, draft: int, alpha: float) -> None:
        """Learn that ``draft`` achieved acceptance ``alpha`` on a request with features x."""
        y = torch.full((self.num_drafts,), float("nan"))
        y[draft] = float(alpha)
        self._remember(x, y)

    def update_all(self, x: torch.Tensor, alphas) -> None:
        """Full-information update: the α every draft would have had on this request."""
        self._remember(x, torch.tensor([float("nan") if a is None else float(a) for a in alphas]))

    def state_dict(self) -> dict:
        return {
            "x": self._x.clone(),
            "y": self._y.clone(),
            "count": self._count,
            "choices": list(self.choices),
        }

    def load_state_dict(self, state: dict) -> None:
        self._x = state["x"].clone()
        self._y = state["y"].clone()
        self._count = int(state["count"])
        self.choices = list(state["choices"])
