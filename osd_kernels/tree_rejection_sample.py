"""``tree_rejection_sample``: fused verification of a token tree (greedy and stochastic).

The tree of row ``b`` has ``T`` nodes: ``parents[b, i]`` is node ``i``'s parent, node 0 is
the root (the last committed token, parent -1) and parents precede children
(``parents[b, i] < i``). A node ``i > 0`` with parent -1 is absent (padding, so trees of
different sizes share one batch). Node ``i`` carries the draft token
``node_token_ids[b, i]``; row ``i`` of ``target_logits`` is the target's distribution over
node ``i``'s children, and row ``i`` of ``draft_probs`` the (already warped) distribution
they were drawn from.

The walk starts at the root. At the current node its children are tried in increasing
node index (the order they were drawn in):

- **greedy** rows (temperature 0): follow the first child whose token is the target's
  argmax (lowest index on ties); stop when there is none and emit the argmax.
- **draft probabilities** (SpecInfer's recursive rule): with ``p`` the warped target and
  ``q`` the draft row, child ``j`` with token ``x`` is accepted with probability
  ``min(1, p_j(x) / q_j(x))``; on rejection ``p_{j+1} = norm(max(0, p_j - q_j))``. With
  replacement (children i.i.d. from ``q``) ``q_j = q``; without replacement
  (``without_replacement=True``) ``q_j`` is ``q`` with the earlier siblings' tokens removed
  and renormalised (a child repeating an earlier sibling's token is skipped).
- **no draft probabilities** (deterministic top-k children, one-hot drafts): each
  ``q_j`` is a point mass, so the rule reduces to one uniform ``u`` against the cumulative
  target mass of the siblings: child ``j`` is accepted iff
  ``sum_{i<j} p(x_i) <= u < sum_{i<=j} p(x_i)`` (repeated tokens count once), and the
  residual is ``p`` without the siblings' tokens.

An accepted child becomes the current node; the walk ends at a node with no children (or
at depth ``max_depth``), where the bonus token is drawn from its ``p``, or when every child
is rejected, where the recovered token is drawn from the last residual. The emitted
tokens follow the warped target exactly (REFERENCE.md §1), with one guard against
round-off: a residual with no mass falls back to the node's ``p``. With draft
probabilities "no mass" means a mass below ``RESIDUAL_EPS`` = 1e-5 (relative to ``p``):
that mass is exactly the probability of having rejected every sibling, so the fallback
moves the output distribution by at most 1e-5 in total variation, while a draft equal to
the target up to float rounding (``max(0, p - q)`` is then round-off noise) still
resamples from ``p``. With point masses the residual is ``p`` with entries zeroed (no
round-off), and "no mass" means no positive entry.

Randomness is Philox-4x32-10 keyed on ``(seed[b], offset[b])`` (``osd_kernels.philox``),
with the tree node as the position:

- the accept test of the ``j``-th child tried at node ``n`` (``j = 0, 1, ...`` in index
  order) uses ``u(stream(n, accept), index=j)``; point-mass drafts use ``index=0`` once;
- the emitted token at node ``n`` is the exponential race ``argmax_x r(x) / E_x`` over
  ``r(x) > 0`` with ``E_x = -log u(stream(n, sample), index=x)`` (lowest index on ties),
  which needs no normalisation of the residual ``r``.

On a chain (one child per node) this is exactly the layout of
``osd_kernels.rejection_sample``, so both samplers emit the same tokens for the same seeds.
Backends agree token for token up to float rounding (a tie within an ulp between an
accept ratio and its uniform, or between the two best race keys, can differ).

Outputs (``D`` = ``max_depth``, by default the depth of the deepest node of the batch):

- ``accepted_nodes`` ``[B, D+1]`` int64: the accepted path's node indices, starting with
  the root 0 (``num_accepted + 1`` valid entries, -1 padded). These are exactly the cache
  slots to keep: ``kv_rollback(kv, lens, accepted_nodes, num_accepted + 1)``.
- ``output_token_ids`` ``[B, D+1]`` int64: the accepted drafts' tokens, then the one
  emitted token (``num_accepted + 1`` valid entries, -1 padded). The emitted token is the
  next root.
- ``num_accepted`` ``[B]`` int32.
"""

from __future__ import annotations

import torch

from osd_kernels import philox
from osd_kernels._ops import native_available, native_has_device, resolve_backend
from osd_kernels.rejection_sample import (
    check_float_dtype,
    check_on_device,
    check_sampling_values,
    sampling_params,
)
from osd_kernels.warp import warp_probs

