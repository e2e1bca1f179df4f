"""Token-tree shapes for tree speculation.

A tree of ``T`` nodes is described per row by ``parents [T]`` (node 0 is the root, the
last committed token, with parent -1; ``parents[i] < i``). From it follow

- ``depths [T]``: root 0, child = parent + 1 (RoPE position offset of each node);
- ``tree_mask [T]`` int64 bitmask: bit ``j`` of row ``i`` is set iff ``j`` is ``i`` or an
  ancestor of ``i`` (what the verify forward lets node ``i`` attend to).

A *static* tree is given as child-rank paths, e.g. ``[(0,), (1,), (0, 0), (0, 1)]``: the
root's best and second-best children, then the best two children of the best child.
"Rank r" means the r-th most likely token under the draft at the parent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from osd_kernels.tree_attention import causal_tree_mask  # noqa: F401  (chain mask)

MAX_TREE_NODES = 64  # one int64 bitmask row per node


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree topology built from child-rank paths (root excluded)."""

    parents: tuple[int, ...]  # [T], parents[0] = -1
    ranks: tuple[int, ...]  # [T], child rank of each node under its parent (root: -1)
    depths: tuple[int, ...]  # [T]

    @staticmethod
    def from_paths(paths) -> "StaticTree":
        """Build from child-rank paths; every prefix of a path must also be a path."""
        norm = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if any(len(p) == 0 for p in norm):
            raise ValueError("tree paths must be non-empty (the root is implicit)")
        index = {(): 0}
        parents, ranks, depths = [-1], [-1], [0]
        for p in norm:
            if p[:-1] not in index:
                raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
            if p[-1] < 0:
                raise ValueError(f"tree path {list(p)} has a negative rank")
            index[p] = len(parents)
            parents.append(index[p[:-1]])
            ranks.append(p[-1])
            depths.append(len(p))
        if len(parents) > MAX_TREE_NODES:
            raise ValueError(
                f"a tree has at most {MAX_TREE_NODES} nodes (root included), got {len(parents)}"
            )
        return StaticTree(tuple(parents), tuple(ranks), tuple(depths))

    @staticmethod
    def chain(k: int) -> "StaticTree":
        return StaticTree.from_paths([(0,) * d for d in range(1, k + 1)])

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def levels(self) -> list[list[int]]:
        """Node indices grouped by depth (level 0 is the root)."""
        out = [[] for _ in range(self.max_depth + 1)]
        for i, d in enumerate(self.depths):
            out[d].append(i)
        return out


def depths_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """``parents [B, T]`` int -> ``depths [B, T]`` int64 (parents precede children)."""
    depths = torch.zeros(parents.shape, dtype=torch.int64, device=parents.device)
    par = parents.to(torch.int64)
    for i in range(1, parents.shape[-1]):
        depths[..., i] = depths.gather(-1, par[..., i : i + 1].clamp(min=0))[..., 0] + 1
    return depths


def mask_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """``parents [B, T]`` -> ``tree_mask [B, T]`` int64: bit j of row i = j is i or an ancestor."""
    T = parents.shape[-1]
    if T > MAX_TREE_NODES:
        raise ValueError(f"a tree has at most {MAX_TREE_NODES} nodes, got {T}")
    mask = torch.zeros(parents.shape, dtype=torch.int64, device=parents.device)
    par = parents.to(torch.int64)
    one = torch.ones((), dtype=torch.int64, device=parents.device)
    for i in range(T):
        own = torch.bitwise_left_shift(one, i)
        if i == 0:
            mask[..., 0] = own
        else:
            mask[..., i] = mask.gather(-1, par[..., i : i + 1].clamp(min=0))[..., 0] | own
    return mask
