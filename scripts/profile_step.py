"""Where a CPU decode step's time goes: the chat target at batch 1, step by step.

The chat pair (``osd.zoo.chat_pair()``: the SmolLM2-135M-Instruct GGUF, its weights kept
quantized on the CPU as ``Engine.from_pretrained`` does by default, and its draft) at
batch 1, greedy, ``--threads`` torch threads (default 2), in three configurations:

- ``plain``: ``Engine.from_pretrained(target)``, one token per step;
- ``draft``: the draft model with the settings its ``serving.json`` recommends beside a
  float target (``"spec"``: a chain of 3 with prompt-lookup trees, the draft in Q8_0);
- ``lookup``: ``Engine.from_pretrained(target, draft=draft)`` as a user gets it beside a
  quantized target: the draft's ``"quantized_target"`` settings, prompt lookup alone.

One step is one ``Engine.step()`` after the prompt's (the prefill step is left out),
timed between the yields of ``Engine.stream``, over ``--prompts`` chat prompts of the
evaluation set's "explain" workload, ``--tokens`` new tokens each. Each prompt runs in
three modes, alternating, ``--rounds`` times:

- ``real``: the engine as it is;
- ``python-loop``: the same with the fused CPU layers' ops called from Python
  (``fused_layers.LOOP_IN_CPP = False``) instead of looped in C++ (``decoder_layers``);
  the stand-in modes below patch Python functions, so they run this loop too;
- ``no-weights``: the target's quantized layers (projections and output head) return
  without reading a weight;
- ``no-kernels``: the same, and the target's attention returns zeros without reading the
  cache;
- ``no-forward``: the target's whole cached forward returns at once.

In both stand-in modes the target's logits are one-hot on the token the real run produced
after each position, so every greedy step accepts and emits exactly what it did for real
(the outputs are checked equal). So ``python-loop - no-weights`` is the time of the
weight kernels (the GEMVs), ``no-weights - no-kernels`` attention's, ``no-kernels -
no-forward`` the rest of the target's forward (the layers' Python and the small ops around
the kernels: norms' glue, RoPE, the K/V writes, residual adds, SiLU), and ``no-forward`` what
the step does outside the target's forward (scheduling, the drafter,
the sampler, the read-back, appending tokens, and the stand-in's own one-hot logits). The
means leave out the slowest ``TRIM`` of the steps: on a shared machine a step that waited
for a core says nothing about the code. A ``torch.profiler`` pass (CPU, ``record_shapes``
off) of the real mode then lists the op calls per step and the top ops by self time;
the profiler slows every op call, parallel ones most, so its times are inflated (the
table gives its own profiled step time beside them).

Memory traffic: a decode step reads every weight of the target once (the quantized
layers' blocks as stored, the norms; one row of the embedding) and the cache's K/V up to
the current length. The machine's read bandwidth is measured here (``torch.sum`` over
``--bw-mib`` MiB, best of several; a copy's read + write beside it); bytes over bandwidth
is the plain decode roofline, and the weight bytes over the GEMVs' time their bandwidth.

    .venv/bin/python scripts/profile_step.py [--json out.json] [--py-spy]
    .venv/bin/python scripts/profile_step.py --compare /tmp/osd_before [--rounds 4]

``--py-spy`` samples one more pass of each configuration with py-spy (when installed) and
lists the osd functions the step's Python time is spent in. ``--compare TREE`` times the
steps of this tree against another checkout of the project (a ``git worktree`` or
``git archive`` of an older commit, with the built ``osd_kernels/_C*.so`` copied in),
each in a subprocess, alternating the two trees round by round, and prints the µs per
step each one takes, real and without the target's forward, and the differences; the
outputs must agree token for token.
"""

from __future__ import annotations

import osd  # first: sets GOMP_SPINCOUNT before torch loads libgomp

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402

from osd.chat_template import apply_chat_template
from osd.models import fused_layers
from osd.models.attention import attention as real_attention
from osd.models.layers import project_rows as real_project_rows
from osd.models.quant import QuantLinear
from osd.spec import draft_serving_defaults
from osd.zoo import chat_pair
from osd.zoo.workloads import evaluation_set
from osd_kernels.quant_linear import quant_linear as real_quant_linear

