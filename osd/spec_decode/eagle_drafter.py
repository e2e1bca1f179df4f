"""The EAGLE drafter: chains and trees drafted from the target's features."""

from __future__ import annotations

import torch

from osd.graphs import StepGraphs
from osd.models.llama import DecoderLM
from osd.spec_decode.model_drafter import Emitted, ModelDrafter, mask_with_roots


class EagleDrafter(ModelDrafter):
    """An EAGLE draft (:class:`~osd.models.eagle.EagleLM`): chains drafted from the target's
    features.

    Draft position ``j`` of a row holds ``(f_j, x_{j+1})``: the target's feature at
    position ``j`` and the token after it. The row's cache holds the committed pairs; the
    pending pairs are the tokens emitted since (accepted drafts, the new root) with the
    target features the verify forward produced just before each of them, so that
    ``lens + pending = target lens``. In the chain loop the draft feeds back its own
    predicted feature. The verify forward's features replace the predicted ones at the next
    step, so drafting errors never accumulate across steps. Trees (static or dynamic) feed
    every node the feature predicted at its parent, with the tree's ancestor mask; after
    a tree step the features arrive along the accepted path. The draft loop runs eagerly
    (no CUDA graph).
    """

    needs_hidden = True

    def __init__(
        self, model: DecoderLM, max_batch_size: int, capacity: int, context: int | None = None
    ):
        super().__init__(model, max_batch_size, capacity, context=context)
        self._pending_feat = torch.zeros(
            max_batch_size,
            self._pending.shape[1],
            model.config.hidden_size,
            dtype=model.dtype,
            device=self.device,
        )
        self._feat: torch.Tensor | None = None  # [B, 1, H] the last predicted feature
        # [B, n, H] the feature predicted at tree node j < n (the root's after _root)
        self._tree_feat: torch.Tensor | None = None

    def use_graphs(self, graphs: StepGraphs | None) -> None:
        self.graphs = None

    def _forward_nodes(self, tokens, parents, depths, upto: int, at: torch.Tensor):
        """As :meth:`ModelDrafter._forward_nodes`, each node reading the feature predicted
        at its parent (parents come before their children, so every parent ``< upto - 1``
        was fed by the level before); the features of nodes ``1..upto-1`` are kept."""
        par = parents[:, 1:upto].long()
        H = self._tree_feat.shape[-1]
        feats = self._tree_feat.gather(1, par[..., None].expand(-1, -1, H))
        mask = mask_with_roots(parents[:, 1:upto] - 1)
        logits, g = self.model(
            tokens[:, 1:upto],
            self.cache,
            tree_mask=mask,
            depths=depths[:, 1:upto] - 1,
            features=feats,
            logits_index=at - 1,
            return_hidden=True,
        )
        self._tree_feat = torch.cat([self._tree_feat[:, :1], g], 1)
        return logits

    @staticmethod
    def _need(hidden):
        if hidden is None:
            raise ValueError("an EAGLE drafter needs the target's features (hidden=...)")
        return hidden

    def prefill(
        self, prompts: list[list[int]], start_row: int, first_tokens: torch.Tensor, hidden=None
    ) -> None:
        """Rows ``start_row ..`` get the pairs ``(f_j, prompt[j + 1])``; the pair of the last
        prompt feature and ``first_tokens [n]`` becomes pending. ``hidden [n, T, H]``: the
        target's features at the prompts' positions."""
        hidden = self._need(hidden)
        n = len(prompts)
        dev = self.device
        lens = [len(p) - 1 for p in prompts]
        longest = max(lens)
        rows = self.cache.rows(start_row, n)
        rows.reset()
        if longest > 0:
            ids = torch.zeros(n, longest, dtype=torch.int64)
            for b, p in enumerate(prompts):
                ids[b, : lens[b]] = torch.tensor(p[1:], dtype=torch.int64)
            zero = torch.zeros(n, 1, dtype=torch.int64, device=dev)
            self.model.prefill(
                ids.to(dev),
                rows,
                torch.tensor(lens, dtype=torch.int32, device=dev),
                features=hidden[:, :longest],
                logits_index=zero,
            )
            self.cache.set_bound(max(self.cache.bound, longest))
        last = torch.tensor(lens, dtype=torch.int64, device=dev)
        self._pending[start_row : start_row + n, 0] = first_tokens
        self._pending_feat[start_row : start_row + n, 0] = hidden[torch.arange(n, device=dev), last]
        self._pending_len[start_row : start_row + n] = 1
        self._pending_max = max(self._pending_max, 1)

    def move_row(self, src: int, dst: int) -> None:
        super().move_row(src, dst)
        self._pending_feat[dst] = self._pending_feat[src]

    def after_verify(self, emitted: Emitted, committed_lens: torch.Tensor, bound: int) -> None:
        """Token ``j`` emitted by the step pairs with the verify forward's feature ``j``
        (the target's state just before it); the draft keeps the pairs up to the old root."""
        e = emitted
        self.set_pending(
            e.B, e.tokens, e.lengths, e.max_len, committed_lens - 1, bound, self._need(e.hidden)
        )

    def catch_up(self, emitted: Emitted) -> None:
        e = emitted
        self.queue(e.B, e.tokens, e.lengths, e.max_len, self._need(e.hidden))

    def _root(self, B: int) -> torch.Tensor:
        P = self._pending_max
        last = self._pending_len[:B] - 1
        logits, g = self.model(
            self._pending[:B, :P],
            self.cache,
            features=self._pending_feat[:B, :P],
            logits_index=last[:, None],
            return_hidden=True,
        )
        self.cache.commit(self._pending_len[:B].to(torch.int32), P)
        self._feat = g.gather(1, last[:, None, None].expand(-1, 1, g.shape[-1]))
        self._tree_feat = self._feat  # a tree's nodes extend it level by level
        return logits[:, 0]

    def _advance(self, x: torch.Tensor, B: int) -> torch.Tensor:
        logits, g = self.model(x[:, None], self.cache, features=self._feat, return_hidden=True)
        self.cache.commit(self._one[:B], 1)
        self._feat = g
        return logits[:, 0]
