"""The main job (``make demo`` / ``osd demo``): serve a shifted query stream with online
speculative decoding, and report what happened.

Two pairs:

- ``chat`` (default): SmolLM2-135M-Instruct from its GGUF and its shipped draft
  (``osd.zoo.chat_pair``), serving HumanEval's coding tasks as chat requests
  (``osd.zoo.humaneval``), which the draft was not trained on;
- ``builtin``: the 8.7M-parameter pair trained on the standard library
  (``osd.zoo.default_pair``), serving code windows to a draft trained mostly on prose.

Each request is served at batch size 1, greedy:

1. the target alone (plain decoding) on the first ``baseline_requests`` requests: the
   reference of the live progress and of the plots;
2. speculative decoding with **online** distillation on over the whole stream (the
   draft learns in a background thread from the target's verdicts; updates are swapped
   in between decode steps);
3. on the last ``static_requests`` requests (all of them for the built-in pair), side by
   side with the online engine: after the online engine serves a request, its learner
   holds while speculative decoding with the draft kept **static** and the target alone
   serve the same request. The report's speedups are the tokens/s of these three over
   that window, measured at the same time on the same requests, and every output there
   must equal the target's. With ``lookup_history``, the static engine's history first
   receives the answers of the requests before the window, as the online pass had them.

Live progress shows the rolling α, tokens/s and speedup. The report (markdown and PNG
plots) goes to ``out_dir``: α over requests (static against online), tokens/s over
requests, and measured speedup against the analytic bound
``(1 - α^(k+1)) / ((1 - α)(c k + 1))`` with the measured α and draft cost ratio c.
"""

from __future__ import annotations

import dataclasses
import time

import torch

import osd
from osd import zoo
from osd.chat_template import apply_chat_template

# The serving loop and the report live beside this module; their names stay importable
# from osd.demo.
from osd.demo.report import _report, _tps
from osd.demo.serve import _serve, _side_by_side, draft_cost_ratio
from osd.models.loading import load_tokenizer
from osd.models.quant import FORMATS as QUANT_FORMATS
from osd.online.config import draft_online_recipe, with_recipe
from osd.zoo import humaneval

PAIRS = ("chat", "builtin")
DRAFTS = ("model", "eagle")


@dataclasses.dataclass
class DemoConfig:
    """What the demo serves and where it writes its report. ``None`` fields take the
    pair's defaults (:data:`DEFAULTS`)."""

    pair: str = "chat"  # "chat" or "builtin"
    requests: int = 200  # requests in the stream
    baseline_requests: int | None = None  # first n served by the target alone
    static_requests: int | None = None  # last n served by the static draft
    plain_every: int = 2  # in that window the target alone serves every
    #                                        n-th request (the speedups' requests)
    max_new_tokens: int | None = None  # tokens generated per request (greedy)
    num_draft_tokens: int | None = None  # k
    prompt_lookup: bool | None = None  # prompt lookup in front of the draft model
    lookup_history: int | None = None  # prompt lookup also over this many tokens of
    #                                        earlier answers (SpecConfig.lookup_history)
    lookup_tokens: int | None = None  # most drafts of a lookup step
    #                                        (SpecConfig.lookup_tokens; 0: k)
    lookup_min_match: int | None = None  # shortest suffix prompt lookup matches
    #                                        (SpecConfig.ngram_min; at most ngram_max, 3)
    lookup_tree_below: int | None = None  # shorter matches verify beside the draft
    #                                        model's chain, in one tree
    #                                        (SpecConfig.lookup_tree_below; 0: off)
    adaptive: bool = False  # the draft model's chains stop where it is
    #                                        unsure (SpecConfig.adaptive; k is the longest)
    draft: str | None = None  # chat pair: "model" (the standalone draft) or
    #                                        "eagle" (the EAGLE draft on the target's features)
    quantized: bool = False  # chat pair: the target keeps its GGUF weights
    #                                        quantized (Engine.from_pretrained(quantized=True))
    quantize_draft: str | None = None  # the draft served in this block format
    #                                        (Engine(quantize_draft=...); it still learns, in
    #                                        float32); "none": float32 (chat default Q8_0)
    prefix_cache: int = 0  # prompt tokens whose target K/V every engine
    #                                        keeps across requests (Engine(prefix_cache=...))
    seed: int = 0  # query-stream seed
    threads: int | None = None  # torch intra-op threads (1: serving and the
    # learner thread each keep a core busy)
    out_dir: str = "reports/demo"  # report directory
    online: osd.OnlineConfig | None = None

    def __post_init__(self):
        if self.pair not in PAIRS:
            raise ValueError(f"pair must be one of {PAIRS}, got {self.pair!r}")
        if self.adaptive and self.lookup_tree_below is None:
            self.lookup_tree_below = 0  # adaptive chains replace the lookup trees
        if self.prompt_lookup is False and self.lookup_min_match is None:
            self.lookup_min_match = 1  # the pair's default needs prompt lookup
        for name, value in DEFAULTS[self.pair].items():
            if getattr(self, name) is None:
                setattr(self, name, value() if callable(value) else value)
        if self.draft not in DRAFTS or (self.draft == "eagle" and self.pair != "chat"):
            raise ValueError(
                f"draft must be one of {DRAFTS} (eagle: the chat pair only), got {self.draft!r}"
            )
        if not 1 <= self.lookup_min_match <= osd.SpecConfig.ngram_max:
            raise ValueError(
                f"lookup_min_match must be in 1..{osd.SpecConfig.ngram_max}, got "
                f"{self.lookup_min_match}"
            )
        if self.lookup_history and not self.prompt_lookup:
            raise ValueError("lookup_history needs prompt_lookup")
        if self.lookup_min_match > 1 and not self.prompt_lookup:
            raise ValueError("lookup_min_match needs prompt_lookup")
        if self.lookup_tree_below and not self.prompt_lookup:
            raise ValueError("lookup_tree_below needs prompt_lookup")
        if self.lookup_tree_below and self.adaptive:
            raise ValueError(
                "lookup_tree_below and adaptive do not combine (pass "
                "--lookup-tree-below 0 with --adaptive)"
            )
        if self.quantized and self.pair != "chat":
            raise ValueError("quantized needs the chat pair (a GGUF target)")
        if self.quantize_draft == "none":
            self.quantize_draft = None
        if self.quantize_draft not in (None, *QUANT_FORMATS):
            raise ValueError(
                f"quantize_draft must be one of {QUANT_FORMATS} or 'none', got "
                f"{self.quantize_draft!r}"
            )
        if (
            self.requests < 1
            or self.baseline_requests < 1
            or self.static_requests < 1
            or self.plain_every < 1
        ):
            raise ValueError(
                "requests, baseline_requests, static_requests and plain_every must be >= 1"
            )
        self.baseline_requests = min(self.baseline_requests, self.requests)
        self.static_requests = min(self.static_requests, self.requests)


