"""What the learner hears from serving: a listener on one speculator's steps.

:class:`TeacherCollector` keeps, per request, the target's distributions that decided
its tokens (compressed to top-k, ``osd.online.buffer.compress_target``): at prompt
positions from the prefill's logits, and at every verified position (or only the
corrected ones, OSD's policy) from each step's verdict. Nothing is recomputed later.
Before each step it lets the learner swap in the newest accepted weights, so a swap
never lands inside a step.

For an EAGLE draft (whose drafter ``needs_hidden``) it also keeps the target's features
at every position the target read (the prompt, then each step's root and accepted drafts),
the draft's inputs when it trains.
"""

from __future__ import annotations

import torch

from osd.online.buffer import compress_target


class TeacherCollector:
    """Listener of a ``osd.spec_decode.step.Speculator`` for online learning.

    Args:
        topk: target probabilities kept per position (None: full logits).
        positions: ``"all"`` verified positions or ``"corrected"`` (the rejected one).
        prompt_positions: keep the prefill's logits at each prompt's last n positions.
        swap: called before every step (the learner publishes new weights there).
        training: returns whether a learner trains beside serving now (``loaded``).
    """

    def __init__(
        self, topk: int | None, positions: str, prompt_positions: int, swap=None, training=None
    ):
        self.topk = topk
        self.policy = positions
        self.prompt_positions = prompt_positions
        self.swap = swap
        self.training = training

    def loaded(self) -> bool:
        """True while the learner's training shares the machine with serving: steps then
        run slower whatever they draft (``Speculator`` measures ``auto_k``'s arms apart)."""
        return self.training is not None and self.training()

    def before_step(self) -> None:
        if self.swap is not None:
            self.swap()

    def on_prefill(
        self,
        requests,
        prompt_logits: torch.Tensor | None,
        prompt_hidden: torch.Tensor | None = None,
    ) -> None:
        """``prompt_logits [n, m, V]``: the target's logits at each prompt's last ``m``
        positions (a shorter prompt's row starts with copies), the requests' first
        teacher positions ``len(prompt) - m + 1 .. len(prompt)``. ``prompt_hidden
        [n, T, H]``: the target's features at the prompts' positions (EAGLE), or None."""
        for b, r in enumerate(requests):
            r.teacher = []  # (positions [m], topk ids, topk probs | logits)
            # [positions, H] float16 pieces covering positions 0, 1, ... in order
            r.features = (
                None
                if prompt_hidden is None
                else [prompt_hidden[b, : len(r.prompt)].detach().to("cpu", torch.float16)]
            )
        if prompt_logits is None:
            return
        m = prompt_logits.shape[1]
        keep = [min(m, len(r.prompt)) for r in requests]  # rows without the copies
        self._keep(
            [
                (r, torch.arange(len(r.prompt) - j + 1, len(r.prompt) + 1))
                for r, j in zip(requests, keep)
            ],
            [prompt_logits[b, m - j :] for b, j in enumerate(keep)],
        )

    def on_verdict(self, v) -> None:
        """Keep the target's distributions at the positions ``v`` (a ``Verdict``)
        decided: nodes ``0 .. accepted`` of each row's accepted path."""
        rows, where = [], []
        path_host = v.path.tolist() if v.path is not None else None
        feats = None if v.hidden is None else v.hidden.detach().to("cpu", torch.float16)
        for b, r in enumerate(v.active):
            if r.finish_reason == "error":
                continue
            n = v.accepted[b]
            if feats is not None and getattr(r, "features", None) is not None:
                r.features.append(feats[b, : n + 1])  # the root and the accepted drafts
            idx = (
                ([n] if n < v.drafted[b] else [])
                if self.policy == "corrected"
                else list(range(n + 1))
            )
            if not idx:
                continue
            base = r.length - v.emitted[b]  # position of the step's first token
            if path_host is not None:  # a tree: the accepted path's nodes
                rows.append(v.logits[b, [path_host[b][j] for j in idx]])
            else:  # a chain: nodes idx[0] .. idx[-1], consecutive (a view)
                rows.append(v.logits[b, idx[0] : idx[-1] + 1])
            where.append((r, torch.arange(base + idx[0], base + idx[-1] + 1)))
        self._keep(where, rows)

    def _keep(self, where, rows) -> None:
        """Append the distributions ``rows`` (``[m_i, V]`` logits each) to the teacher
        lists of the requests in ``where`` (``(request, positions [m_i])``)."""
        if not rows:
            return
        # On the serving thread: on a CPU a row costs the two passes of the native
        # topk_probs kernel, where a thread beside serving would contend with it for the
        # interpreter lock and the cores at every step. Full logits are copied (torch.cat):
        # the verify logits' buffer is not ours to keep.
        keep_view = len(rows) == 1 and self.topk is not None
        logits = rows[0] if keep_view else torch.cat(rows)
        ids, probs, full = compress_target(logits, self.topk)
        start = 0
        for r, pos in where:
            m = pos.numel()
            sl = slice(start, start + m)
            r.teacher.append(
                (
                    pos,
                    None if ids is None else ids[sl],
                    None if probs is None else probs[sl],
                    None if full is None else full[sl],
                )
            )
            start += m
