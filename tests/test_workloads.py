"""The evaluation set (``osd.zoo.workloads``), the per-workload evaluator (``osd.evaluate``)
and prompt lookup asked for without a draft model."""

import importlib
import os

import pytest

import osd
from osd.evaluate import analytic_speedup, evaluate, plot, table
from osd.evaluate_online import online_stream
from osd import zoo
from osd.zoo import corpus, workloads
from osd.zoo.workloads import evaluation_set, stream
from tests.test_models import VOCAB, tiny_hf_model
from tests.test_speculative import perturbed


def test_evaluation_set_has_four_different_workloads():
    ws = evaluation_set(n=5, seed=3)
    assert [w.name for w in ws] == ["explain", "summarise", "multiturn", "code"]
    for w in ws:
        assert len(w.prompts) == 5
        for conv in w.prompts:
            assert conv[-1]["role"] == "user" and conv[-1]["content"]
    summarise = ws[1].prompts
    assert min(len(c[-1]["content"]) for c in summarise) > 500  # a passage to copy from
    assert all(len(c) == 5 for c in ws[2].prompts)  # earlier turns
    assert evaluation_set(n=5, seed=3) == ws and evaluation_set(n=5, seed=4) != ws
    with pytest.raises(ValueError, match="n must be >= 1"):
        evaluation_set(n=0)


def test_long_documents_are_long_distinct_and_seeded():
    docs = workloads.long_documents(4, chars=5000)
    texts = [c[0]["content"] for c in docs]
    assert len(texts) == 4 and len(set(texts)) == 4
    assert all(len(t) >= 5000 and t.startswith("Summarise") for t in texts)
    assert workloads.long_documents(4, chars=5000) == docs
    with pytest.raises(ValueError, match="n and chars"):
        workloads.long_documents(0)


def test_workloads_use_held_out_modules_only():
    """No shipped draft trained on the evaluation set's text: every module it reads lies
    in the corpus's held-out split."""
    root = corpus.stdlib_root()
    for m in set(workloads.PASSAGE_MODULES) | set(workloads.FUNCTION_MODULES):
        path = os.path.relpath(importlib.import_module(m).__file__, root).replace(os.sep, "/")
        assert corpus.split_of(path) == "heldout", m


def _encode(convs):
    return [[(ord(ch) % (VOCAB - 1)) + 1 for m in c for ch in m["content"][:40]] for c in convs]


def test_evaluate_reports_every_workload_and_greedy_parity():
    target = tiny_hf_model("llama", seed=31)
    draft = perturbed(target, 0.3, seed=32)
    rows = evaluate(
        target,
        draft,
        workloads=evaluation_set(n=2),
        max_new_tokens=8,
        encode=_encode,
        spec=osd.SpecConfig(num_draft_tokens=3),
        engine_kwargs=dict(max_seq_len=512),
        progress=False,
    )
    assert [r["workload"] for r in rows] == ["explain", "summarise", "multiturn", "code"]
    for r in rows:
        assert r["equal"] is True and r["speedup"] > 0 and r["k"] == 3
        assert 0 <= r["alpha"] <= 1 and r["tokens_per_forward"] >= 1
    assert "| explain | 2 |" in table(rows)


def test_a_base_model_is_evaluated_on_transcripts():
    """A target without a chat template (the built-in pair's) is asked the workloads as
    question-and-answer transcripts, with no ``encode`` given."""
    target = zoo.default_pair()[0]
    w = evaluation_set(n=1)[0]
    rows = evaluate(
        target,
        None,
        workloads=[w],
        max_new_tokens=4,
        spec=osd.SpecConfig(drafter="ngram"),
        engine_kwargs=dict(max_seq_len=1024),
        progress=False,
    )
    assert rows[0]["workload"] == "explain" and rows[0]["equal"] is True


def test_plot_draws_every_case_per_workload(tmp_path):
    rows = [
        {"workload": w, "speedup": s, "tokens_per_forward": t}
        for w, s, t in (("explain", 1.4, 1.7), ("code", 0.9, None))
    ]
    path = tmp_path / "speedup.png"
    plot({"greedy": rows, "sampled": rows[:1], "none": []}, str(path), goals={"goal": 2.0})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="at least one case"):
        plot({"greedy": []}, str(path))


def test_analytic_speedup():
    assert analytic_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert analytic_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert analytic_speedup(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)


def test_prompt_lookup_without_a_draft_is_lookup_alone():
    target = tiny_hf_model("llama", seed=31)
    spec = osd.SpecConfig(prompt_lookup=True, lookup_tokens=6, lookup_history=64)
    eng = osd.Engine.from_pretrained(target, spec=spec, max_batch_size=2, max_seq_len=64)
    assert eng.spec.drafter == "ngram" and eng.spec.num_draft_tokens == 6
    assert eng.spec.lookup_history == 64
    prompt = [[5, 6, 7, 5, 6, 7, 5, 6]]
    plain = osd.Engine.from_pretrained(target, max_batch_size=2, max_seq_len=64)
    params = osd.SamplingParams(12)
    assert eng.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids
    assert eng.stats["drafted"] > 0


def test_online_stream_compares_the_online_and_the_static_draft():
    target = tiny_hf_model("llama", seed=31)
    draft = perturbed(target, 0.3, seed=32)
    convs = stream("explain", 8)
    res = online_stream(
        target,
        draft,
        convs,
        max_new_tokens=8,
        encode=_encode,
        online=osd.OnlineConfig(update_every_requests=2, background=False),
        engine_kwargs=dict(max_seq_len=512),
        progress=False,
    )
    s = res["summary"]
    assert len(res["online"]) == len(res["static"]) == 8 and s["requests"] == 8
    assert s["updates_applied"] >= 1
    for part in ("first_quarter", "last_quarter"):
        assert s[part]["online"]["tokens_per_forward"] >= 1
        assert s[part]["speed_ratio"] > 0


def test_streams_have_distinct_prompts():
    for name in ("explain", "code"):
        prompts = stream(name, 120)
        assert len({p[0]["content"] for p in prompts}) == 120
    with pytest.raises(ValueError, match="distinct prompts"):
        stream("code", 10**6)