RESIDUAL_EPS = 1e-5  # residual mass treated as round-off (see the module docstring)


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node, ``[B, T]`` int64 (root 0; -1 for absent or unreachable nodes).

    A node is present iff its parent is a present node with a smaller index.
    """
    B, T = parents.shape
    par = parents.t().long()  # [T, B]: one contiguous row per node
    depth = torch.full((T, B), -1, dtype=torch.int64, device=parents.device)
    depth[0] = 0
    for i in range(1, T):
        p = par[i]
        pd = depth.gather(0, p.clamp(0, i - 1)[None])[0]
        depth[i] = torch.where((p >= 0) & (p < i) & (pd >= 0), pd + 1, -1)
    return depth.t()


def tree_max_depth(parents: torch.Tensor) -> int:
    """The depth of the deepest present node over the batch (a host sync on GPU)."""
    depths = tree_depths(parents)
    return int(depths.max()) if depths.numel() else 0


def _race(
    weights: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, node: torch.Tensor
) -> torch.Tensor:
    """Exponential race ``argmax_x w_x / E_x`` over ``w_x > 0``, noise of tree node ``node``."""
    u = philox.philox_uniform_rows(
        seed, offset, philox.stream_id(node, philox.PURPOSE_SAMPLE), weights.shape[1]
    )
    keys = torch.where(weights > 0, weights / -torch.log(u), torch.full_like(weights, -1.0))
    return keys.argmax(dim=-1)


def tree_rejection_sample_reference(
    target_logits: torch.Tensor,
    node_token_ids: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
    offset=None,
    generator=None,
    max_depth: int | None = None,
    without_replacement: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-PyTorch tree verification (the ground truth; arguments as
    :func:`tree_rejection_sample`). Warps only the rows on the accepted paths.

    Vectorised over the batch: one pass over the node indices, where node ``c`` is tried
    in every row whose current node is its parent. Per row it keeps the current node's
    unnormalised residual ``r`` (``p`` on entry, treated as having mass 1), its mass ``s``,
    the draft mass ``z`` not yet drawn (without replacement), the sibling mass already
    tried (point-mass drafts) and the rank of the next sibling.
    """
    params = sampling_params(
        target_logits,
        node_token_ids,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        offset=offset,
        generator=generator,
    )
    B, T, V = target_logits.shape
    dev = target_logits.device
    D = tree_max_depth(parents) if max_depth is None else int(max_depth)
    logits = target_logits.float()
    rows = torch.arange(B, device=dev)
    greedy = ~(params.temperature > 0)
    par = parents.long()
    tokens = node_token_ids
    amax = logits.argmax(-1)  # [B, T], lowest index on ties
    q_all = None if draft_probs is None else draft_probs.float()
    seed, offset = params.seed, params.offset

    def warped(mask, node):
        """Warped target rows of ``node`` for the rows in ``mask``: ``[mask.sum(), V]``."""
        return warp_probs(
            logits[rows[mask], node[mask]],
            params.temperature[mask],
            params.top_k[mask],
            params.top_p[mask],
        )

    def accept_uniform(node, index):
        return philox.philox_uniform(
            seed, offset, philox.stream_id(node, philox.PURPOSE_ACCEPT), index
        )

    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    depth = torch.zeros(B, dtype=torch.int64, device=dev)
    accepted_nodes = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev)
    accepted_nodes[:, 0] = 0
    out = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev)
    p_cur = torch.zeros(B, V, device=dev)  # the current node's warped target
    p_cur[~greedy] = warped(~greedy, cur)
    r = p_cur.clone()
    s = torch.ones(B, device=dev)
    z = torch.ones(B, device=dev)
    tried = torch.zeros(B, device=dev)
    rank = torch.zeros(B, dtype=torch.int64, device=dev)
    excluded = torch.zeros(B, V, dtype=torch.bool, device=dev)

    for c in range(1, T):
        x = tokens[:, c]
        cand = (par[:, c] == cur) & (depth < D) & (x >= 0) & (x < V)
        if not bool(cand.any()):
            continue
        x = x.clamp(0, V - 1)
        rx = r[rows, x]
        if q_all is None:
            # one uniform per node against the cumulative mass of the siblings
            new_tried = tried + rx
            ok = accept_uniform(cur, 0) < new_tried
            rej = cand & ~greedy & ~ok
            tried = torch.where(rej, new_tried, tried)
            r[rows[rej], x[rej]] = 0.0
        else:
            q = q_all[rows, cur]
            qx = q[rows, x]
            a = torch.where(z > 0, s / z, torch.zeros_like(s))
            ok = accept_uniform(cur, rank) * (a * qx) < rx
            live = cand & ~greedy
            if without_replacement:
                live = live & ~excluded[rows, x]  # a repeated sibling is skipped
            rej = live & ~ok
            r = torch.where(rej[:, None], (r - a[:, None] * q).clamp_min(0.0), r)
            s = torch.where(rej, r.sum(-1), s)
            if without_replacement:
                z = torch.where(rej, z - qx, z)
                excluded[rows[rej], x[rej]] = True
            ok = ok & live
        rank = rank + cand.long()
        acc = cand & torch.where(greedy, x == amax[rows, cur], ok)
        if bool(acc.any()):
            out[rows[acc], depth[acc]] = x[acc]
            depth = depth + acc.long()
            accepted_nodes[rows[acc], depth[acc]] = c
            cur = torch.where(acc, torch.full_like(cur, c), cur)
            fresh = acc & ~greedy
            r[fresh] = p_cur[fresh] = warped(fresh, cur)
            for t, v in ((s, 1.0), (z, 1.0), (tried, 0.0), (rank, 0)):
                t[acc] = v
            excluded[acc] = False

    emitted = amax[rows, cur]
    if not bool(greedy.all()):
        empty = ~(r > 0).any(-1) if q_all is None else s <= RESIDUAL_EPS
        weights = torch.where(empty[:, None], p_cur, r)
        emitted = torch.where(greedy, emitted, _race(weights, seed, offset, cur))
    out[rows, depth] = emitted
    return accepted_nodes, out, depth.to(torch.int32)


