"""A whole speculative chain step as one CUDA graph (``osd.graphs``).

A chain step of a plain model drafter is, on the device: the draft loop (the pending
tokens' forward, then ``k - 1`` one-token forwards, each token drawn greedily or from the
warped draft), the target's verify forward over ``[root, drafts]``, the rejection sampler,
the target cache's commit, the non-finite check, the exact α of the drafted positions,
the next roots and the draft's pending tokens. :func:`fused_chain_step` captures all of it
per ``(batch bucket, k, sampling scalars)`` and replays it; the host then reads one small
tensor (accepted counts, non-finite flags, α, tokens) and does the bookkeeping.

Shapes are fixed per key: the pending tokens are padded to ``k + 1`` (after a chain step a
row has at most ``k + 1`` pending tokens; the tokens past a row's count are fed too, into
cache slots past its length, which are scratch, and cannot change the logits before them),
and the batch is padded to its bucket with free rows, as in ``osd.graphs``.

Steps that branch on the host stay on the separate-graph path (``Speculator.step``):
trees, prompt lookup, EAGLE drafts (which read the verify forward's features), the
adaptive stopper, rows with different sampling parameters, penalties and logit biases.
"""

from __future__ import annotations

import logging

import torch

from osd.graphs import batch_bucket
from osd.spec_decode.model_drafter import ChainProposal, ModelDrafter
from osd.spec_decode.readback import pack_readback

log = logging.getLogger(__name__)


def fusable(speculator, active, params, k: int) -> bool:
    """Whether this step can replay the fused graph."""
    d = speculator.drafter
    return (
        speculator.graphs is not None
        and k > 0
        and speculator.spec.tree is None
        and speculator.stopper is None
        and type(d) is ModelDrafter
        and params.uniform is not None
        and not getattr(speculator, "_unfusable", False)
        and d._pending_max <= k + 1
        and not d._stale  # rows a deferring drafter must feed first (ModelDrafter.sync)
        and not any(r.params is not None and r.params.adjusts_logits for r in active)
        and speculator.cache.bound + k + 1 <= speculator.cache.capacity
        and d.cache.bound + 2 * k <= d.cache.capacity
    )


def fused_chain_step(speculator, B: int, params, sampling: dict, k: int):
    """Replay (capturing first) the fused step for rows ``0 .. B-1``.

    Returns ``(proposal, logits [B, k + 1, V], packed, column names)``, ``packed`` the
    step's read-back (``osd.spec_decode.step.pack_readback``: per row the accepted count,
    the non-finite flag, the listeners' columns and the ``k + 1`` sampled tokens); or None
    when the capture failed (the step then takes the separate-graph path, and so does every later
    one of this speculator)."""
    sp = speculator
    d, cache, model = sp.drafter, sp.cache, sp.engine.model
    dcache = d.cache
    Bb = batch_bucket(B, cache.max_batch_size)
    P = k + 1
    warp = None if params.greedy else (params.temperature, params.top_k, params.top_p)
    names = [n for n in ("temperature", "top_k", "top_p") if n in sampling]

    def build():
        dev = cache.lens.device
        static = {
            "seed": torch.zeros(Bb, dtype=torch.int64, device=dev),
            "offset": torch.zeros(Bb, dtype=torch.int64, device=dev),
        }
        for n in names:  # padding rows sample validly: t 1, no cut
            static[n] = torch.full(
                (Bb,), 0 if n == "top_k" else 1, dtype=sampling[n].dtype, device=dev
            )

        def body(s):
            toks, probs, raw, _ = d._chain(Bb, k, params, s["seed"], s["offset"])
            tokens = torch.stack(toks, 1)
            probs = torch.stack(probs, 1) if probs else None
            raw = torch.stack(raw, 1)
            lens_before = cache.lens[:Bb].clone()
            logits = model(torch.cat([sp.next_tokens[:Bb, None], tokens], 1), cache)
            prop = ChainProposal(tokens, probs, raw, None, k)
            out, n, _, bad = sp.sample(logits, prop, {x: s[x] for x in ("seed", "offset", *names)})
            keep = (n + 1).to(torch.int32)
            cache.commit(keep, P)
            columns = sp.device_columns(prop, logits, params)
            packed, sp._fused_columns[key] = pack_readback(n, logits, columns, out, bad)
            sp.next_tokens[:Bb] = out.gather(1, n[:, None].long())[:, 0]
            # the draft's side of the verdict (ModelDrafter.set_pending, on the device)
            dcache.lens[:Bb] = (lens_before + 1).to(torch.int32)
            d._pending[:Bb, :P] = out.clamp(min=0)
            d._pending_len[:Bb] = keep.long()
            return packed, tokens, probs, raw, logits

        return static, body

    def fill(s):
        s["seed"][:B].copy_(sampling["seed"])
        s["offset"][:B].copy_(sampling["offset"])
        for n in names:
            s[n][:B].copy_(sampling[n])
        cache.lens[B:Bb].zero_()  # padding rows are free rows
        dcache.lens[B:Bb].zero_()
        d._pending_len[B:Bb] = 1
        d._pending_max = P

    def host_state():
        saved = cache.bound, dcache.bound
        cache.bound = cache.capacity - P  # capture with the widest key ranges
        dcache.bound = dcache.capacity - (P + k - 1)

        def restore():
            cache.bound, dcache.bound = saved
            d._pending_max = P

        return restore

    target_bound = cache.bound
    key = ("fused-chain", id(sp), Bb, k, warp)
    try:
        packed, tokens, probs, raw, logits = sp.graphs.run(
            key,
            build,
            fill,
            state=(cache.lens, dcache.lens, d._pending, d._pending_len, sp.next_tokens),
            host_state=host_state,
        )
    except RuntimeError as exc:  # a capture this device cannot take
        log.warning(
            "the fused speculative step could not be captured (%s); steps replay "
            "the draft and verify graphs separately",
            exc,
        )
        sp._unfusable = True
        return None
    # what the eager commits would have left on the host
    cache.bound = min(target_bound + P, cache.capacity)
    dcache.set_bound(min(cache.bound + 1, dcache.capacity))
    prop = ChainProposal(tokens[:B], None if probs is None else probs[:B], raw[:B], None, k)
    return prop, logits[:B], packed[:B], sp._fused_columns[key]
