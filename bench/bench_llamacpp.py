"""osd against llama.cpp on the same GGUF file, per workload of the evaluation set.

The chat target (SmolLM2-135M-Instruct Q4_1, ``osd.zoo.chat.fetch_target()``), CPU,
``THREADS`` threads on both sides, batch 1, greedy, ``NEW_TOKENS`` new tokens per prompt
(EOS ignored on both sides, so every provider generates the same count: osd emits EOS
and goes on, llama.cpp bans it), end to end (prefill included), the same token ids (each
conversation through the target's chat template). Providers:

- ``osd-plain``: ``osd.Engine.from_pretrained(target, quantized=False)`` (weights
  dequantized to fp32);
- ``osd-quant-exact``: the same with ``quantized=True`` (the GGUF blocks kept, float32
  activations: the dequantized model's logits);
- ``osd-quant``: ``osd.Engine.from_pretrained(target)``, the CPU default (the GGUF blocks
  kept, int8 activations where the CPU has AVX-512 VNNI);
- ``osd-spec``: speculation as a user gets it by default,
  ``osd.Engine.from_pretrained(target, draft=osd.zoo.chat.chat_pair()[1])``: the target
  as loaded by default (kept quantized on the CPU) and the shipped draft's ``serving.json``
  settings for it (the table's notes print the ``SpecConfig`` served);
- ``llama.cpp-<mode>``: ``llama-server`` (``bench/llamacpp.py``: ``--poll 0``, ``-np 1``,
  ``/completion`` with token ids, ``cache_prompt: false``) in each mode of
  ``LLAMACPP_MODES``: ``plain`` and its n-gram modes; ``llama.cpp-draft``, the draft-model
  mode (``-md``), with the chat draft written as a GGUF file
  (:func:`osd.models.gguf.export.write_draft_gguf`, ``scripts/draft_to_gguf.py``; left out
  where its shape does not allow it), another GGUF file that
  ``OSD_BENCH_LLAMACPP_DRAFT`` names, or none with ``OSD_BENCH_LLAMACPP_DRAFT=none``.

Timing is interleaved prompt by prompt (every provider runs prompt i before any runs
prompt i+1), best of ``ROUNDS`` rounds per prompt. llama.cpp's time is the client's wall
time of the HTTP request (the server's own ``prompt_ms + predicted_ms`` is reported
beside it as ``server_tokens_per_s``). Before each round every ``llama-server`` is
restarted (untimed) and warmed up on a prompt outside the set, and the osd engines' lookup
history is cleared: ``ngram-mod`` and osd's ``lookup_history`` keep the answers of earlier
requests, and would otherwise draft a prompt's answer from its previous round (within a
round both draw on the round's earlier prompts).
Each workload prints a table: tokens/s per provider, its ratio to ``llama.cpp-plain`` and
to llama.cpp's best mode on that workload, and how many leading tokens it shares with
``osd-plain`` (mean over prompts: llama.cpp computes in its own precision, so its greedy
text leaves osd's after some tokens, and what the n-gram modes can copy differs with it).
``test_llama_bench`` runs ``llama-bench`` (decode and 128-token prefill) and
times osd's prefill of the same length.

The llama.cpp binaries come from ``scripts/build_llamacpp.sh`` (``make llamacpp``, which
``make bench`` runs first); without them the module is skipped, saying how to build them,
unless ``OSD_BUILD_LLAMACPP=1`` builds them here. ``OSD_BENCH_LLAMACPP_PROMPTS`` (prompts
per workload, default 4), ``_TOKENS`` (128), ``_THREADS`` (2), ``_ROUNDS`` (2),
``_MODES`` (comma-separated keys of ``bench.llamacpp.MODES``), ``_WORKLOADS``
(comma-separated names), ``OSD_BENCH_CHAT_TARGET`` (another GGUF; ``gemma``: Gemma 3 270M,
``osd.zoo.gemma``, asked in question-and-answer transcripts) and ``OSD_BENCH_CHAT_DRAFT``
(its draft directory; ``none``: osd's speculative row is prompt lookup alone over the
request and earlier answers) change the run.

    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_llamacpp.py \\
        --benchmark-json=results/bench_llamacpp.json
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import osd
from bench import llamacpp
from bench.common import bench_draft, bench_target
from osd import zoo
from osd.evaluate import settle_memory
from osd.chat_template import encode_chat
from osd.models.gguf.export import write_draft_gguf
from osd.zoo.workloads import evaluation_set

NEW_TOKENS = int(os.environ.get("OSD_BENCH_LLAMACPP_TOKENS", "128"))
NUM_PROMPTS = int(os.environ.get("OSD_BENCH_LLAMACPP_PROMPTS", "4"))
THREADS = int(os.environ.get("OSD_BENCH_LLAMACPP_THREADS", "2"))
NO_DRAFT_SPEC = osd.SpecConfig(drafter="ngram", num_draft_tokens=6, lookup_history=65536)
ROUNDS = int(os.environ.get("OSD_BENCH_LLAMACPP_ROUNDS", "2"))
LLAMACPP_MODES = [
    m
    for m in os.environ.get(
        "OSD_BENCH_LLAMACPP_MODES", "plain,ngram-simple,ngram-simple-short,ngram-map-k,ngram-mod"
    ).split(",")
    if m
]
LLAMACPP_DRAFT = os.environ.get("OSD_BENCH_LLAMACPP_DRAFT", "chat")  # a GGUF path, or none
WORKLOADS = os.environ.get("OSD_BENCH_LLAMACPP_WORKLOADS", "explain,summarise,multiturn,code")
OSD_PROVIDERS = ["osd-plain", "osd-quant-exact", "osd-quant", "osd-spec"]
MAX_SEQ_LEN = 2048


def _llama_providers(state) -> list[str]:
    return [f"llama.cpp-{m}" for m in LLAMACPP_MODES] + (
        ["llama.cpp-draft"] if state["llama_draft"] else []
    )


def _llama_draft(target: str, draft: str | None, tmp: str) -> str | None:
    """The GGUF file of the draft-model mode (see the module docstring), or None."""
    if LLAMACPP_DRAFT.lower() in ("", "none", "0") or draft is None:
        return None
    if LLAMACPP_DRAFT != "chat":
        return LLAMACPP_DRAFT
    out = os.path.join(tmp, "chat_draft.gguf")
    try:
        write_draft_gguf(target, draft, out)
    except ValueError as exc:  # the draft's shape does not fit llama.cpp's draft mode
        print(f"\nllama.cpp-draft left out: {exc}")
        return None
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bins = llamacpp.find_binaries()
    if bins is None:
        pytest.skip(llamacpp.missing_reason())
    for m in LLAMACPP_MODES:
        if m not in llamacpp.MODES:
            pytest.fail(
                f"OSD_BENCH_LLAMACPP_MODES: unknown mode {m!r}; one of {sorted(llamacpp.MODES)}"
            )
    try:
        target, draft = zoo.chat_pair()
    except Exception as exc:  # pragma: no cover - offline machines
        pytest.skip(f"the chat target is not available: {exc}")
    if draft is None and not os.environ.get("OSD_BENCH_CHAT_DRAFT"):
        pytest.skip(zoo.locate.missing_message("chat_draft"))
    target, draft = bench_target(target), bench_draft(draft)
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    kw = dict(max_batch_size=1, max_seq_len=MAX_SEQ_LEN)
    engines = {
        "osd-plain": osd.Engine.from_pretrained(target, quantized=False, **kw),
        "osd-quant-exact": osd.Engine.from_pretrained(target, quantized=True, **kw),
        "osd-quant": osd.Engine.from_pretrained(target, **kw),
        # without a draft: prompt lookup over the request and earlier answers
        "osd-spec": osd.Engine.from_pretrained(
            target, draft=draft, spec=None if draft else NO_DRAFT_SPEC, **kw
        ),
    }
    settle_memory()  # no engine favoured by being built last
    tok = engines["osd-plain"].tokenizer
    wanted = [w for w in WORKLOADS.split(",") if w]
    workloads = {
        w.name: encode_chat(tok, list(w.prompts))
        for w in evaluation_set(n=NUM_PROMPTS)
        if w.name in wanted
    }
    # A warm-up prompt outside the timed set (another seed), one per restart of the servers.
    warm = encode_chat(tok, [evaluation_set(n=1, seed=12345)[0].prompts[0]])[0]
    longest = max(len(p) for ps in workloads.values() for p in ps)
    ctx = max(MAX_SEQ_LEN, longest + NEW_TOKENS + 64)
    state = {
        "bins": bins,
        "target": target,
        "draft": draft,
        "engines": engines,
        "workloads": workloads,
        "warm": warm,
        "ctx": ctx,
        "servers": {},
        "llama_draft": _llama_draft(target, draft, str(tmp_path_factory.mktemp("llamacpp"))),
    }
    yield state
    _stop_servers(state)
    for eng in engines.values():
        eng.close()
    torch.set_num_threads(before)


def _stop_servers(state) -> None:
    for srv in state["servers"].values():
        srv.close()
    state["servers"] = {}


def _restart_servers(state) -> None:
    """Fresh llama-servers, one per provider, each warmed up on the warm-up prompt; the osd
    engines forget the answers their prompt lookup keeps (``lookup_history``), as the
    restarted servers forget theirs."""
    for eng in state["engines"].values():
        if eng.lookup_history is not None:
            eng.lookup_history.clear()
    _stop_servers(state)
    for prov in _llama_providers(state):
        mode = prov[len("llama.cpp-") :]
        srv = llamacpp.Server(
            state["bins"],
            state["target"],
            threads=THREADS,
            ctx=state["ctx"],
            mode=mode,
            draft=state["llama_draft"] if mode == "draft" else None,
        )
        state["servers"][prov] = srv
        srv.complete(state["warm"], 16)


def _run(state, prov: str, prompt: list[int]) -> tuple[list[int], float, dict]:
    """``(tokens, wall seconds, extra)`` of one request."""
    if prov.startswith("osd"):
        params = osd.SamplingParams(NEW_TOKENS, ignore_eos=True)
        t0 = time.perf_counter()
        out = state["engines"][prov].generate([prompt], params)[0]
        return list(out.token_ids), time.perf_counter() - t0, {}
    c = state["servers"][prov].complete(prompt, NEW_TOKENS)
    return c.tokens, c.wall_s, c.timings


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _served(eng) -> str:
    """The speculation an engine serves, in short: drafter, k, lookup, and whether its
    target is kept quantized."""
    sp = eng.spec
    if sp is None:
        return "plain"
    out = [f"drafter={sp.drafter}", f"k={sp.num_draft_tokens}"]
    if sp.prompt_lookup:
        out.append("prompt_lookup")
    if sp.lookup_tree_below:
        out.append(f"lookup_tree_below={sp.lookup_tree_below}")
    quant = any(type(m).__name__.startswith("Quant") for m in eng.model.modules())
    out.append("target quantized" if quant else "target fp32")
    return ", ".join(out)


def _table(name: str, n: int, rows: dict) -> str:
    base = rows.get("llama.cpp-plain", {}).get("tokens_per_s")
    best = max(
        (r["tokens_per_s"] for p, r in rows.items() if p.startswith("llama.cpp")), default=None
    )
    lines = [
        f"workload {name}: {n} prompts, {NEW_TOKENS} new tokens, {THREADS} threads, "
        f"batch 1, greedy, end to end (best of {ROUNDS})",
        f"{'provider':<28}{'tok/s':>8}{'vs llama.cpp plain':>20}{'vs llama.cpp best':>19}"
        f"{'same as osd-plain':>19}  notes (llama.cpp: accepted / drafted tokens)",
    ]
    for prov, r in rows.items():
        tps = r["tokens_per_s"]
        notes = []
        if "server_tokens_per_s" in r:
            notes.append(f"server-side {r['server_tokens_per_s']:.1f} tok/s")
        if r.get("accepted_per_draft") is not None:
            notes.append(f"accepted {r['accepted_per_draft']:.2f} of drafted")
        if r.get("mean_accepted_length") is not None:
            notes.append(f"tokens per verify {r['mean_accepted_length']:.2f}")
        if r.get("served"):
            notes.append(r["served"])
        same = f"{r['same_as_plain']:.0f}/{NEW_TOKENS}"
        lines.append(
            f"{prov:<28}{tps:>8.1f}"
            f"{(f'{tps / base:.2f}x' if base else '-'):>20}"
            f"{(f'{tps / best:.2f}x' if best else '-'):>19}"
            f"{same:>19}  {'; '.join(notes)}"
        )
    return "\n".join(lines)


@pytest.mark.parametrize("workload", WORKLOADS.split(","))
def test_llamacpp(benchmark, setup, workload, capsys):
    if workload not in setup["workloads"]:
        pytest.skip(f"no workload {workload!r} in the evaluation set")
    prompts = setup["workloads"][workload]
    providers = OSD_PROVIDERS + _llama_providers(setup)
    n = len(prompts)
    best = {p: [float("inf")] * n for p in providers}
    outs: dict[str, list] = {p: [None] * n for p in providers}
    timings: dict[str, list] = {p: [{}] * n for p in providers}
    for prov in ("osd-spec",):
        setup["engines"][prov].reset_stats()

    def one_round():
        for i, prompt in enumerate(prompts):
            for prov in providers:
                toks, wall, extra = _run(setup, prov, prompt)
                if wall < best[prov][i]:
                    best[prov][i], timings[prov][i] = wall, extra
                outs[prov][i] = toks

    benchmark.pedantic(
        one_round, setup=lambda: _restart_servers(setup), rounds=ROUNDS, iterations=1
    )
    rows = {}
    for prov in providers:
        tokens = sum(len(o) for o in outs[prov])
        row = {
            "tokens_per_s": tokens / sum(best[prov]),
            "tokens": tokens,
            # tokens equal to osd-plain's before the first that differs, mean over prompts
            "same_as_plain": sum(_common(o, r) for o, r in zip(outs[prov], outs["osd-plain"])) / n,
        }
        if prov.startswith("llama.cpp"):
            t = timings[prov]
            ms = sum(x.get("prompt_ms", 0.0) + x.get("predicted_ms", 0.0) for x in t)
            row["server_tokens_per_s"] = (
                sum(x.get("predicted_n", 0) for x in t) / ms * 1e3 if ms else None
            )
            drafted = sum(x.get("draft_n", 0) for x in t)
            if drafted:
                row["accepted_per_draft"] = sum(x.get("draft_n_accepted", 0) for x in t) / drafted
        elif prov == "osd-spec":
            eng = setup["engines"][prov]
            row["mean_accepted_length"] = eng.stats.get("mean_accepted_length")
            row["served"] = _served(eng)
        rows[prov] = row
    table = _table(workload, n, rows)
    benchmark.extra_info.update(
        {
            "workload": workload,
            "prompts": n,
            "new_tokens": NEW_TOKENS,
            "threads": THREADS,
            "rows": rows,
        }
    )
    with capsys.disabled():
        print("\n" + table)


def test_llama_bench(benchmark, setup, capsys):
    """llama-bench's decode and prefill rates on the target beside osd's prefill of a
    prompt of the same length (one new token, best of 3)."""
    _stop_servers(setup)
    n_prompt = 128
    lb = llamacpp.llama_bench(
        setup["bins"], setup["target"], threads=THREADS, n_prompt=n_prompt, n_gen=NEW_TOKENS
    )
    prompt = (setup["warm"] * (n_prompt // len(setup["warm"]) + 1))[:n_prompt]
    prefill = {}

    def measure():
        for prov in ("osd-plain", "osd-quant-exact", "osd-quant"):
            eng = setup["engines"][prov]
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                eng.generate([prompt], osd.SamplingParams(1))
                ts.append(time.perf_counter() - t0)
            prefill[prov] = n_prompt / min(ts)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    info = {
        "llama_bench_tg": lb.get("tg"),
        "llama_bench_pp": lb.get("pp"),
        **{f"{p}_prefill": v for p, v in prefill.items()},
    }
    benchmark.extra_info.update(info)
    lines = [
        f"llama-bench ({THREADS} threads): decode {lb.get('tg', 0):.1f} tok/s "
        f"(tg{NEW_TOKENS}), prefill {lb.get('pp', 0):.1f} tok/s (pp{n_prompt})"
    ]
    for p, v in prefill.items():
        ratio = f" ({v / lb['pp']:.2f}x llama-bench pp{n_prompt})" if lb.get("pp") else ""
        lines.append(f"{p} prefill of {n_prompt} tokens, end to end: {v:.1f} tok/s{ratio}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