def _check_tensors(target_logits, node_token_ids, parents, draft_probs, max_depth) -> None:
    if not torch.is_tensor(target_logits) or target_logits.dim() != 3:
        raise ValueError(
            "target_logits must be a [B, T, V] tensor, got "
            f"{getattr(target_logits, 'shape', type(target_logits).__name__)}"
        )
    check_float_dtype("target_logits", target_logits)
    B, T, V = target_logits.shape
    if T < 1 or V < 1:
        raise ValueError(f"target_logits needs T >= 1 nodes and V >= 1 tokens, got {(B, T, V)}")
    dev = target_logits.device
    for name, t, dtype in (
        ("node_token_ids", node_token_ids, torch.int64),
        ("parents", parents, torch.int32),
    ):
        if not torch.is_tensor(t) or t.shape != (B, T):
            raise ValueError(
                f"{name} must be a [B={B}, T={T}] tensor, got "
                f"{getattr(t, 'shape', type(t).__name__)}"
            )
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
        check_on_device(name, t, dev)
    if draft_probs is not None:
        if not torch.is_tensor(draft_probs) or draft_probs.shape != (B, T, V):
            raise ValueError(
                f"draft_probs must be a [B={B}, T={T}, V={V}] tensor or None, got "
                f"{getattr(draft_probs, 'shape', type(draft_probs).__name__)}"
            )
        check_float_dtype("draft_probs", draft_probs)
        check_on_device("draft_probs", draft_probs, dev)
    if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int)):
        raise TypeError(f"max_depth must be an int, got {type(max_depth).__name__}")
    if max_depth is not None and not 0 <= max_depth < T:
        raise ValueError(f"max_depth must lie in [0, T={T}), got {max_depth}")


def _check_values(node_token_ids, parents, vocab: int, params) -> None:
    """Value checks, on CPU only: on CUDA they would need a host sync (kernels skip
    nodes with an out-of-range parent or token)."""
    if parents.device.type != "cpu":
        return
    B, T = parents.shape
    if B and not bool((parents[:, 0] == -1).all()):
        raise ValueError("parents[:, 0] must be -1 (node 0 is the root)")
    node = torch.arange(T, dtype=torch.int32, device=parents.device)
    if not bool(((parents >= -1) & (parents < node)).all()):
        raise ValueError("parents[b, i] must be -1 (an absent node) or a node index < i")
    tok = node_token_ids[:, 1:]
    if not bool((((tok >= 0) & (tok < vocab)) | (parents[:, 1:] < 0)).all()):
        raise ValueError(f"node_token_ids of nodes with a parent must lie in [0, V={vocab})")
    check_sampling_values(params)