CONFIGS = ("plain", "draft", "lookup")
MODES = ("real", "python-loop", "no-weights", "no-kernels", "no-forward")
TOP_OPS = 15
STEP = "osd_step"  # the profiler range of one engine step
TRIM = 0.2  # the slowest fifth of the steps is left out of the means


def build_engine(name: str, target: str, draft: str) -> osd.Engine:
    """The engine of configuration ``name`` (see the module docstring), batch 1."""
    if name == "plain":
        return osd.Engine.from_pretrained(target, max_batch_size=1)
    if name == "draft":
        spec = draft_serving_defaults(draft)[0]
        return osd.Engine.from_pretrained(target, draft=draft, spec=spec, max_batch_size=1)
    if name == "lookup":
        return osd.Engine.from_pretrained(target, draft=draft, max_batch_size=1)
    raise ValueError(f"unknown configuration {name!r} (one of {', '.join(CONFIGS)})")


def prompts_of(engine: osd.Engine, n: int) -> list[list[int]]:
    """Token ids of the first ``n`` prompts of the evaluation set's "explain" workload."""
    explain = next(w for w in evaluation_set(n=n) if w.name == "explain")
    return apply_chat_template(engine.tokenizer, [list(p) for p in explain.prompts])


class StandIns:
    """The stand-in modes of one engine's target (see the module docstring). ``mode`` is
    ``"real"`` between steps and during the prefill step; :meth:`replay` sets the real
    sequence whose next tokens the stand-in logits pick."""

    def __init__(self, engine: osd.Engine) -> None:
        self.model = model = engine.model
        self.mode = "real"
        self.next_ids = torch.zeros(1, dtype=torch.int64)
        self.positions = None  # [B, T] of the forward running now
        self.widths = {
            id(m.qweight): m.out_features for m in model.modules() if isinstance(m, QuantLinear)
        }
        self.head = id(model.lm_head.qweight) if isinstance(model.lm_head, QuantLinear) else None
        self.kv = engine.lanes[0].cache.kv.untyped_storage().data_ptr()
        real_forward = model.forward

        def forward(input_ids, cache, *args, **kwargs):
            B, T = input_ids.shape
            depths = kwargs.get("depths")
            offsets = torch.arange(T) if depths is None else depths
            self.positions = cache.lens[:B, None].long() + offsets
            if self.mode == "no-forward":
                return self.logits()
            return real_forward(input_ids, cache, *args, **kwargs)

        model.forward = forward
        # every osd module's binding of the two is replaced (the layers call them directly)
        for name, module in list(sys.modules.items()):
            if name.startswith(("osd.", "osd_kernels.")):
                if getattr(module, "quant_linear", None) is real_quant_linear:
                    module.quant_linear = _quant_linear_stand_in
                if getattr(module, "project_rows", None) is real_project_rows:
                    module.project_rows = _project_rows_stand_in  # the fused CPU layers
                if getattr(module, "attention", None) is real_attention:
                    module.attention = _attention_stand_in
        _STAND_INS.append(self)

    def replay(self, sequence: list[int]) -> None:
        """The real run's tokens (prompt and output): position ``p``'s logits pick
        ``sequence[p + 1]``."""
        self.next_ids = torch.tensor(sequence[1:] + [0], dtype=torch.int64)

    def logits(self) -> torch.Tensor:
        """``[B, T, V]`` one-hot logits on the real next token of each position."""
        pos = self.positions.clamp(max=len(self.next_ids) - 1)
        out = torch.zeros(*pos.shape, self.model.vocab_size)
        return out.scatter_(-1, self.next_ids[pos][..., None], 1.0)

    def answer(self, x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor | None:
        """A quantized layer's output in the ``no-weights`` mode, None otherwise."""
        if self.mode not in ("no-weights", "no-kernels") or id(qweight) not in self.widths:
            return None
        if id(qweight) == self.head:
            return self.logits().view(*x.shape[:-1], -1)
        return x.new_zeros(*x.shape[:-1], self.widths[id(qweight)])


_STAND_INS: list[StandIns] = []


def _quant_linear_stand_in(x, qweight, *args, **kwargs):
    for s in _STAND_INS:
        out = s.answer(x, qweight)
        if out is not None:
            return out
    return real_quant_linear(x, qweight, *args, **kwargs)


def _project_rows_stand_in(x, layer, *args, **kwargs):
    if isinstance(layer, QuantLinear):
        for s in _STAND_INS:
            out = s.answer(x, layer.qweight)
            if out is not None:
                return out
    return real_project_rows(x, layer, *args, **kwargs)


def _attention_stand_in(q, k_cache, *args, **kwargs):
    ptr = k_cache.untyped_storage().data_ptr()
    if any(s.mode == "no-kernels" and s.kv == ptr for s in _STAND_INS):
        return torch.zeros_like(q)
    return real_attention(q, k_cache, *args, **kwargs)


def run_steps(engine, ids: list[int], tokens: int, stand_ins=None, mode="real", profiler=None):
    """Generate ``tokens`` greedy tokens from ``ids``; returns the wall of every step after
    the prefill step, the tokens each emitted, and the output ids. ``mode`` holds from the
    second step on; ``profiler`` (a ``torch.profiler.profile``) is started then and
    stopped at the end, each step inside a ``record_function(STEP)`` range."""
    params = osd.SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    out, walls, emitted = [], [], []
    steps = engine.stream(ids, params)
    out += next(steps)  # the prefill step (and the first decode step with it)
    if stand_ins is not None:
        stand_ins.mode = mode
    if profiler is not None:
        profiler.start()
    try:
        while True:
            t0 = time.perf_counter()
            if profiler is None:
                new = next(steps, None)
            else:
                with torch.profiler.record_function(STEP):
                    new = next(steps, None)
            if new is None:
                break
            walls.append(time.perf_counter() - t0)
            emitted.append(len(new))
            out += new
    finally:
        if stand_ins is not None:
            stand_ins.mode = "real"
    if profiler is not None:
        profiler.stop()
    return walls, emitted, out


def kept(values: list[float]) -> list[int]:
    """Indices of ``values`` without the slowest ``TRIM`` of them."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[: max(1, round(len(values) * (1 - TRIM)))]


def trimmed_us(walls: list[float]) -> float:
    return statistics.fmean(walls[i] for i in kept(walls)) * 1e6


def timed_modes(engine, stand_ins, prompts, tokens: int, rounds: int, modes=MODES) -> dict:
    """``{mode: {"walls", "emitted"}}`` over ``rounds`` x ``prompts``, the ``modes``
    alternating prompt by prompt, and ``"digest"`` of the real outputs; raises if a
    stand-in mode emitted other tokens than the real one."""
    others = [m for m in MODES if m in modes and m != "real"]
    got = {m: {"walls": [], "emitted": []} for m in ["real", *others]}
    digest = hashlib.sha256()
    for r in range(rounds):
        for ids in prompts:
            # the real run first (the stand-ins replay it), then the others in turn
            for mode in ["real", *(others if r % 2 == 0 else others[::-1])]:
                fused_layers.LOOP_IN_CPP = mode == "real"
                try:
                    w, e, out = run_steps(engine, ids, tokens, stand_ins, mode)
                finally:
                    fused_layers.LOOP_IN_CPP = True
                if mode == "real":
                    real = out
                    stand_ins.replay(ids + out)
                    if r == 0:
                        digest.update(json.dumps(out).encode())
                elif out != real:
                    raise RuntimeError(f"the {mode} mode emitted other tokens than the real run")
                got[mode]["walls"] += w
                got[mode]["emitted"] += e
    got["digest"] = digest.hexdigest()[:16]
    return got


def profiled_steps(engine, prompts, tokens) -> list[tuple[float, Counter, Counter]]:
    """Per step under the profiler: ``(wall µs, {op: self µs}, {op: calls})``, every op
    the step ran (nested ones included, each with its self time)."""
    steps = []
    for ids in prompts:
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False
        )
        run_steps(engine, ids, tokens, profiler=prof)
        for evt in prof.events():
            if evt.name != STEP:
                continue
            us, calls = Counter(), Counter()
            todo = list(evt.cpu_children)
            while todo:
                op = todo.pop()
                us[op.key] += op.self_cpu_time_total
                calls[op.key] += 1
                todo += op.cpu_children
            steps.append((evt.cpu_time_total, us, calls))
    return steps


def weight_bytes(model) -> dict:
    """Bytes a decode step reads from the target's weights: every quantized layer (all
    its buffers), every other parameter except the input embedding (of which one row is
    read), and that row."""
    quant = sum(
        sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
        for m in model.modules()
        if isinstance(m, QuantLinear)
    )
    embed = model.embed_tokens.weight
    seen = {id(embed)}
    other = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            other += p.numel() * p.element_size()
    row = embed.shape[1] * embed.element_size()
    return {"quantized": quant, "float": other, "embedding_row": row, "total": quant + other + row}


def kv_bytes_per_position(engine) -> int:
    """Bytes of K and V one cached position holds over all layers."""
    c, kv = engine.model.config, engine.lanes[0].cache.kv
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * kv.element_size()


def bandwidth(mib: int, reps: int = 9) -> dict:
    """The machine's memory bandwidth through torch: ``sum`` of a ``mib`` MiB float32 tensor
    (bytes read per second) and ``copy_`` into another (bytes read + written), best of
    ``reps``."""
    n = mib * 2**20 // 4
    a = torch.ones(n)
    b = torch.empty_like(a)
    best_sum = best_copy = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a.sum()
        t1 = time.perf_counter()
        b.copy_(a)
        t2 = time.perf_counter()
        best_sum, best_copy = min(best_sum, t1 - t0), min(best_copy, t2 - t1)
    nbytes = n * 4
    return {
        "read_gbs": nbytes / best_sum / 1e9,
        "copy_gbs": 2 * nbytes / best_copy / 1e9,
        "mib": mib,
    }


def summarise(name: str, timed: dict, steps: list) -> dict:
    """The report row of a configuration: trimmed means (see :func:`kept`) of each mode's
    walls and of the profiled pass's op times."""
    real = timed["real"]
    walls, emitted = real["walls"], real["emitted"]
    keep = kept(walls)
    us = {m: trimmed_us(timed[m]["walls"]) for m in MODES}
    quiet = [steps[i] for i in kept([w for w, _, _ in steps])]
    op_us, calls = Counter(), Counter()
    for _, u, c in quiet:
        op_us.update(u)
        calls.update(c)
    n = len(quiet)
    return {
        "config": name,
        "steps": len(walls),
        "median_us": statistics.median(walls) * 1e6,
        "us": us,
        "tokens_per_step": sum(emitted) / len(walls),
        "tokens_per_s": sum(emitted[i] for i in keep) / sum(walls[i] for i in keep),
        "gemv_us": us["python-loop"] - us["no-weights"],
        "attention_us": us["no-weights"] - us["no-kernels"],
        "cpp_loop_saves_us": us["python-loop"] - us["real"],
        "forward_rest_us": us["no-kernels"] - us["no-forward"],
        "outside_us": us["no-forward"],
        "profiled_us": statistics.fmean(w for w, _, _ in quiet),
        "profiled_op_us": sum(op_us.values()) / n,
        "op_calls": sum(calls.values()) / n,
        "top_ops": [
            {"op": k, "calls": calls[k] / n, "us": v / n} for k, v in op_us.most_common(TOP_OPS)
        ],
        "digest": timed["digest"],
    }


