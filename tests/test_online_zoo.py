"""Online distillation and routing on the built-in pair (osd.zoo), with fixed seeds.

- α test: the prose-trained draft serving code queries. The online draft's α over the
  last third of the stream must beat the same draft kept static by at least 0.05. The
  project's goal is +0.1; on the shipped pair we measured +0.097 with this config (see
  docs/online.md), so the goal is not met yet and this test guards the measured gain.
- routing test: two drafts, one pretrained mostly on prose and one mostly on code, an
  interleaved stream of both domains. After warm-up, >= 90% of the code requests go to
  the code draft and the routed α beats either draft alone. Prose requests are split
  between the drafts (about half went to the prose draft when measured): the code draft
  is nearly as good on prose, and the router follows α rather than the domain label, so
  the goal of >= 90% for *each* domain is not met for prose.
"""
import os

import pytest

import osd
from osd import zoo

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


def test_online_alpha_rises_over_static_draft():
    target, draft = zoo.default_pair()
    prompts = zoo.query_stream("code", n=96, prompt_tokens=48, seed=1)
    spec = osd.SpecConfig(num_draft_tokens=4)
    static = osd.Engine.from_pretrained(target, draft=draft, spec=spec, max_batch_size=1,
                                        max_seq_len=128)
    online = osd.Engine.from_pretrained(
        target, draft=draft, spec=spec, max_batch_size=1, max_seq_len=128,
        online=osd.OnlineConfig(update_every_requests=8, steps_per_update=8, lr=5e-4,
                                background=False, seed=0))
    a_static = _alphas(static, prompts)
    a_online = _alphas(online, prompts)
    tail = slice(64, 96)
    gain = _mean(a_online[tail]) - _mean(a_static[tail])
    assert gain >= 0.05, (round(_mean(a_static[tail]), 3), round(_mean(a_online[tail]), 3))
    assert online.stats["online"]["updates_applied"] >= 6


@pytest.mark.skipif(not os.path.isdir(CODE_DRAFT), reason="the code draft is not shipped")
def test_router_sends_each_domain_to_its_draft():
    target, prose_draft = zoo.default_pair()
    n = 36
    prose = zoo.query_stream("prose", n=n, prompt_tokens=48, seed=2)
    code = zoo.query_stream("code", n=n, prompt_tokens=48, seed=2)
    stream = [q for pair in zip(prose, code) for q in pair]          # interleaved
    domains = [0, 1] * n                                             # 0 = prose, 1 = code
    spec = osd.SpecConfig(num_draft_tokens=4)
    routed = osd.Engine.from_pretrained(
        target, draft=[prose_draft, CODE_DRAFT], spec=spec, max_batch_size=1,
        max_seq_len=128,
        online=osd.OnlineConfig(update_every_requests=8, lr=1e-4, background=False))
    a_routed = _alphas(routed, stream)
    choices = routed.stats["online"]["routed"]
    warm = 16
    code_choices = [c for c, d in list(zip(choices, domains))[warm:] if d == 1]
    assert sum(c == 1 for c in code_choices) >= 0.9 * len(code_choices), code_choices
    alone = []
    for d in (prose_draft, CODE_DRAFT):
        eng = osd.Engine.from_pretrained(target, draft=d, spec=spec, max_batch_size=1,
                                         max_seq_len=128)
        alone.append(_mean(_alphas(eng, stream[warm:])))
    assert _mean(a_routed[warm:]) > max(alone), (_mean(a_routed[warm:]), alone)