def online_recipe(pair: str) -> osd.OnlineConfig:
    """The online config the demo serves ``pair`` (``"chat"`` or ``"builtin"``) with: the
    recipe its draft carries in ``serving.json`` (``osd.online.config.draft_online_recipe``)
    over ``OnlineConfig()``, as ``Engine.from_pretrained`` applies it, so the demo learns
    as a user's engine would. The chat draft's recipe is the default one fed each request's
    newest 128 tokens (the demo's prompts are long, its answers short); ``docs/online.md``
    gives the reasons for each setting."""
    draft = zoo.chat.DRAFT_DIR if pair == "chat" else zoo.default_pair()[1]
    return with_recipe(osd.OnlineConfig(), draft_online_recipe(draft))


DEFAULTS = {
    "chat": dict(
        baseline_requests=8,
        static_requests=50,
        max_new_tokens=48,
        num_draft_tokens=3,
        threads=1,
        prompt_lookup=True,
        lookup_history=65536,
        lookup_min_match=2,
        lookup_tokens=8,
        lookup_tree_below=4,
        draft="model",
        quantize_draft="Q8_0",
        online=lambda: online_recipe("chat"),
    ),
    "builtin": dict(
        baseline_requests=40,
        static_requests=200,
        max_new_tokens=32,
        num_draft_tokens=4,
        threads=1,
        prompt_lookup=False,
        lookup_history=0,
        lookup_min_match=1,
        lookup_tokens=0,
        lookup_tree_below=0,
        draft="model",
        quantize_draft="none",
        online=lambda: online_recipe("builtin"),
    ),
}


# DemoConfig fields and the `osd demo` options that set them (the report's command)
_OPTIONS = (
    ("draft", "--draft"),
    ("quantized", "--quantized"),
    ("quantize_draft", "--quantize-draft"),
    ("lookup_history", "--lookup-history"),
    ("lookup_tokens", "--lookup-tokens"),
    ("lookup_min_match", "--lookup-min-match"),
    ("lookup_tree_below", "--lookup-tree-below"),
    ("adaptive", "--adaptive"),
    ("max_new_tokens", "--max-new-tokens"),
    ("num_draft_tokens", "-k"),
    ("requests", "--requests"),
    ("baseline_requests", "--baseline"),
    ("static_requests", "--static"),
    ("plain_every", "--plain-every"),
    ("prefix_cache", "--prefix-cache"),
    ("seed", "--seed"),
    ("threads", "--threads"),
)


def _command(cfg: DemoConfig) -> str:
    """The ``osd demo`` command line of ``cfg``: its pair and every option whose value is
    not the pair's default."""
    fields = {f.name: f.default for f in dataclasses.fields(DemoConfig)}
    parts = ["osd demo", f"--pair {cfg.pair}"]
    for name, flag in _OPTIONS:
        default = DEFAULTS[cfg.pair].get(name, fields[name])
        if name == "lookup_tree_below" and cfg.adaptive:
            default = 0  # --adaptive turns lookup trees off
        value = getattr(cfg, name)
        if value == (None if default == "none" else default):
            continue
        if isinstance(value, bool):
            parts.append(flag)
        else:
            parts.append(f"{flag} {'none' if value is None else value}")
    return " ".join(parts)