def tree_rejection_sample(
    target_logits: torch.Tensor,
    node_token_ids: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
    offset=None,
    generator: torch.Generator | None = None,
    without_replacement: bool = False,
    max_depth: int | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a token tree per sequence: accepted path, emitted tokens, accepted count.

    Semantics, randomness layout and outputs: see the module docstring.

    Args:
        target_logits: ``[B, T, V]`` float32/float16/bfloat16; row ``i`` scores node ``i``'s
            children. Any strides.
        node_token_ids: ``[B, T]`` int64, the token of each node (in ``[0, V)``; unused for
            the root and absent nodes).
        parents: ``[B, T]`` int32, ``parents[b, 0] = -1``, ``parents[b, i] < i``; -1 at
            ``i > 0`` marks an absent node.
        draft_probs: ``[B, T, V]`` float32/float16/bfloat16, the already-warped distribution
            each node's children were drawn from, or None for deterministic children
            (point-mass drafts).
        temperature: ``[B]`` float (or a number); None or 0 is greedy.
        top_k: ``[B]`` int (or a number); None or 0 is off.
        top_p: ``[B]`` float in (0, 1] (or a number); None or 1 is off.
        seed, offset: ``[B]`` int64 (or numbers): the Philox key and stream selector of
            each row. Reusing a (seed, offset) pair reuses its randomness, so advance
            ``offset`` every step. Device tensors keep the op free of host syncs.
        generator: a CPU ``torch.Generator`` used to draw ``seed`` when it is None (the
            global generator if None too); ``offset`` defaults to 0.
        without_replacement: siblings were drawn from ``q`` without replacement.
        max_depth: ``D``, the width of the outputs minus one; at most ``D`` nodes are
            accepted. None computes the tree depth from ``parents`` (a host sync on GPU;
            pass it explicitly on the decode path and under CUDA graphs).
        backend: ``auto`` | ``reference`` | ``native`` | ``triton``.

    Returns:
        ``(accepted_nodes [B, D+1] int64, output_token_ids [B, D+1] int64,
        num_accepted [B] int32)``; the first ``num_accepted + 1`` entries of each row are
        valid, the rest -1.

    Example:
        >>> # root 0 with children 1 (token 7) and 2 (token 3); node 3 (token 5) under 2
        >>> parents = torch.tensor([[-1, 0, 0, 2]], dtype=torch.int32)
        >>> tokens = torch.tensor([[0, 7, 3, 5]])
        >>> nodes, out, n = tree_rejection_sample(logits, tokens, parents)  # greedy
        >>> kv_rollback(kv, lens, nodes, n + 1)                # keep the accepted path
    """
    _check_tensors(target_logits, node_token_ids, parents, draft_probs, max_depth)
    params = sampling_params(
        target_logits,
        node_token_ids,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        offset=offset,
        generator=generator,
    )
    _check_values(node_token_ids, parents, target_logits.shape[2], params)
    if max_depth is None:
        max_depth = tree_max_depth(parents)  # host sync: the output width depends on it
    device = target_logits.device
    impl = resolve_backend(backend, device, prefer_triton_on_gpu=not native_has_device(device))
    if impl == "reference":
        return tree_rejection_sample_reference(
            target_logits,
            node_token_ids,
            parents,
            draft_probs,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            offset=params.offset,
            max_depth=max_depth,
            without_replacement=without_replacement,
        )
    args = (
        target_logits,
        node_token_ids,
        parents,
        draft_probs,
        params.temperature,
        params.top_k,
        params.top_p,
        params.seed,
        params.offset,
        max_depth,
        without_replacement,
    )
    if impl == "triton":
        # imported on first use so that `import osd_kernels` does not import triton
        from osd_kernels.triton.tree_rejection_sample import tree_rejection_sample_triton

        return tree_rejection_sample_triton(*args)
    return torch.ops.osd.tree_rejection_sample(*args)


if native_available():

    @torch.library.register_fake("osd::tree_rejection_sample")
    def _tree_rejection_sample_fake(
        target_logits,
        node_token_ids,
        parents,
        draft_probs,
        temperature,
        top_k,
        top_p,
        seed,
        offset,
        max_depth,
        without_replacement,
    ):
        B = target_logits.shape[0]
        nodes = target_logits.new_empty((B, max_depth + 1), dtype=torch.int64)
        return nodes, torch.empty_like(nodes), target_logits.new_empty((B,), dtype=torch.int32)
