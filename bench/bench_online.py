"""Online learning: its cost on serving throughput, and α over requests.

Built-in pair (``osd.zoo``), code queries (the draft's shifted domain), greedy, batch 1,
CPU fp32, k = 4.

- ``test_learning_overhead``: tokens/s of serving with a static draft against serving
  with online learning in a background thread whose learning rate is 1e-12, so every
  update runs (collection, buffer, 8 forward/backward/AdamW steps per 8 requests, guard,
  swap) but acceptance stays that of the static draft: the ratio is the pure cost of
  learning. Goal: < 10% on CPU. Two identical static engines and the online one take
  turns request by request, in rotating order, so all see the same machine load; the
  difference between the two static engines is the measurement's noise floor. Also
  recorded: the learner's own seconds, as a share of the online engine's serving time.
  Torch runs on ``OSD_BENCH_THREADS`` threads (default 1: serving on one core leaves the
  other to the learner).
- ``test_training_step_autocast``: one training step of the chat pair's draft (768
  positions, forward KL against a top-32 target, AdamW) in fp32 and under bf16
  autocast, taking turns, one thread; with ``cpu_has_fast_bf16`` (what
  ``OnlineConfig(autocast="auto")`` decides by).
- ``test_training_step_context``: the same draft's step on a batch built the way the
  learner builds it (``osd.online.distill.build_batch``): 16 chat requests, prompts of
  81-437 tokens (HumanEval's chat prompts' range) and 48-token answers whose 768
  positions carry targets, each request cut to its newest ``max_train_len`` tokens,
  512 against 128, taking turns, one thread, fused AdamW as the learner uses on CPU.
- ``test_alpha_over_requests``: α per request for a static and an online draft (the α
  test's schedule: 8 AdamW steps at lr 5e-4 every 4 requests, inline), written as
  ``results/online_alpha.png`` and printed as a table (``pytest -s``).

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_online.py \\
        --benchmark-json=results/bench_online.json
"""

import contextlib
import os
import time

import torch

import osd
import osd_kernels
from osd import zoo
from osd.online.buffer import Example
from osd.online.config import cpu_has_fast_bf16
from osd.online.distill import batch_for, draft_logits
from osd.zoo import chat as zoo_chat

FULL = os.environ.get("OSD_BENCH_FULL", "0") == "1"
N = 160 if FULL else 64
PARAMS = osd.SamplingParams(32)
SPEC = osd.SpecConfig(num_draft_tokens=4)
# Plots go to the results folder (ignored by git), as `make bench` writes its JSON there.
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def _engine(online=None):
    target, draft = zoo.default_pair()
    return osd.Engine.from_pretrained(
        target, draft=draft, spec=SPEC, online=online, max_batch_size=1, max_seq_len=128
    )


def test_learning_overhead(benchmark):
    torch.set_num_threads(int(os.environ.get("OSD_BENCH_THREADS", "1")))
    prompts = zoo.query_stream("code", n=N, prompt_tokens=48, seed=3)
    engines = {
        "static": _engine(),
        "static-2": _engine(),
        "online": _engine(
            osd.OnlineConfig(lr=1e-12, update_every_requests=8, steps_per_update=8, background=True)
        ),
    }
    spent = {name: [0.0, 0] for name in engines}
    names = list(engines)

    def serve():
        for i, p in enumerate(prompts):
            # Rotate the order so that no engine always runs first (cache warmth, load).
            for name in names[i % 3 :] + names[: i % 3]:
                t0 = time.perf_counter()
                out = engines[name].generate([p], PARAMS)[0]
                spent[name][0] += time.perf_counter() - t0
                spent[name][1] += len(out.token_ids)
        engines["online"].online.wait()

    benchmark.pedantic(serve, rounds=1, iterations=1)
    online = engines["online"]
    online.close()
    tps = {k: v[1] / v[0] for k, v in spent.items()}
    static = (tps["static"] + tps["static-2"]) / 2
    hist = online.stats["online"]
    assert hist["updates_applied"] + hist["updates_rejected"] >= N // 8 - 1
    learn_s = sum(u["seconds"] for d in hist["drafts"] for u in d["updates"])
    row = {
        "static_tokens_per_s": round(tps["static"], 1),
        "static2_tokens_per_s": round(tps["static-2"], 1),
        "online_tokens_per_s": round(tps["online"], 1),
        "overhead": round(1 - tps["online"] / static, 4),
        "noise_floor": round(abs(tps["static"] - tps["static-2"]) / static, 4),
        "learner_seconds": round(learn_s, 2),
        "learner_share_of_online_serving": round(learn_s / spent["online"][0], 3),
        "updates": hist["updates_applied"] + hist["updates_rejected"],
        "threads": torch.get_num_threads(),
    }
    print("\nlearning overhead:", row)
    benchmark.extra_info.update(row)


