"""The step's adaptive policies: how long a row's chain runs (:class:`AdaptiveStopper`,
``SpecConfig.adaptive``) and how long each step's chains are (:class:`DraftLengthController`,
``SpecConfig.auto_k``)."""

from __future__ import annotations

import collections

import torch


class AdaptiveStopper:
    """Adaptive draft length: a row stops drafting when the next token is unlikely to be
    accepted together with every draft before it.

    Confidence is the draft's probability of the token it proposes. Acceptance is
    calibrated per confidence bin from the verdicts seen so far (a position counts as
    tested when every earlier draft of its step was accepted), with a prior that trusts
    confidences above ``init_threshold``. Each drafted token multiplies a running product
    by its bin's calibrated P(accept | confidence) plus an exploration bonus
    ``EXPLORE / sqrt(tested + prior weight)`` (capped at 1), which shrinks as the bin is
    tested; a row keeps drafting while the product, its estimated chance of getting this
    far, is at least ``floor``. Without the bonus a bin whose prior is below the floor would
    never be drafted, hence never tested: a draft that is accepted more often than its
    confidence suggests would be stopped for good.
    """

    BINS = 10
    PRIOR_WEIGHT = 4.0
    EXPLORE = 0.7

    def __init__(self, floor: float, init_threshold: float):
        self.floor = floor
        centers = (torch.arange(self.BINS, dtype=torch.float64) + 0.5) / self.BINS
        self.prior = (centers >= init_threshold).double()
        self.tested = torch.zeros(self.BINS, dtype=torch.float64)
        self.accepted = torch.zeros(self.BINS, dtype=torch.float64)
        self._conf: list[torch.Tensor] = []
        self._reach = torch.ones(0, dtype=torch.float64)  # [B] running product of scores

    def _bin(self, conf: torch.Tensor) -> torch.Tensor:
        # Deliberate host sync (adaptive mode only): the calibration table is on the host.
        return (conf.double() * self.BINS).long().clamp(0, self.BINS - 1).cpu()

    def rates(self) -> torch.Tensor:
        """Calibrated P(accept) per confidence bin."""
        w = self.PRIOR_WEIGHT
        return (self.accepted + w * self.prior) / (self.tested + w)

    def scores(self) -> torch.Tensor:
        """:meth:`rates` plus the exploration bonus: what ``floor`` is compared with."""
        return self.rates() + self.EXPLORE / (self.tested + self.PRIOR_WEIGHT).sqrt()

    def keep_going(self, logits, tokens, q, active):
        probs = q if q is not None else torch.softmax(logits.float(), -1)
        conf = probs.gather(1, tokens[:, None])[:, 0]
        if active is None:
            self._conf = []
            self._reach = torch.ones(conf.shape[0], dtype=torch.float64)
        self._conf.append(conf)
        self._reach = self._reach * self.scores().clamp(max=1.0)[self._bin(conf)]
        go = (self._reach >= self.floor).to(conf.device)
        return go if active is None else active & go

    def observe(self, num_drafted: list[int], num_accepted: list[int]) -> None:
        """Learn from one step's verdicts (host lists, already synced)."""
        if not self._conf:
            return
        conf = torch.stack(self._conf, 1).cpu()  # [B, steps drafted]
        for b, (d, a) in enumerate(zip(num_drafted, num_accepted)):
            for i in range(min(d, a + 1)):  # positions 0..a were tested
                j = int(self._bin(conf[b, i]))
                self.tested[j] += 1
                self.accepted[j] += float(i < a)
        self._conf = []


