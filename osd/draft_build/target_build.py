"""``osd draft build --target PATH``: a draft for any target ``osd.Engine.from_pretrained``
loads, its stages put together, resumable.

Stages, in the time budget ``--minutes`` (every run's time counts, so an interrupted build
that is run again finishes by the same total):

1. teacher data, until ``--data-share`` of the budget or every prompt is answered: the
   target answers generic prompts (:mod:`osd.draft_build.target_data`), saved as they come;
2. head vocabulary (a large vocabulary only): the tokens the teacher data expects most;
3. training (:mod:`osd.draft_build.target_train`), checkpointed, until the time left is
   what the last stage needs; the draft is written to ``--out``;
4. serving measurement (:mod:`osd.draft_build.tune`): ``serving.json``, then ``build.json``.

The work lives in ``OUT/.build`` (``state.json``, the prompts, the teacher's shards, the
head vocabulary, the training checkpoint); a rerun with the same ``--out`` continues
where the last one stopped. A finished build keeps the teacher data there (``--reuse-data``
trains again on it) and drops the training checkpoint.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import shutil
import signal
import threading
import time
from dataclasses import asdict, replace

import torch

import osd
from osd.draft_build.cli import command_line
from osd.draft_build.common import ThreadTuner, clock, log, split_heldout
from osd.draft_build.recipe import DATA, TRAIN, DraftShape
from osd.draft_build.shape import choose_head_vocab, choose_shape, teacher_batch
from osd.draft_build.target_data import (
    TeacherStore,
    answer,
    build_head_vocab,
    make_prompts,
    measure_prompts,
    save_json,
)
from osd.draft_build.target_train import (
    evaluate,
    init_draft,
    map_examples,
    projection,
    save_draft,
    train,
)
from osd.draft_build.tune import measure_serving
from osd.models.loading import is_gguf_source, load_tokenizer
from osd.online.config import cpu_has_fast_bf16
from osd.spec import SERVING_FILE
from osd.zoo import locate

WORK_DIR = ".build"
STATE_FILE = "state.json"
CLOCK_FILE = "clock.json"
FORMAT = 1
# The files a build writes into --out (--fresh removes these and the work directory only).
DRAFT_FILES = ("config.json", "model.safetensors", "head_vocab.json", SERVING_FILE, "build.json")
MEASURE_PROMPTS = 6


def default_out(target: str) -> str:
    """``drafts/<target name>`` beside the zoo's cache (``~/.cache/osd/drafts/...``)."""
    name = os.path.basename(os.path.normpath(target))
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return os.path.join(os.path.dirname(locate.cache_dir()), "drafts", name)


