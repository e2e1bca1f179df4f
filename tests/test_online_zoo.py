"""Online distillation and routing on the built-in pair (osd.zoo), with fixed seeds.

- α test: the prose-trained draft serving 96 code queries (about 2 minutes on the 2-core
  machine, both engines included). The online draft's α over the last third of the
  stream must beat the same draft kept static by at least 0.1 (the project's goal).
  Measured with this schedule (8 AdamW steps at lr 5e-4 every 4 requests): +0.158 with
  the prompt positions distilled (the default), +0.125 before they were; every 8 requests
  gave +0.097 (see docs/online.md). ``pytest -s`` prints the measured gain.
- routing test: two drafts of one shape, one pretrained on 90% prose and one on code
  only, serve an interleaved stream of both domains through the router (which sees the
  prompts' tokens, never their domain). After warm-up, >= 90% of each domain's requests
  must go to its matching draft, and the routed α must beat either draft alone.
"""

import os

import pytest
import torch

import osd
from osd import zoo
from tests.conftest import devices

pytestmark = pytest.mark.slow

CODE_DRAFT = os.path.join(zoo.WEIGHTS_DIR, "draft_code")
PARAMS = osd.SamplingParams(24)


def _alphas(engine, prompts):
    out = []
    for p in prompts:
        st = engine.generate([p], PARAMS)[0].stats
        out.append(st["alpha"])
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs)


@pytest.mark.parametrize("device", devices())
def test_online_alpha_rises_over_static_draft(device):
    """On CUDA the learner runs as it serves by default: a background thread on its own
    stream with the graph-captured training step, next to the serving step's graphs
    (``wait_for_update`` keeps the schedule equal to the CPU run's)."""
    target, draft = zoo.default_pair()
    prompts = zoo.query_stream("code", n=96, prompt_tokens=48, seed=1)
    spec = osd.SpecConfig(num_draft_tokens=4)
    static = osd.Engine.from_pretrained(
        target, draft=draft, spec=spec, max_batch_size=1, max_seq_len=128, device=device
    )
    on_cuda = device == "cuda"
    online = osd.Engine.from_pretrained(
        target,
        draft=draft,
        spec=spec,
        max_batch_size=1,
        max_seq_len=128,
        device=device,
        online=osd.OnlineConfig(
            update_every_requests=4,
            steps_per_update=8,
            lr=5e-4,
            background=on_cuda,
            wait_for_update=on_cuda,
            seed=0,
        ),
    )
    a_static = _alphas(static, prompts)
    a_online = _alphas(online, prompts)
    tail = slice(64, 96)
    gain = _mean(a_online[tail]) - _mean(a_static[tail])
    print(
        f"\nα over the last 32 requests: static {_mean(a_static[tail]):.3f}, online "
        f"{_mean(a_online[tail]):.3f}, gain {gain:+.3f}"
    )
    assert gain >= 0.1, (round(_mean(a_static[tail]), 3), round(_mean(a_online[tail]), 3))
    assert online.stats["online"]["updates_applied"] >= 12
    online.close()


@pytest.mark.gpu
@pytest.mark.skipif(not os.path.isdir(CODE_DRAFT), reason="the code draft is not shipped")
def test_background_learners_two_drafts_and_graphs_serve_on_cuda():
    """The default online mode on a GPU: two routed drafts, background learners capturing
    their training steps while serving captures and replays its own graphs."""
    target, prose_draft = zoo.default_pair()
    stream = zoo.query_stream("code", n=48, prompt_tokens=48, seed=2)
    eng = osd.Engine.from_pretrained(
        target,
        draft=[prose_draft, CODE_DRAFT],
        spec=osd.SpecConfig(num_draft_tokens=4),
        max_batch_size=4,
        max_seq_len=128,
        device="cuda",
        dtype=torch.bfloat16,
        online=osd.OnlineConfig(update_every_requests=4, steps_per_update=2),
    )
    for i in range(0, len(stream), 4):
        outs = eng.generate(stream[i : i + 4], PARAMS)
        assert all(0 < len(o.token_ids) <= PARAMS.max_new_tokens for o in outs)
    eng.close()
    assert eng.stats["online"]["updates_applied"] + eng.stats["online"]["updates_rejected"] > 0
    assert eng.stats["cuda_graphs"]["replays"] > 0


@pytest.mark.skipif(not os.path.isdir(CODE_DRAFT), reason="the code draft is not shipped")
def test_router_sends_each_domain_to_its_draft():
    target, prose_draft = zoo.default_pair()
    n, warm = 64, 16
    prose = zoo.query_stream("prose", n=n, prompt_tokens=48, seed=3)
    code = zoo.query_stream("code", n=n, prompt_tokens=48, seed=3)
    stream = [q for pair in zip(prose, code) for q in pair]  # interleaved
    domains = [0, 1] * n  # 0 = prose, 1 = code
    spec = osd.SpecConfig(num_draft_tokens=4)
    routed = osd.Engine.from_pretrained(
        target,
        draft=[prose_draft, CODE_DRAFT],
        spec=spec,
        max_batch_size=1,
        max_seq_len=128,
        online=osd.OnlineConfig(update_every_requests=8, lr=1e-4, background=False),
    )
    a_routed = _alphas(routed, stream)
    choices = routed.stats["online"]["routed"]
    # Measured on this stream (seed 3): 52 of 56 prose and 55 of 56 code requests after
    # warm-up went to the matching draft; on the streams of seeds 4, 5 and 11, 54/54,
    # 54/53 and 54/53 of 56. Some requests score higher with the other draft (prose
    # windows that are doctests or tables, code windows inside long string literals):
    # with seed 2, 5 of the 56 prose requests did, and the router sent 50 of 56 (89%) to
    # the prose draft. See docs/online.md.
    for d in (0, 1):
        mine = [c for c, dd in list(zip(choices, domains))[warm:] if dd == d]
        assert sum(c == d for c in mine) >= 0.9 * len(mine), (d, mine)
    # Each draft alone, static, on the same requests, batched (greedy; batch 8 and batch 1
    # gave the same mean α to 1e-8). Measured: routed 0.691, prose draft alone 0.576,
    # code draft alone 0.580 (each alone with online learning, batch 1: 0.610, 0.608).
    alone = []
    for d in (prose_draft, CODE_DRAFT):
        eng = osd.Engine.from_pretrained(
            target, draft=d, spec=spec, max_batch_size=8, max_seq_len=128
        )
        alone.append(_mean([o.stats["alpha"] for o in eng.generate(stream[warm:], PARAMS)]))
    assert _mean(a_routed[warm:]) > max(alone), (_mean(a_routed[warm:]), alone)