def _stream(cfg: DemoConfig):
    """``(target, draft, prompts, label)`` of the configured pair: token-id prompts."""
    if cfg.pair == "builtin":
        target, draft = zoo.default_pair()
        prompts = zoo.query_stream("code", n=cfg.requests, prompt_tokens=48, seed=cfg.seed)
        return target, draft, prompts, "built-in pair (`osd.zoo`), code queries"
    # The draft first: a missing one is named (with where it was looked for and how to get
    # it) before the GGUF target is fetched.
    (draft,) = zoo.locate.require("chat_eagle" if cfg.draft == "eagle" else "chat_draft")
    target = zoo.chat.fetch_target()
    prompts = apply_chat_template(
        load_tokenizer(target), humaneval.conversations(cfg.requests, seed=cfg.seed)
    )
    which = "its EAGLE draft" if cfg.draft == "eagle" else "its draft"
    return (
        target,
        draft,
        prompts,
        f"SmolLM2-135M-Instruct (GGUF) and {which}, HumanEval chat requests",
    )


def run_demo(cfg: DemoConfig | None = None) -> dict:
    """Run the demo and write the report; returns the summary dict."""
    cfg = cfg or DemoConfig()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    print(f"osd demo: preparing the {cfg.pair} pair ...", flush=True)
    target_dir, draft_dir, prompts, label = _stream(cfg)
    params = osd.SamplingParams(cfg.max_new_tokens)
    k = cfg.num_draft_tokens
    max_len = max(len(p) for p in prompts) + cfg.max_new_tokens + 8
    c = draft_cost_ratio(
        target_dir, draft_dir, quantized=cfg.quantized, quantize_draft=cfg.quantize_draft
    )
    print(f"osd demo: {cfg.requests} queries ({label}); draft cost ratio c = {c:.3f}", flush=True)

    plain = osd.Engine.from_pretrained(
        target_dir,
        max_batch_size=1,
        max_seq_len=max_len,
        quantized=cfg.quantized,
        prefix_cache=cfg.prefix_cache,
    )
    base_out = []
    base = _serve(plain, prompts[: cfg.baseline_requests], params, "target alone", outputs=base_out)
    plain_tps = _tps(base)
    spec = osd.SpecConfig(
        num_draft_tokens=k,
        prompt_lookup=cfg.prompt_lookup,
        lookup_history=cfg.lookup_history,
        lookup_tokens=cfg.lookup_tokens,
        ngram_min=cfg.lookup_min_match,
        adaptive=cfg.adaptive,
        lookup_tree_below=cfg.lookup_tree_below,
    )
    online = osd.Engine.from_pretrained(
        target_dir,
        draft=draft_dir,
        spec=spec,
        online=cfg.online,
        max_batch_size=1,
        max_seq_len=max_len,
        quantized=cfg.quantized,
        quantize_draft=cfg.quantize_draft,
        prefix_cache=cfg.prefix_cache,
    )
    static = osd.Engine.from_pretrained(
        target_dir,
        draft=draft_dir,
        spec=spec,
        max_batch_size=1,
        max_seq_len=max_len,
        quantized=cfg.quantized,
        quantize_draft=cfg.quantize_draft,
        prefix_cache=cfg.prefix_cache,
    )
    first_static = cfg.requests - cfg.static_requests
    outputs = []
    on_rec = _serve(
        online, prompts[:first_static], params, "online draft", plain_tps, outputs=outputs
    )
    if static.lookup_history is not None:
        # The answers served before its first request, as the online engine had them
        # (greedy outputs are the target's whichever draft served them).
        for prompt, ids in zip(prompts[:first_static], outputs):
            static.lookup_history.add(prompt, ids)
    window = _side_by_side(
        online,
        static,
        plain,
        prompts[first_static:],
        params,
        first_static,
        outputs,
        cfg.plain_every,
    )
    on_rec += window["online"]
    st_rec = window["static"]
    online.close()
    # Outputs are lossless: the online engine's answers equal the target's wherever both
    # served (the first requests, and the window, checked as it ran).
    for i, ref in enumerate(base_out):
        if ref != outputs[i]:
            raise AssertionError(f"request {i}: speculative output differs from the target's")
    summary = _report(
        cfg,
        label,
        _command(cfg),
        c,
        base,
        st_rec,
        on_rec,
        window["plain"],
        online.stats,
        plain_tps,
        time.perf_counter() - t_start,
    )
    return summary


__all__ = [
    "DemoConfig",
    "DEFAULTS",
    "PAIRS",
    "DRAFTS",
    "online_recipe",
    "draft_cost_ratio",
    "run_demo",
]
