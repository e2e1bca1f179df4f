"""``PrefixCache``: the target's prompt K/V kept across requests, reused by later prompts
that start with the same tokens (a shared system prompt, the earlier turns of a chat).

    >>> pc = PrefixCache(capacity_tokens=8192)
    >>> n, _ = pc.load(prompt, limit, cache.kv[:, :, row])  # K/V of prompt[:n] now in the row
    >>> pc.store(prompt, cache.kv[:, :, row])               # after the row's prefill

Prompts are cut into blocks of ``block`` tokens; a block is kept under the block before it
(a trie keyed by the blocks' exact tokens, so a match is exact, never a hash). Only whole
blocks are kept and reused. A block's K/V depend on every token before it, which the trie
path fixes, and on nothing else: causal attention, and the positions are the block's own.
Reused K/V equal a fresh prefill's up to rounding (the same computation in other pieces),
as a staged prompt's do.

A block may also keep the target's features (its last hidden states, ``[block, H]``) at
its positions, which an EAGLE draft drafts from: a lookup that needs them follows only
blocks that have them, and a later store with features adds them to blocks without.

Memory: ``L * 2 * H_kv * D`` values of the cache's dtype per kept token (plus ``H`` with
features). Past ``capacity_tokens`` the least recently used blocks go, each with the
blocks below it.
"""

from __future__ import annotations

import collections

import torch


class _Block:
    __slots__ = ("tokens", "parent", "children", "kv", "hidden")

    def __init__(self, tokens: tuple, parent, kv: torch.Tensor | None):
        self.tokens = tokens
        self.parent = parent
        self.children: dict[tuple, _Block] = {}
        self.kv = kv  # [L, 2, H_kv, block, D]; None for the root
        self.hidden: torch.Tensor | None = None  # [block, H] target features, if kept


class PrefixCache:
    """Whole blocks of prompt K/V, least recently used out first.

    Args:
        capacity_tokens: most prompt tokens kept (rounded down to whole blocks), >= block.
        block: tokens per block.
    """

    def __init__(self, capacity_tokens: int, block: int = 16) -> None:
        if block < 1:
            raise ValueError(f"PrefixCache block must be >= 1, got {block}")
        if capacity_tokens < block:
            raise ValueError(
                f"PrefixCache capacity_tokens must be >= its block ({block}), got {capacity_tokens}"
            )
        self.block = int(block)
        self.capacity_blocks = int(capacity_tokens) // self.block
        self._root = _Block((), None, None)
        self._lru: collections.OrderedDict[int, _Block] = collections.OrderedDict()
        self.tokens_reused = 0  # prompt tokens whose K/V came from here
        self.tokens_looked_up = 0  # prompt tokens of every lookup

    def __len__(self) -> int:
        """Blocks kept."""
        return len(self._lru)

    @property
    def num_tokens(self) -> int:
        return len(self._lru) * self.block

    def _path(self, prompt: list[int], limit: int, need_hidden: bool = False) -> list[_Block]:
        """The kept blocks that start ``prompt[:limit]``, in order (with ``need_hidden``,
        up to the first block without features)."""
        out, node, B = [], self._root, self.block
        for start in range(0, limit - B + 1, B):
            node = node.children.get(tuple(prompt[start : start + B]))
            if node is None or (need_hidden and node.hidden is None):
                break
            out.append(node)
        return out

    def _touch(self, path: list[_Block]) -> None:
        for node in path:  # parents before children: a child is newer
            self._lru.move_to_end(id(node))

    def load(
        self, prompt: list[int], limit: int, dst: torch.Tensor, need_hidden: bool = False
    ) -> tuple[int, torch.Tensor | None]:
        """Copy the K/V of the longest kept prefix of ``prompt[:limit]`` into ``dst``.

        Args:
            prompt: token ids.
            limit: most tokens to reuse (the caller leaves the tokens it must feed).
            dst: ``[L, 2, H_kv, S, D]``, one row of a cache; slots ``0 .. n - 1`` written.
            need_hidden: reuse only blocks that kept the target's features.

        Returns:
            ``(n, hidden)``: the tokens reused (a multiple of ``block``, 0 when nothing
            matched) and, with ``need_hidden`` and ``n > 0``, their features ``[n, H]``
            (else None).
        """
        self.tokens_looked_up += len(prompt)
        path = self._path(prompt, limit, need_hidden)
        if not path:
            return 0, None
        self._touch(path)
        n = len(path) * self.block
        dst[:, :, :, :n].copy_(torch.cat([node.kv for node in path], dim=3))
        self.tokens_reused += n
        return n, torch.cat([node.hidden for node in path]) if need_hidden else None

    def store(
        self, prompt: list[int], src: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> None:
        """Keep the whole blocks of ``prompt`` from ``src`` (``[L, 2, H_kv, S, D]``, one row
        of a cache holding the prompt's K/V in slots ``0 .. len(prompt) - 1``) and, given
        ``hidden`` (``[>= len(prompt), H]``), the target's features at those positions."""
        B = self.block
        path = self._path(prompt, len(prompt))
        node = path[-1] if path else self._root
        self._touch(path)
        if hidden is not None:
            for i, block in enumerate(path):
                if block.hidden is None:
                    block.hidden = hidden[i * B : (i + 1) * B].clone()
        for start in range(len(path) * B, len(prompt) - B + 1, B):
            if len(self._lru) >= self.capacity_blocks:
                self._evict(keep=node)
                if len(self._lru) >= self.capacity_blocks:
                    return  # everything kept lies on this prompt's path
            tokens = tuple(prompt[start : start + B])
            child = _Block(tokens, node, src[:, :, :, start : start + B].clone())
            if hidden is not None:
                child.hidden = hidden[start : start + B].clone()
            node.children[tokens] = child
            self._lru[id(child)] = child
            node = child

    def _evict(self, keep: _Block) -> None:
        """Drop the least recently used block not on ``keep``'s path, with its subtree."""
        on_path = set()
        n = keep
        while n is not None:
            on_path.add(id(n))
            n = n.parent
        for key, node in self._lru.items():
            if key not in on_path:
                break
        else:
            return
        del node.parent.children[node.tokens]
        stack = [node]
        while stack:
            n = stack.pop()
            self._lru.pop(id(n), None)
            stack.extend(n.children.values())

    def stats(self) -> dict:
        return {
            "blocks": len(self._lru),
            "tokens": self.num_tokens,
            "capacity_tokens": self.capacity_blocks * self.block,
            "tokens_reused": self.tokens_reused,
            "tokens_looked_up": self.tokens_looked_up,
            "reuse_rate": self.tokens_reused / max(self.tokens_looked_up, 1),
        }
