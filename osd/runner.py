"""The model-running half of :class:`~osd.Engine`: prefill and plain decode steps.

:class:`ModelRunner` turns a lane's requests into target forwards and sampled tokens: the
prefill of new rows (ragged prompts padded to the longest, first token sampled with each
request's own parameters) and one plain decode step of the running rows. The scheduling
half (lanes, admission, retirement, statistics) is :class:`~osd.Engine` itself, which
provides ``model``, ``device``, ``graphs``, ``lanes``, ``max_seq_len``, ``plain_stats``
and ``_ones``.
"""

from __future__ import annotations

import time

import torch

from osd.graphs import graphed_forward
from osd.lanes import Lane
from osd.penalties import Penalties, wants_penalties
from osd.request import RequestState
from osd.sampling import (
    BatchParams,
    fail_rows,
    greedy_nonfinite,
    nonfinite_rows,
    record_logprobs,
    sample_tokens,
)


class ModelRunner:
    """Prefill and plain decode steps of an engine's lanes (a mixin of ``Engine``)."""

    def prefill(
        self,
        new: list[RequestState],
        start_row: int,
        prompt_positions: int = 0,
        lane: Lane | None = None,
        done: list[int] | None = None,
        early_hidden: list | None = None,
    ):
        """Run the prompts of ``new`` into cache rows ``start_row ..`` of ``lane`` (default
        the first) and sample each one's first token with its own parameters (a request
        that resumes, ``RequestState.context``, has its context fed instead and samples
        nothing: its last generated token is its next input). ``done[b]``
        tokens of prompt ``b`` are already in its row (a staged prompt); the rest are fed.
        ``prompt_positions = m > 0``: return the logits at each prompt's last ``m``
        positions ``[n, m, V]`` (oldest first; a shorter prompt's row starts with copies of
        its position 0), which online learning keeps; otherwise None.

        ``early_hidden`` (one entry per request: the ``[done[b], H]`` features of its staged
        pieces, or None) asks for the target's features at every prompt position too: the
        return value is then ``(logits or None, features [n, longest prompt, H])``."""
        lane = lane or self.lanes[0]
        t0 = time.perf_counter()
        done = done or [0] * len(new)
        rest = [r.prefill_ids[d:] for r, d in zip(new, done)]
        n, longest = len(new), max(len(x) for x in rest)
        ids = torch.zeros(n, longest, dtype=torch.int64)
        for b, x in enumerate(rest):
            ids[b, : len(x)] = torch.tensor(x)
        prompt_lens = torch.tensor([len(x) for x in rest], device=self.device)
        rows = lane.cache.rows(start_row, n)
        rows.reset()  # the view's bound: its own rows' longest
        if any(done):
            rows.lens.copy_(torch.tensor(done, dtype=torch.int32))
            rows.set_bound(max(done))
        m = min(prompt_positions, longest)
        width = max(m, 1)
        index = (prompt_lens[:, None] - width + torch.arange(width, device=self.device)).clamp(
            min=0
        )
        # In pieces of model.config.prefill_chunk tokens; commits rows.lens += prompt_lens.
        logits = self.model.prefill(
            ids.to(self.device),
            rows,
            prompt_lens,
            logits_index=index,  # [n, m or 1, V]
            return_hidden=early_hidden is not None,
        )
        if early_hidden is not None:
            logits, rest_hidden = logits
            hidden = rest_hidden.new_zeros(
                n, max(len(r.prefill_ids) for r in new), rest_hidden.shape[-1]
            )
            for b, (r, d) in enumerate(zip(new, done)):
                if d:
                    hidden[b, :d] = early_hidden[b]
                hidden[b, d : len(r.prefill_ids)] = rest_hidden[b, : len(r.prefill_ids) - d]
        lane.cache.set_bound(max(lane.cache.bound, max(len(r.prefill_ids) for r in new)))
        bad = nonfinite_rows(logits)
        last = logits[:, -1]
        if wants_penalties(new):
            last = Penalties(new, last.shape[-1], self.device).apply(last[:, None])[:, 0]
        tokens = sample_tokens(
            last, BatchParams([r.params for r in new], self.device), *self._sampling_keys(new)
        )
        resumed = [b for b, r in enumerate(new) if r.context is not None]
        if resumed:
            tokens[resumed] = torch.tensor(
                [new[b].generated[-1] for b in resumed], dtype=tokens.dtype, device=tokens.device
            )
        lane.next_tokens[start_row : start_row + n] = tokens
        self._record(new, tokens, bad, logits[:, -1], skip=frozenset(resumed))
        stats = self.plain_stats if lane.speculator is None else lane.speculator.stats
        stats.add_time("prefill", time.perf_counter() - t0)
        if early_hidden is not None:
            return (logits if m > 0 else None), hidden
        return logits if m > 0 else None

    def decode_step(
        self, active: list[RequestState], params: BatchParams, lane: Lane | None = None
    ) -> None:
        """One token for every active row of ``lane`` (default the first)."""
        lane = lane or self.lanes[0]
        B = len(active)
        t0 = time.perf_counter()
        ids = lane.next_tokens[:B, None]
        logits = (
            self.model(ids, lane.cache)
            if self.graphs is None
            else graphed_forward(self.graphs, self.model, lane.cache, ids)
        )
        lane.cache.commit(self._ones[:B], 1)
        t1 = time.perf_counter()
        if params.greedy and not wants_penalties(active):
            tokens, bad = greedy_nonfinite(logits[:, 0])  # one pass over the logits
        else:
            bad = nonfinite_rows(logits)
            step = (
                Penalties(active, logits.shape[-1], self.device).apply(logits)
                if wants_penalties(active)
                else logits
            )
            # greedy rows draw nothing: sample_tokens takes the argmax without Philox keys
            keys = (None, None) if params.greedy else self._sampling_keys(active)
            tokens = sample_tokens(step[:, 0], params, *keys)
        lane.next_tokens[:B] = tokens
        self._record(active, tokens, bad, logits[:, 0])
        # The forward counts as "verify" (a one-token verify): the target's forward time.
        st = self.plain_stats
        st.target_forwards += 1
        st.sequence_steps += B
        st.generated_tokens += B
        st.add_time("verify", t1 - t0)
        st.add_time("sample", time.perf_counter() - t1)

    def _sampling_keys(self, requests: list[RequestState]) -> tuple[torch.Tensor, torch.Tensor]:
        """Philox ``(seeds, offsets)`` ``[B]`` of the plain sampler for ``requests``: the
        offset of a draw is the number of tokens the request generated before it."""
        keys = torch.tensor(
            [[r.seed for r in requests], [len(r.generated) for r in requests]], dtype=torch.int64
        ).to(self.device, non_blocking=True)
        return keys[0], keys[1]

    def _record(
        self,
        requests: list[RequestState],
        tokens: torch.Tensor,
        bad: torch.Tensor,
        logits: torch.Tensor,
        skip: frozenset = frozenset(),
    ) -> None:
        """Fail the rows whose logits were not finite (``bad [B]``, :func:`nonfinite_rows`)
        and append every other row's sampled token (``tokens [B]``, drawn from ``logits
        [B, V]``), except the rows in ``skip`` (resumed: nothing was drawn for them)."""
        # The one host sync per step, after every kernel of the step is queued: the stop
        # check (EOS, stop ids, lengths) needs the sampled ids on the host, and
        # Output.token_ids collects them there anyway.
        ids, flags = torch.stack([tokens, bad.to(tokens.dtype)]).tolist()
        fail_rows(requests, flags)
        rows = []
        for b, (r, t) in enumerate(zip(requests, ids)):
            if r.finish_reason is None and b not in skip:
                r.append(t, self.max_seq_len)
                if r.logprobs is not None:
                    rows.append((b, b, t))
        record_logprobs(requests, logits, rows)