def test_training_step_autocast(benchmark):
    torch.set_num_threads(1)
    model = osd.load_model(zoo_chat.DRAFT_DIR).requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 384), generator=gen)
    top_ids = torch.rand(768, model.head_vocab_size, generator=gen).topk(32).indices
    top_p = torch.softmax(torch.randn(768, 32, generator=gen), -1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    seconds = {"fp32": [], "bf16 autocast": []}

    def step(autocast: bool) -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            logits = model.forward_train(ids, full_vocab=False).flatten(0, 1)
        osd_kernels.distill_loss(logits, (top_ids, top_p), loss="fkl").backward()
        opt.step()
        return time.perf_counter() - t0

    def run():
        for _ in range(3):
            for name in seconds:
                seconds[name].append(step(name != "fp32"))

    benchmark.pedantic(run, rounds=1, iterations=1)
    best = {k: min(v) for k, v in seconds.items()}
    row = {
        "fp32_step_s": round(best["fp32"], 3),
        "bf16_autocast_step_s": round(best["bf16 autocast"], 3),
        "bf16_over_fp32": round(best["bf16 autocast"] / best["fp32"], 2),
        "cpu_has_fast_bf16": cpu_has_fast_bf16(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    print("\ntraining step:", row)
    benchmark.extra_info.update(row)


def test_training_step_context(benchmark):
    torch.set_num_threads(1)
    model = osd.load_model(zoo_chat.DRAFT_DIR).requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    examples = []
    for n in torch.linspace(81, 437, 16).long().tolist():
        tokens = torch.randint(0, model.config.vocab_size, (n + 48,), generator=gen)
        top_p = torch.softmax(torch.randn(48, 32, generator=gen), -1)
        examples.append(
            Example(
                tokens,
                torch.arange(n, n + 48),
                torch.randperm(8192, generator=gen)[:32].expand(48, 32).int(),
                top_p,
                None,
            )
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    batches = {n: batch_for(model, examples, n, "cpu") for n in (512, 128)}
    seconds = {n: [] for n in batches}

    def step(batch) -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        osd_kernels.distill_loss(
            draft_logits(model, batch), (batch.topk_ids, batch.topk_probs), loss="fkl"
        ).backward()
        opt.step()
        return time.perf_counter() - t0

    def run():
        for _ in range(3):
            for n, batch in batches.items():
                seconds[n].append(step(batch))

    benchmark.pedantic(run, rounds=1, iterations=1)
    best = {n: min(v) for n, v in seconds.items()}
    row = {
        "positions": batches[128].num_positions,
        "tokens_fed_512": int(batches[512].attention_mask.sum()),
        "tokens_fed_128": int(batches[128].attention_mask.sum()),
        "step_s_512": round(best[512], 3),
        "step_s_128": round(best[128], 3),
        "ratio": round(best[512] / best[128], 2),
    }
    print("\ntraining step by context:", row)
    benchmark.extra_info.update(row)


def test_alpha_over_requests(benchmark):
    # matplotlib loads only when a plot is drawn (it is slow to import), and its Agg
    # backend must be chosen before pyplot is imported
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"), see above

    prompts = zoo.query_stream("code", n=N, prompt_tokens=48, seed=4)
    static = _engine()
    online = _engine(
        osd.OnlineConfig(
            update_every_requests=4, steps_per_update=8, lr=5e-4, background=False, seed=0
        )
    )
    alphas = {"static": [], "online": []}

    def serve():
        for p in prompts:
            for name, eng in (("static", static), ("online", online)):
                alphas[name].append(eng.generate([p], PARAMS)[0].stats["alpha"])

    benchmark.pedantic(serve, rounds=1, iterations=1)
    w = 16
    rows = []
    for i in range(0, N, w):
        rows.append(
            (
                i,
                *(
                    sum(alphas[k][i : i + w]) / len(alphas[k][i : i + w])
                    for k in ("static", "online")
                ),
            )
        )
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in ("static", "online"):
        rolling = [alphas[k][max(0, i - w + 1) : i + 1] for i in range(N)]
        ax.plot(range(N), [sum(r) / len(r) for r in rolling], label=f"{k} draft")
    ax.set_xlabel("request")
    ax.set_ylabel(f"α = 1 − TV (rolling mean of {w})")
    ax.set_title("Built-in pair, code stream: static vs online draft")
    ax.legend()
    fig.tight_layout()
    os.makedirs(RESULTS, exist_ok=True)
    fig.savefig(os.path.join(RESULTS, "online_alpha.png"), dpi=120)
    plt.close(fig)
    lines = ["| requests | static α | online α |", "|---|---|---|"]
    lines += [f"| {i}–{min(i + w, N) - 1} | {a:.3f} | {b:.3f} |" for i, a, b in rows]
    print("\n" + "\n".join(lines))
    benchmark.extra_info.update(
        {
            "static_alpha_last": rows[-1][1],
            "online_alpha_last": rows[-1][2],
            "updates": online.stats["online"]["updates_applied"],
        }
    )
    assert rows[-1][2] > rows[-1][1]
