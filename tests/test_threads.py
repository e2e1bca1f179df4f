"""Safe to embed: several threads share one engine, and an error in one call leaves the
engine serving the next call exactly as before."""

import os
import subprocess
import sys
import threading

import pytest

import osd
from tests.test_models import tiny_hf_model
from tests.test_speculative import perturbed, prompts_of


@pytest.fixture(scope="module")
def pair():
    target = tiny_hf_model("llama", seed=91)
    return target, perturbed(target, 0.4, seed=92)


def _spec_engine(pair, **kw):
    return osd.Engine.from_pretrained(
        pair[0],
        draft=pair[1],
        spec=osd.SpecConfig(num_draft_tokens=3),
        max_batch_size=3,
        max_seq_len=96,
        **kw,
    )


@pytest.mark.parametrize(
    "params",
    [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=7)],
    ids=["greedy", "sampled"],
)
def test_four_threads_get_what_each_call_gets_alone(pair, params):
    eng = _spec_engine(pair)
    calls = [prompts_of([5, 31, 2, 17][i:] + [9] * i, seed=100 + i) for i in range(4)]
    sp = osd.SamplingParams(14, **params)
    alone = [[o.token_ids for o in eng.generate(c, sp)] for c in calls]
    results: dict[int, list] = {}
    errors = []

    def worker(i):
        try:
            for _ in range(2):
                results.setdefault(i, []).append([o.token_ids for o in eng.generate(calls[i], sp)])
            streamed = [t for chunk in eng.stream(calls[i][0], sp) for t in chunk]
            results[i].append(streamed)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(4):
        assert results[i][0] == alone[i] and results[i][1] == alone[i]
        assert results[i][2] == alone[i][0]


def test_a_stream_inside_a_stream_of_the_same_thread_is_refused(pair):
    eng = _spec_engine(pair)
    outer = eng.stream([1, 2, 3], osd.SamplingParams(8))
    next(outer)
    with pytest.raises(RuntimeError, match="already inside"):
        eng.generate([[4, 5, 6]], osd.SamplingParams(4))
    outer.close()  # releases the engine
    assert len(eng.generate([[4, 5, 6]], osd.SamplingParams(4))[0].token_ids) == 4


def test_engine_serves_correctly_after_errors(pair, monkeypatch):
    eng = _spec_engine(pair)
    prompts = prompts_of([6, 11, 3, 8], seed=120)
    sp = osd.SamplingParams(12)
    ref = [o.token_ids for o in eng.generate(prompts, sp)]
    # bad input
    with pytest.raises(ValueError):
        eng.generate([[1, 2, 10_000]], sp)
    with pytest.raises(ValueError):
        eng.generate([list(range(1, 100))], sp)  # longer than max_seq_len
    # an exception inside a speculative step, mid-way through a batch
    spec = eng.speculators[0]
    real_step = spec.step
    calls = {"n": 0}

    def failing_step(active, params):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real_step(active, params)

    monkeypatch.setattr(spec, "step", failing_step)
    # No request makes the step fail again when run alone: all of them resume.
    assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
    assert eng.stats["errors"]["failed_steps"] == 1
    assert "step_error" not in eng.stats["errors"]
    monkeypatch.setattr(spec, "step", real_step)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
    # and a stream abandoned mid-way
    stream = eng.stream(prompts[0], sp)
    next(stream)
    del stream
    assert [o.token_ids for o in eng.generate(prompts, sp)] == ref


@pytest.mark.parametrize(
    "preset,want",
    [
        ({}, "ACTIVE 10000"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE None"),
        ({"GOMP_SPINCOUNT": "50"}, "None 50"),
    ],
)
def test_openmp_threads_spin_briefly_then_sleep_unless_told(preset, want):
    """``import osd`` (before torch) sets ``OMP_WAIT_POLICY=ACTIVE`` and
    ``GOMP_SPINCOUNT=10000`` (spin briefly, then sleep, also with more threads than cores),
    which libgomp reads when torch loads; a policy or spin count the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(preset)
    code = (
        "import os, osd, torch; "
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def test_release_thread_pool_keeps_torch_working():
    """Releasing a thread's OpenMP workers (as ``AsyncEngine`` does for the thread that
    loaded the model) leaves later parallel work on that thread and on others correct."""
    code = (
        "import osd, torch, threading; torch.set_num_threads(2); "
        "x = torch.randn(1 << 20); a = float(x.sum()); "
        "from osd._openmp import release_thread_pool; r = release_thread_pool(); "
        "b = float(x.sum()); out = []; "
        "t = threading.Thread(target=lambda: out.append(float(x.sum()))); t.start(); t.join(); "
        "print(r, a == b == out[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "True"