def target_identity(target: str) -> dict:
    """What tells one target from another across runs: its absolute path and the size and
    modification time of its file (a GGUF) or of the files in its directory."""
    path = os.path.abspath(target)
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(
            os.path.join(path, f)
            for f in os.listdir(path)
            if not f.startswith(".") and os.path.isfile(os.path.join(path, f))
        )
    return {
        "path": path,
        "files": [[os.path.basename(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files],
    }


class Budget:
    """The build's wall time across runs: ``spent`` seconds of earlier runs count."""

    def __init__(self, minutes: float, spent: float = 0.0) -> None:
        self.total = 60.0 * minutes
        self.start = time.monotonic() - spent

    def at(self, share: float) -> float:
        """The ``time.monotonic()`` at which ``share`` of the budget is used."""
        return self.start + share * self.total

    @property
    def end(self) -> float:
        return self.at(1.0)

    def spent(self) -> float:
        return time.monotonic() - self.start


def measure_reserve(total_seconds: float, measurements: int = 1) -> float:
    """Seconds kept for the serving measurement: 12% of the budget per measurement (a
    GGUF target has two), 15 s to 4 minutes."""
    return min(240.0, max(15.0, 0.12 * total_seconds * measurements))


def load_state(work: str) -> dict | None:
    """The saved state, its ``spent_seconds`` at least the heartbeat's (a killed run
    never wrote its last state)."""
    file = os.path.join(work, STATE_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        state = json.load(f)
    beat = os.path.join(work, CLOCK_FILE)
    if os.path.isfile(beat):
        try:
            with open(beat) as f:
                spent = float(json.load(f)["spent_seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            spent = 0.0
        state["spent_seconds"] = max(state["spent_seconds"], spent)
    return state


class Heartbeat:
    """Writes the build's spent time to ``CLOCK_FILE`` every ``every`` seconds from a
    daemon thread (the only writer of that file), so a run that is killed still counts."""

    def __init__(self, work: str, budget: "Budget", every: float = 15.0) -> None:
        self.file = os.path.join(work, CLOCK_FILE)
        self.budget, self.every = budget, every
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop_event.wait(self.every):
            save_json(self.file, {"spent_seconds": round(self.budget.spent(), 1)})

    def __enter__(self) -> "Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join()


def _terminate(signum, frame):
    # SIGTERM ends the build as Ctrl-C does: answers and the training checkpoint saved
    raise KeyboardInterrupt(f"signal {signum}")


def save_state(work: str, state: dict) -> None:
    os.makedirs(work, exist_ok=True)
    save_json(os.path.join(work, STATE_FILE), state)


def clean(out: str) -> None:
    """Remove what a build wrote into ``out`` (its files and its work directory)."""
    shutil.rmtree(os.path.join(out, WORK_DIR), ignore_errors=True)
    for name in DRAFT_FILES:
        if os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))


def start_state(args, out: str, work: str) -> dict | None:
    """The saved state of the build at ``out`` or a new one; None (after saying why) when
    there is nothing to do or ``out`` holds something else."""
    if args.fresh:
        clean(out)
    identity = target_identity(args.target)
    state = load_state(work)
    if state is None:
        others = [f for f in os.listdir(out) if f != WORK_DIR] if os.path.isdir(out) else []
        if others:
            raise SystemExit(
                f"error: {out} already holds files ({', '.join(sorted(others)[:4])}) but no "
                f"build state; give another --out, or --fresh to replace the draft there"
            )
        return {
            "format": FORMAT,
            "identity": identity,
            "stage": "data",
            "spent_seconds": 0.0,
            "runs": [],
        }
    if state.get("format") != FORMAT or state.get("identity") != identity:
        raise SystemExit(
            f"error: the build at {out} was started for another target (or another version "
            f"of it: {state.get('identity', {}).get('path')}); --fresh starts over"
        )
    if args.reuse_data and state["stage"] != "data":
        if os.path.isfile(os.path.join(work, "train.pt")):
            os.remove(os.path.join(work, "train.pt"))
        if os.path.isfile(os.path.join(work, CLOCK_FILE)):
            os.remove(os.path.join(work, CLOCK_FILE))
        state.update(stage="train", spent_seconds=0.0)
        log("--reuse-data: training again on the saved teacher data, with a new budget")
    elif state["stage"] == "done":
        log(f"{out} is already built (build.json); --fresh rebuilds it, --reuse-data retrains")
        return None
    return state


def build_for_target(args) -> int:
    """The whole ``--target`` build (see the module docstring); 0 on success."""
    out = os.path.abspath(args.out)
    work = os.path.join(out, WORK_DIR)
    state = start_state(args, out, work)
    if state is None:
        return 0
    budget = Budget(args.minutes, state["spent_seconds"])
    state["runs"].append(
        {"command": command_line(args), "started_at_spent_s": round(budget.spent())}
    )
    save_state(work, state)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main else None
    try:
        with Heartbeat(work, budget):
            return _stages(args, out, work, state, budget)
    finally:
        state["spent_seconds"] = round(budget.spent(), 1)
        save_state(work, state)
        if main:
            signal.signal(signal.SIGTERM, previous)


def _stages(args, out: str, work: str, state: dict, budget: Budget) -> int:
    target_path = os.path.abspath(args.target)
    gguf = is_gguf_source(target_path)
    reserve = measure_reserve(budget.total, 2 if gguf else 1)
    log(
        f"draft for {target_path} into {out}: {clock(budget.total)} budget, "
        f"{clock(budget.spent())} spent by earlier runs, stage {state['stage']}"
    )
    tokenizer = load_tokenizer(target_path)
    if tokenizer is None:
        raise SystemExit(f"error: {target_path} has no tokenizer (the prompts need one)")
    tuner = ThreadTuner(args.threads)
    target = None
    if state["stage"] in ("data", "train"):
        dtype = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
        target = osd.load_model(target_path, dtype=dtype)
        cfg = target.config
        if "shape" not in state:
            head_vocab = args.head_vocab
            if head_vocab is None or head_vocab >= cfg.vocab_size:
                head_vocab = choose_head_vocab(cfg.vocab_size) if head_vocab is None else 0
            state["shape"] = asdict(choose_shape(cfg))
            state["head_vocab"] = head_vocab
            state["prompts"] = args.prompts or DATA.prompts
            state["data_share"] = args.data_share
            rows, group = teacher_batch(cfg, DATA.max_prompt_tokens)
            state["data_recipe"] = asdict(
                replace(
                    DATA,
                    prompts=state["prompts"],
                    batch_size=rows,
                    prefill_group=group,
                    teacher_dtype=str(dtype).removeprefix("torch."),
                    features=False,
                )
            )
            log(
                f"target: {cfg.architecture}, {cfg.num_layers} layers of {cfg.hidden_size}, "
                f"vocabulary {cfg.vocab_size}; draft: {state['shape']['num_layers']} layers of "
                f"{state['shape']['hidden_size']}, head vocabulary "
                f"{state['head_vocab'] or 'all'}"
            )
    recipe = replace(
        DATA, **{**state["data_recipe"], "kinds": tuple(state["data_recipe"]["kinds"])}
    )
    prompts_file = os.path.join(work, "prompts.json")
    if os.path.isfile(prompts_file):
        with open(prompts_file) as f:
            prompts = json.load(f)
    else:
        prompts = make_prompts(tokenizer, recipe)
        save_json(prompts_file, prompts)
        log(
            f"{len(prompts['ids'])} {'chat' if prompts['chat'] else 'plain-text'} prompts "
            f"({prompts['offered'] - len(prompts['ids'])} longer than "
            f"{recipe.max_prompt_tokens} tokens left out)"
        )
    store = TeacherStore(os.path.join(work, "teacher"))

    if state["stage"] == "data" and args.reuse_data and store.shards:
        log("--reuse-data: no more teacher answers, training on the saved ones")
        state["stage"] = "train"
    if state["stage"] == "data":
        share = 1.0 - reserve / budget.total if args.data_only else state["data_share"]
        deadline = budget.at(share)
        if time.monotonic() < deadline:
            t0 = time.monotonic()
            n, stopped = answer(target, prompts, recipe, store, deadline, budget.end, tuner)
            data = state.setdefault("data", {"seconds": 0.0})
            data["seconds"] = round(data["seconds"] + time.monotonic() - t0, 1)
            data["stopped_early"] = stopped
        state["stage"] = "train"
        save_state(work, state)
    examples_by_index = store.load()
    examples = [examples_by_index[i] for i in sorted(examples_by_index)]
    if len(examples) < 2:
        raise SystemExit(f"error: only {len(examples)} teacher answers; give more --minutes")
    if args.data_only:
        log(f"teacher data: {len(examples)} answers in {store.path}")
        return 0

    head_file = os.path.join(work, "head_vocab.json")
    if state["stage"] == "train":
        V = target.config.vocab_size
        if state["head_vocab"] and not os.path.isfile(head_file):
            ids = build_head_vocab(
                tokenizer, examples, state["head_vocab"], V, target.config.eos_token_ids
            )
            save_json(head_file, ids)
        head = None
        if state["head_vocab"]:
            with open(head_file) as f:
                head = json.load(f)
        head_ids = torch.tensor(head) if head is not None else torch.arange(V)
        shape = DraftShape(**state["shape"])
        proj_file = os.path.join(work, "projection.pt")
        if os.path.isfile(proj_file):
            saved = torch.load(proj_file, weights_only=True)
            P, scale = saved["P"], float(saved["scale"])
        else:
            P, scale = projection(target.embed_tokens.weight.detach(), shape.hidden_size)
            torch.save({"P": P, "scale": torch.tensor(scale)}, proj_file)
        model = init_draft(
            shape,
            target.config,
            head_ids,
            P,
            scale,
            target.embed_tokens.weight.detach(),
            TRAIN.seed,
            TRAIN.final_norm_init,
        )
        target = None  # the teacher's memory, before training
        train_set, heldout = split_heldout(examples, TRAIN.heldout_fraction, TRAIN.seed)
        train_set, heldout = map_examples(train_set, head_ids), map_examples(heldout, head_ids)
        checkpoint = os.path.join(work, "train.pt")
        if "heldout_initial" not in state or not os.path.isfile(checkpoint):
            state["heldout_initial"] = evaluate(model, heldout, TRAIN.tokens_per_batch)
        state["data_summary"] = {
            "examples": len(examples),
            "train_examples": len(train_set),
            "heldout_examples": len(heldout),
            "train_answer_positions": sum(e.tokens.numel() - e.prompt_len for e in train_set),
            "train_prompt_positions": sum(e.prompt_len - e.start for e in train_set),
            "prompts_offered": len(prompts["ids"]),
            "chat_template": prompts["chat"],
            "kinds": dict(collections.Counter(e.kind for e in examples)),
        }
        log(
            f"training on {len(train_set)} answers "
            f"({state['data_summary']['train_answer_positions']} answer + "
            f"{state['data_summary']['train_prompt_positions']} prompt positions), "
            f"{len(heldout)} held out; initial held-out overlap "
            f"{state['heldout_initial']['overlap']}"
        )
        deadline = budget.end - reserve - 5.0
        info = train(model, train_set, heldout, TRAIN, deadline, budget.end, tuner, checkpoint)
        state["training"] = info
        state["heldout_final"] = evaluate(model, heldout, TRAIN.tokens_per_batch)
        save_draft(model, out, head)
        state["stage"] = "measure"
        save_state(work, state)
        log(
            f"draft written to {out}: held-out overlap {state['heldout_final']['overlap']}, "
            f"greedy agreement {state['heldout_final']['agree']}"
        )
    target = None

    prompts_m = measure_prompts(tokenizer, MEASURE_PROMPTS)
    # A GGUF target: first as from_pretrained loads it by default (quantized), then in
    # float32, each in half the time left.
    runs = [True, False] if gguf else [False]
    report = {}
    for i, quantized in enumerate(runs):
        end = budget.end - 2.0
        deadline = end - (end - time.monotonic()) / 2 if i + 1 < len(runs) else end
        report["quantized" if quantized else "float"] = measure_serving(
            target_path,
            out,
            prompts_m,
            deadline,
            budget.end,
            max_threads=args.threads,
            quantized=quantized,
        )
    serving = dict(report["float"]["choice"])
    if gguf:
        serving["quantized_target"] = report["quantized"]["choice"]
    with open(os.path.join(out, SERVING_FILE), "w") as f:
        json.dump(serving, f, indent=1)
        f.write("\n")
    state["serving_measurement"] = report
    state["stage"] = "done"
    _write_build_json(args, out, state, budget)
    for name in ("train.pt", "projection.pt"):
        if os.path.isfile(os.path.join(work, name)):
            os.remove(os.path.join(work, name))
    fastest = ", ".join(f"{kind} target: {r['best']}" for kind, r in report.items())
    log(
        f"done in {clock(budget.spent())} of {clock(budget.total)}: {out} (fastest: {fastest}); "
        f"osd draft eval --target {target_path} --draft {out}"
    )
    return 0


def _write_build_json(args, out: str, state: dict, budget: Budget) -> None:
    meta = {
        "target": state["identity"]["path"],
        "target_files": state["identity"]["files"],
        "target_gguf": is_gguf_source(state["identity"]["path"]),
        "shape": state["shape"],
        "head_vocab": state["head_vocab"],
        "data_recipe": state["data_recipe"],
        "train_recipe": asdict(TRAIN),
        "data": {**state.get("data", {}), **state.get("data_summary", {})},
        "training": state.get("training"),
        "heldout_initial": state.get("heldout_initial"),
        "heldout_final": state.get("heldout_final"),
        "serving_measurement": state.get("serving_measurement"),
        "build_seconds": round(budget.spent(), 1),
        "minutes_budget": args.minutes,
        "runs": state["runs"],
        "max_threads": args.threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": command_line(args),
    }
    with open(os.path.join(out, "build.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