class DraftLengthController:
    """Chooses each step's chain length from measured goodput, per batch-size bucket.

    The arms are a few chain lengths from 0 (no draft model: prompt lookup alone where
    lookup is in front of it, else plain decoding through the verify path) to
    ``k_max``. An arm's goodput is the tokens a step emitted per second of its wall time
    (which includes the step's host sync, so it is device time on a GPU), summed over its
    newest ``window`` measured steps, per batch bucket (1, 2, 4, ...). Steps take the best
    arm; a probe runs another arm for ``probe_steps`` steps in a row (adding to its window,
    or starting it afresh when the arm went unmeasured for ``4 * window`` steps), and at
    its end the probed arm becomes the best if its goodput is more than ``margin`` above
    the best's: a switch costs a draft model's catching up, and one lucky probe should not
    move the steps. A winning probe whose window it started afresh goes on, ``probe_steps``
    at a time, until that window holds ``window`` steps, and decides then.
    With ``zero_apart`` arm 0 is another drafter (prompt lookup alone in front of a draft
    model), not the shortest chain: goodput is unimodal over the chains only, so arm 0 is
    a neighbour of every arm (a best chain of 3 is compared with lookup alone directly,
    not through chains of 2 and 1 each won in turn), and it is the best arm until a chain
    wins a probe.

    Probes re-measure the best arm's neighbour (the next shorter or longer chain)
    measured longest ago, so that a change in acceptance or in cost is noticed: goodput
    is unimodal in the chain length, so the best arm moves one neighbour at a time, and a
    neighbour costs less to try than the longest chain. They start ``explore_every``
    steps apart; each that leaves the best arm as it was doubles the spacing, up to
    ``explore_max`` (default ``32 * explore_every``), and one that changes it resets the
    spacing: where one arm clearly wins (plain decoding against a useless draft) the
    slower arms cost little. When the best arm's own goodput falls more than ``margin``
    below another arm's (the text or the machine's load changed since that one was
    measured), that arm is probed afresh before anything moves (its old window would
    otherwise keep drawing probes while the text it was measured on is gone). The first
    step of a probe is not
    measured: a step of another arm than the step before pays for the switch (a draft
    model fed the tokens it did not draft), which the arm in steady use does not; nor is
    an arm's first step in a bucket, which pays one-time costs (CUDA graph capture,
    allocator growth).
    """

    def __init__(
        self,
        k_max: int,
        explore_every: int = 16,
        window: int = 32,
        explore_max: int | None = None,
        probe_steps: int = 4,
        margin: float = 0.1,
        zero_apart: bool = False,
    ):
        self.arms = sorted({k for k in (k_max, 0, 1, 2, k_max // 2) if 0 <= k <= k_max})
        self.zero_apart = zero_apart
        self.explore_every = explore_every
        self.explore_max = explore_max or 32 * explore_every
        self.window = window
        self.probe_steps = probe_steps
        self.margin = margin
        self.goodput: dict[int, dict[int, float]] = {}  # bucket -> arm -> tokens/s
        # bucket -> arm -> [its newest measured steps' (tokens, seconds), their tokens,
        # their seconds]
        self._recent: dict[int, dict[int, list]] = {}
        self._seen: dict[int, dict[int, int]] = {}  # bucket -> arm -> measurements
        self._when: dict[int, dict[int, int]] = {}  # bucket -> arm -> last step
        self._steps: dict[int, int] = {}
        self._spacing: dict[int, int] = {}  # bucket -> steps between explorations
        self._explored: dict[int, int] = {}  # bucket -> step the last probe started
        self._run: dict[int, tuple[int, int]] = {}  # bucket -> (arm probed, steps left)
        self._fresh: dict[int, int] = {}  # bucket -> the probed arm whose window restarts
        self._last: dict[int, int] = {}  # bucket -> the previous step's arm
        self._best: dict[int, int] = {}  # bucket -> the arm exploiting steps take
        self.chosen: dict[int, dict[int, int]] = {}  # bucket -> arm -> steps

    @staticmethod
    def bucket(B: int) -> int:
        return 1 << (B - 1).bit_length()

    def _start_probe(self, b: int, k: int, step: int, afresh: bool = False) -> int:
        self._explored[b] = step
        self._run[b] = (k, self.probe_steps - 1)
        # an arm measured within the last few windows' steps adds to its window; one
        # measured longer ago (or whose old window is in question) starts it afresh
        if afresh or step - self._when.get(b, {}).get(k, -step) > 4 * self.window:
            self._fresh[b] = k
        else:
            self._fresh.pop(b, None)
        return k

    def choose(self, B: int) -> int:
        b = self.bucket(B)
        good = self.goodput.setdefault(b, {})
        step = self._steps[b] = self._steps.get(b, 0) + 1
        untried = [k for k in reversed(self.arms) if k not in good]
        run = self._run.get(b)
        if run is not None and run[1] > 0:  # a probe's next step
            k = run[0]
            self._run[b] = (k, run[1] - 1)
        elif untried:
            k = self._start_probe(b, untried[0], step)
        else:
            # lookup alone (zero_apart) starts as the best: it costs nothing to start with
            # (the model is not even fed), and a chain takes its place by a probe's win
            # held over a whole window, where the first few steps of each arm decide
            # nothing reliable
            best = self._best.setdefault(b, 0 if self.zero_apart else max(good, key=good.get))
            top = max(good, key=good.get)
            if good[top] > (1 + self.margin) * good[best]:
                # the best arm's goodput fell below another's measured earlier (the text
                # or the machine's load changed): measure that one again, afresh (its
                # window is from other text), before moving
                k = self._start_probe(b, top, step, afresh=True)
            elif step - self._explored[b] >= self._spacing.setdefault(b, self.explore_every):
                when, i = self._when[b], self.arms.index(best)
                near = self.arms[max(0, i - 1) : i] + self.arms[i + 1 : i + 2]
                if self.zero_apart and 0 not in near and best != 0:
                    near.append(0)
                k = min(near, key=lambda a: when.get(a, -1))
                self._start_probe(b, k, step)
            else:
                k = best
        counts = self.chosen.setdefault(b, {})
        counts[k] = counts.get(k, 0) + 1
        return k

    def observe(self, B: int, k: int, tokens: int, seconds: float) -> None:
        b = self.bucket(B)
        seen = self._seen.setdefault(b, {})
        seen[k] = seen.get(k, 0) + 1
        self._when.setdefault(b, {})[k] = self._steps.get(b, 0)
        good = self.goodput.setdefault(b, {})
        # A step of another arm than the step before pays for the switch (a draft model
        # fed the tokens it did not draft while lookup or plain steps ran), which an arm
        # in use does not: only its later steps measure it.
        switched = self._last.get(b, k) != k
        self._last[b] = k
        if not switched and seen[k] > 1 and seconds > 0:
            # Goodput over the arm's newest measured steps, tokens summed apart from
            # seconds: one step that emits many tokens (a long lookup match) or pays a
            # periodic cost (a draft catching up) moves it by its share of the window, not
            # by its own tokens/s. A probe of an arm unmeasured for long measures it
            # afresh, so that the arms are compared as they are now.
            recent = self._recent.setdefault(b, {})
            if k not in recent or self._fresh.get(b) == k:
                recent[k] = [collections.deque(), 0.0, 0.0]  # steps, their tokens, seconds
                self._fresh.pop(b, None)
            steps = recent[k]
            steps[0].append((tokens, seconds))
            steps[1] += tokens
            steps[2] += seconds
            if len(steps[0]) > self.window:  # running sums: no pass over the window a step
                t_old, s_old = steps[0].popleft()
                steps[1] -= t_old
                steps[2] -= s_old
            good[k] = steps[1] / steps[2]
        run = self._run.get(b)
        if run is None or run[0] != k or run[1] > 0:
            return  # no probe, or it goes on
        del self._run[b]  # the probe's verdict
        best = self._best.get(b)
        if best is None or best == k or k not in good:
            return
        if good[k] > (1 + self.margin) * good.get(best, 0.0):
            if len(self._recent[b][k][0]) < self.window:
                # a window started afresh by this probe: a few steps win by chance often
                # enough (a shared machine; lookup's heavy-tailed steps, most emitting one
                # token, make a few of them read low) that the win must hold over a
                # whole window before the steps move (a true win costs nothing meanwhile)
                self._run[b] = (k, self.probe_steps)
                return
            self._best[b] = k
            self._spacing[b] = self.explore_every
        else:
            self._spacing[b] = min(2 * self._spacing.get(b, self.explore_every), self.explore_max)

    def summary(self) -> dict:
        """Per batch bucket: goodput (tokens/s) per arm and how often each arm ran."""
        return {
            b: {
                "goodput": {k: round(v, 2) for k, v in sorted(self.goodput[b].items())},
                "steps": dict(sorted(self.chosen.get(b, {}).items())),
            }
            for b in sorted(self.goodput)
        }