def pyspy_summary(name: str, args) -> list[tuple[str, float]] | None:
    """py-spy samples of the real steps of ``name``: the share of step samples whose
    deepest osd / osd_kernels frame is each function (what Python spends the step in, the
    torch calls it makes included). None when py-spy is not installed."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw.txt")
        child = [sys.executable, __file__, "--only", name, "--timing-only", "--json", os.devnull]
        child += ["--tokens", str(args.tokens), "--prompts", str(args.prompts)]
        child += ["--threads", str(args.threads), "--rounds", "1", "--modes", "real"]
        cmd = [exe, "record", "-r", "500", "-f", "raw", "-o", raw, "--", *child]
        subprocess.run(cmd, check=True, capture_output=True)
        counts: Counter = Counter()
        total = 0
        with open(raw) as f:
            for line in f:
                stack, _, n = line.rstrip().rpartition(" ")
                frames = stack.split(";")
                if not any(fr.startswith("Scheduler.step ") for fr in frames):
                    continue
                total += int(n)
                ours = [fr for fr in frames if "osd/" in fr or "osd_kernels/" in fr]
                counts[ours[-1].split(" (")[0] if ours else "(other)"] += int(n)
    return [(k, v / total) for k, v in counts.most_common(TOP_OPS)] if total else []


def profile(args) -> dict:
    torch.set_num_threads(args.threads)
    target, draft = chat_pair()
    report = {"threads": args.threads, "tokens": args.tokens, "prompts": args.prompts}
    report["rounds"] = args.rounds
    report["osd_path"] = os.path.dirname(osd.__file__)
    report["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    report["gomp_spincount"] = os.environ.get("GOMP_SPINCOUNT")
    report["load_before"] = os.getloadavg()[0]
    if not args.timing_only:
        report["bandwidth"] = bandwidth(args.bw_mib)
    report["configs"] = {}
    for name in args.only or CONFIGS:
        engine = build_engine(name, target, draft)
        stand_ins = StandIns(engine)
        prompts = prompts_of(engine, args.prompts)
        if name == "plain" and not args.timing_only:
            report["weights"] = weight_bytes(engine.model)
            report["kv_bytes_per_position"] = kv_bytes_per_position(engine)
            report["mean_context"] = statistics.fmean(len(p) for p in prompts) + args.tokens / 2
        run_steps(engine, prompts[0], min(args.tokens, 32))  # warm-up
        timed = timed_modes(engine, stand_ins, prompts, args.tokens, args.rounds, args.modes)
        if args.timing_only:
            report["configs"][name] = timed
            continue
        row = summarise(name, timed, profiled_steps(engine, prompts, args.tokens))
        if args.py_spy:
            row["py_spy"] = pyspy_summary(name, args)
        report["configs"][name] = row
        _STAND_INS.remove(stand_ins)
        del engine, stand_ins
    report["load_after"] = os.getloadavg()[0]
    return report


def print_report(report: dict) -> None:
    rows = report["configs"]
    print(
        f"\nchat target Q4_1 kept quantized, batch 1, {report['threads']} threads, greedy, "
        f"{report['prompts']} prompts x {report['tokens']} new tokens x {report['rounds']} "
        f"rounds; means without the slowest {TRIM:.0%} of the steps; OMP_WAIT_POLICY="
        f"{report['omp_wait_policy']}, GOMP_SPINCOUNT={report['gomp_spincount']}; "
        f"load average {report['load_before']:.1f} before, "
        f"{report['load_after']:.1f} after"
    )
    print(
        "| config | µs/step (median) | µs/step (mean) | tokens/step | tokens/s "
        "| op calls/step | µs/step, layers looped in Python | of which: weight GEMVs "
        "| attention | rest of the target's forward | outside the target's forward |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows.values():
        slow = r["us"]["python-loop"]
        parts = [r["gemv_us"], r["attention_us"], r["forward_rest_us"], r["outside_us"]]
        print(
            f"| {r['config']} | {r['median_us']:.0f} | {r['us']['real']:.0f} | "
            f"{r['tokens_per_step']:.2f} | {r['tokens_per_s']:.1f} | {r['op_calls']:.0f} | "
            f"{slow:.0f} | " + " | ".join(f"{p:.0f} ({p / slow:.0%})" for p in parts) + " |"
        )
    for r in rows.values():
        print(
            f"\n{r['config']}: top {TOP_OPS} ops by self time under the profiler (profiled "
            f"step {r['profiled_us']:.0f} µs, {r['profiled_op_us']:.0f} of it in ops)"
        )
        print("| op | calls/step | µs/step | share of the profiled step |")
        print("|---|---|---|---|")
        for o in r["top_ops"]:
            share = o["us"] / r["profiled_us"]
            print(f"| `{o['op']}` | {o['calls']:.1f} | {o['us']:.0f} | {share:.1%} |")
        if r.get("py_spy"):
            print(f"\n{r['config']}: py-spy, share of step samples by the deepest osd frame")
            for fn, share in r["py_spy"]:
                print(f"  {share:6.1%}  {fn}")
    if "bandwidth" in report and "weights" in report:  # the memory line needs the plain run
        bw, w = report["bandwidth"], report["weights"]
        kv = report["kv_bytes_per_position"] * report["mean_context"]
        roof = bw["read_gbs"] * 1e9 / (w["total"] + kv)
        print(
            f"\nmemory: read {bw['read_gbs']:.1f} GB/s (sum), copy {bw['copy_gbs']:.1f} GB/s "
            f"(read + write); a decode step reads {w['total'] / 1e6:.1f} MB of weights "
            f"(quantized {w['quantized'] / 1e6:.1f}, float {w['float'] / 1e6:.2f}) + "
            f"{kv / 1e6:.1f} MB of K/V at the mean context of {report['mean_context']:.0f}: "
            f"roofline {roof:.0f} tokens/s"
        )
        plain = rows.get("plain")
        if plain:
            print(
                f"plain decode at {plain['tokens_per_s'] / roof:.0%} of it; its weight GEMVs "
                f"read {w['quantized'] / plain['gemv_us'] / 1e3:.1f} GB/s"
            )


def compare(args) -> None:
    """Time this tree's steps against ``args.compare``'s, alternating, and print both."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"before": os.path.abspath(args.compare), "after": here}
    configs = args.only or CONFIGS
    modes = ("real", "no-forward")
    rounds: dict = {t: {(c, m): [] for c in configs for m in modes} for t in trees}
    digests: dict = {}
    for i in range(args.rounds):
        for tree in list(trees) if i % 2 == 0 else list(trees)[::-1]:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = [sys.executable, os.path.abspath(__file__), "--timing-only"]
                cmd += ["--json", out.name, "--tokens", str(args.tokens), "--rounds", "1"]
                cmd += ["--prompts", str(args.prompts), "--threads", str(args.threads)]
                cmd += [x for c in configs for x in ("--only", c)] + ["--modes", *modes]
                env = {**os.environ, "PYTHONPATH": trees[tree]}
                subprocess.run(cmd, check=True, cwd=trees[tree], env=env)
                with open(out.name) as f:
                    got = json.load(f)
            assert got["osd_path"].startswith(trees[tree]), (got["osd_path"], trees[tree])
            for c, r in got["configs"].items():
                for m in modes:
                    rounds[tree][c, m].append(trimmed_us(r[m]["walls"]))
                digests.setdefault(c, set()).add(r["digest"])
            print(f"round {i + 1}/{args.rounds}: {tree} done", file=sys.stderr)
    print(
        f"\nbefore: {trees['before']}\nafter: {trees['after']}\n{args.rounds} rounds per tree, "
        f"alternating; {args.prompts} prompts x {args.tokens} tokens, {args.threads} threads"
    )
    print(
        "| config | mode | before µs/step | after µs/step | saved µs/step (median of the "
        "rounds' differences) | rounds where after was faster | outputs equal |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        for m in modes:
            b, a = rounds["before"][c, m], rounds["after"][c, m]
            diffs = [x - y for x, y in zip(b, a)]
            print(
                f"| {c} | {m} | {statistics.median(b):.0f} | {statistics.median(a):.0f} | "
                f"{statistics.median(diffs):.0f} | {sum(d > 0 for d in diffs)}/{len(diffs)} | "
                f"{len(digests[c]) == 1} |"
            )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--prompts", type=int, default=2, help="explain prompts to run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--rounds", type=int, default=2, help="rounds of every mode (--compare: per tree)"
    )
    p.add_argument("--only", action="append", choices=CONFIGS, help="run only these configs")
    p.add_argument("--bw-mib", type=int, default=512, help="MiB of the bandwidth test")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--py-spy", action="store_true", help="add a py-spy summary per config")
    p.add_argument("--timing-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--modes", nargs="+", choices=MODES, default=MODES, help=argparse.SUPPRESS)
    p.add_argument("--compare", help="another checkout to time against, interleaved")
    args = p.parse_args(argv)
    if args.compare:
        compare(args)
        return
    report = profile(args)
    if not args.timing_only:
        print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
