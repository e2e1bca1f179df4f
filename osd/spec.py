"""Configuration of speculative decoding (``osd.SpecConfig``)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, fields

import torch

from osd.tree import MAX_TREE_NODES, StaticTree

DRAFTERS = ("model", "self", "ngram")


@dataclass(frozen=True)
class DynamicTree:
    """A tree grown per step from the draft's own probabilities (EAGLE-2 style).

    Each level expands the ``topk`` most likely children of every frontier node, then
    keeps the ``max_nodes`` nodes (root excluded) with the highest path probability.
    """

    topk: int = 4  # children tried per node
    depth: int = 4  # levels below the root
    max_nodes: int = 16  # node budget, root excluded (<= 63)

    def __post_init__(self):
        if self.topk < 1 or self.depth < 1:
            raise ValueError(f"DynamicTree needs topk >= 1 and depth >= 1, got {self}")
        if not 1 <= self.max_nodes < MAX_TREE_NODES:
            raise ValueError(
                f"DynamicTree.max_nodes must be in 1..{MAX_TREE_NODES - 1}, got {self.max_nodes}"
            )


# PromptLookup.min_reach by the target's device: the share of a step that one more verify
# row costs. Measured on a 2-core CPU at batch 1 (docs/benchmarks.md); on a GPU a verify
# row costs little at small batches, and the value there has not been measured yet.
MIN_REACH = {"cpu": 0.2, "cuda": 0.05}


@dataclass(frozen=True)
class PromptLookup:
    """Prompt lookup: drafts are what followed the latest earlier occurrence of the
    context's suffix (longest suffix first, ``ngram_max`` down to ``ngram_min`` tokens), in
    the row's own prompt and output and, with ``history``, in the newest ``history`` tokens
    of the engine's finished requests (:class:`osd.spec_decode.lookup_history.LookupHistory`):
    traffic that repeats across requests (a task asked again, an answer template) is then
    drafted from earlier answers.

    Alone (``SpecConfig(drafter="ngram")``) it is the drafter. In front of a draft model
    (``SpecConfig(lookup=PromptLookup())``) it drafts a step when every row has a match
    worth drafting (those continuations, up to ``tokens`` or ``num_draft_tokens``, each
    cut by its request's record as lookup alone cuts it, below; verified as a chain; the
    draft model does not run and catches up on the next step it drafts); otherwise the
    draft model drafts, and in a chain the rows that do have lookup drafts verify those
    instead (unless ``adaptive``). So a row whose lookup drafts would not pay gets the
    model's chain, not a plain step. ``min_reach=0`` drafts every match whole instead.
    Lookup is nearly free and, where text repeats (code, edits, retrieval), long and
    accurate; the draft model covers the rest.

    ``tree_below=m`` (in front of a draft model) lets a match draft alone only when it is
    at least ``m`` tokens long. Unless every row has such a match, the draft model drafts a
    greedy chain of ``num_draft_tokens`` and the step verifies a tree per row: a row with a
    long match its lookup chain, any other row the model's chain beside its lookup
    continuation (up to ``max(num_draft_tokens, tokens)`` drafts; none without a match),
    two branches of one tree. A one-token match is often wrong where the model is right,
    and one verify forward tries both. ``m = ngram_max + 1`` puts every match beside the
    model. A row's drafts depend on its own context only.

    A row drafts its continuation only as far as its request's record of earlier
    lookup drafts makes each position worth a verify row (``min_reach``: the chance of
    reaching and accepting the last drafted position, :mod:`osd.spec_decode.lookup_lengths`):
    on text that does not repeat most continuations are wrong, and drafting all of them
    would make a CPU step dearer than it gains. ``None`` takes :data:`MIN_REACH` for the
    target's device. In a batch the bar rises with the batch size (each draft adds a row
    to a forward the whole batch waits for), so those drafts also depend on the batch
    size (the output does not; a fixed seed's samples can).
    """

    ngram_min: int = 1  # shortest suffix matched
    ngram_max: int = 3  # longest suffix matched
    history: int = 0  # also search this many tokens of finished requests (0: off)
    tokens: int = 0  # in front of a model: most drafts of a step whose rows all match
    #                  (0: num_draft_tokens)
    tree_below: int = 0  # in front of a model: shorter matches verify beside the model's
    #                      chain in one tree (0: off)
    min_reach: float | None = None  # draft a continuation only up to the last
    # position whose chance of acceptance, by the request's record, is at least this (0:
    # all of it; None: MIN_REACH for the target's device)

    def __post_init__(self):
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"prompt lookup needs 1 <= ngram_min <= ngram_max, got "
                f"{self.ngram_min}, {self.ngram_max}"
            )
        if self.history < 0:
            raise ValueError(
                f"SpecConfig.lookup_history (PromptLookup.history) must be >= 0, got {self.history}"
            )
        if not 0 <= self.tokens < MAX_TREE_NODES:
            raise ValueError(
                f"SpecConfig.lookup_tokens (PromptLookup.tokens) must be in "
                f"0..{MAX_TREE_NODES - 1}, got {self.tokens}"
            )
        if self.min_reach is not None and not 0.0 <= self.min_reach < 1.0:
            raise ValueError(f"PromptLookup.min_reach must be in [0, 1), got {self.min_reach}")
        if not 0 <= self.tree_below <= self.ngram_max + 1:
            raise ValueError(
                f"SpecConfig.lookup_tree_below (PromptLookup.tree_below) must be in "
                f"0..ngram_max + 1 = {self.ngram_max + 1}, got {self.tree_below}"
            )


# The flat spellings of the prompt-lookup settings that SpecConfig also accepts (and reads
# back): keyword -> PromptLookup field.
LOOKUP_KEYWORDS = {
    "ngram_min": "ngram_min",
    "ngram_max": "ngram_max",
    "lookup_history": "history",
    "lookup_tokens": "tokens",
    "lookup_tree_below": "tree_below",
}


@dataclass
class SpecConfig:
    """How drafts are proposed and verified.

    ``drafter`` names who drafts: ``"model"`` (a separate draft model, or an EAGLE draft),
    ``"self"`` (the target with ``skip_layers`` bypassed) or ``"ngram"`` (prompt lookup
    alone, configured by ``lookup``). ``lookup=PromptLookup(...)`` puts prompt lookup in
    front of a model or self drafter: the two compose (:class:`PromptLookup`).

    ``tree=None`` drafts a chain of ``num_draft_tokens``; a list of child-rank paths gives
    a static tree (e.g. ``[(0,), (1,), (0, 0)]``); a :class:`DynamicTree` grows one per
    step. Trees use the draft's top-ranked children (deterministic), verified with the
    multi-draft rule, which is lossless for sampling too.

    ``auto_k=True`` (chains) lets each step choose its chain length among a few values from
    0 to ``num_draft_tokens`` by the goodput measured at the step's batch size (tokens
    emitted per second of step time, ``osd.spec_decode.policies.DraftLengthController``):
    where drafting does not pay (a weak draft, a large batch whose verify forward is
    compute bound) the steps become plain decoding through the verify path, or, with
    prompt lookup in front of the draft model, lookup alone (the model idle and not fed
    until it drafts again); a step where every row's lookup match was long enough to
    draft alone is lookup's whatever the chain length, and is not measured. The output
    stays the target's (greedy: token for token; sampled: in distribution), but sampled
    tokens for a fixed seed then depend on the batch a request ran in, since the chain
    lengths do. ``adaptive=True`` stops a row's chain when the draft is unsure
    (``osd.spec_decode.policies.AdaptiveStopper``).

    The flat keywords ``prompt_lookup``, ``ngram_min``, ``ngram_max``, ``lookup_history``,
    ``lookup_tokens`` and ``lookup_tree_below`` are accepted as another spelling of
    ``lookup`` (and read back as attributes), so ``SpecConfig(prompt_lookup=True,
    lookup_tokens=8)`` equals ``SpecConfig(lookup=PromptLookup(tokens=8))``.
    """

    num_draft_tokens: int = 4  # k: chain length / most drafts per step
    tree: object = None  # None | list of rank paths | DynamicTree
    drafter: str = "model"  # "model" (separate draft), "self" (layer skip), "ngram"
    skip_layers: tuple[int, ...] | None = None  # self: target layers skipped (default: odd ones)
    lookup: PromptLookup | None = None  # prompt lookup: the ngram drafter's settings, or
    #                                     in front of the model drafter (None: off)
    adaptive: bool = False  # stop drafting a row when the draft is unsure
    adaptive_floor: float = 0.35  # adaptive: stop when P(reach and accept) < floor
    adaptive_init_threshold: float = 0.3  # adaptive: confidence threshold before calibration
    auto_k: bool = False  # chain length per step from measured goodput per batch size, 0
    #                       (plain decoding) when drafts do not pay
    exact_alpha: bool = True  # report 1 - TV(p, q) (one softmax per drafted row)
    cuda_graphs: bool = True  # capture draft and verify forwards on CUDA

    def lookup_alone(self) -> "SpecConfig":
        """This config's prompt lookup without a draft model: the ``"ngram"`` drafter with
        the same n-gram sizes and history, drafting up to ``max(num_draft_tokens,
        lookup.tokens)`` tokens. What a lookup in front of a model means when no draft
        model is given."""
        lk = self.lookup or PromptLookup()
        return dataclasses.replace(
            self,
            drafter="ngram",
            lookup=PromptLookup(lk.ngram_min, lk.ngram_max, lk.history),
            tree=None,
            adaptive=False,
            num_draft_tokens=max(self.num_draft_tokens, lk.tokens),
        )

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"SpecConfig.drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if isinstance(self.lookup, dict):  # from a JSON settings file
            self.lookup = PromptLookup(**self.lookup)
        if self.lookup is not None and not isinstance(self.lookup, PromptLookup):
            raise TypeError(
                f"SpecConfig.lookup must be a PromptLookup or None, got {type(self.lookup)}"
            )
        self._fold_flat_lookup(*self.__dict__.pop("_flat_lookup", (None, {})))
        if not 1 <= self.num_draft_tokens < MAX_TREE_NODES:
            raise ValueError(
                f"SpecConfig.num_draft_tokens must be in 1..{MAX_TREE_NODES - 1}, "
                f"got {self.num_draft_tokens}"
            )
        if not 0.0 < self.adaptive_floor < 1.0:
            raise ValueError(
                f"SpecConfig.adaptive_floor must be in (0, 1), got {self.adaptive_floor}"
            )
        if self.tree is not None and not isinstance(self.tree, (DynamicTree, StaticTree)):
            self.tree = StaticTree.from_paths(self.tree)
        if self.drafter == "ngram":
            if self.lookup is None:
                self.lookup = PromptLookup()
            if self.tree is not None:
                raise ValueError("the ngram drafter proposes a chain; use tree=None")
            if self.lookup.tokens or self.lookup.tree_below:
                raise ValueError(
                    "prompt lookup's tokens and tree_below (lookup_tokens, "
                    "lookup_tree_below) shape lookup in front of a draft model; the ngram "
                    "drafter's chain length is num_draft_tokens"
                )
        lk = self.lookup
        if lk is not None and lk.tree_below and (self.tree is not None or self.adaptive):
            raise ValueError(
                "SpecConfig.lookup_tree_below builds its own tree from the model's "
                "chain: it does not combine with tree= or adaptive=True"
            )
        if (
            lk is not None
            and lk.tree_below
            and 1 + max(self.num_draft_tokens, lk.tokens) + self.num_draft_tokens > MAX_TREE_NODES
        ):
            raise ValueError(
                f"SpecConfig.lookup_tree_below verifies up to 1 + "
                f"max(num_draft_tokens, lookup_tokens) + num_draft_tokens nodes, "
                f"at most {MAX_TREE_NODES}: got num_draft_tokens="
                f"{self.num_draft_tokens}, lookup_tokens={lk.tokens}"
            )
        if self.auto_k and (self.tree is not None or self.adaptive):
            raise ValueError(
                "SpecConfig(auto_k=True) picks a chain length per step; it does "
                "not combine with trees or adaptive=True"
            )

    def _fold_flat_lookup(self, prompt_lookup: bool | None, flat: dict) -> None:
        """Merge the flat keywords into ``lookup``: ``prompt_lookup`` switches lookup in
        front of a model drafter on or off; the others set :class:`PromptLookup` fields."""
        given = {LOOKUP_KEYWORDS[k]: v for k, v in flat.items() if v is not None}
        if prompt_lookup and self.drafter == "ngram":
            raise ValueError(
                "SpecConfig(prompt_lookup=True) adds prompt lookup to a model "
                "drafter; drafter='ngram' already is prompt lookup"
            )
        if prompt_lookup is False and self.drafter != "ngram":
            self.lookup = None
        on = self.lookup is not None or bool(prompt_lookup) or self.drafter == "ngram"
        if not on:
            for key, name in (
                ("lookup_tokens", "tokens"),
                ("lookup_tree_below", "tree_below"),
                ("lookup_history", "history"),
            ):
                if given.get(name):
                    raise ValueError(
                        f"SpecConfig.{key} shapes prompt lookup: set prompt_lookup=True "
                        f"(or lookup=PromptLookup(...), or drafter='ngram')"
                    )
            PromptLookup(**given)  # n-gram sizes without lookup: checked, nothing to configure
            return
        self.lookup = dataclasses.replace(self.lookup or PromptLookup(), **given)

    @property
    def is_tree(self) -> bool:
        return self.tree is not None


class _LookupAttribute:
    """Reads a flat prompt-lookup keyword back from ``SpecConfig.lookup`` (on the class:
    the default value)."""

    def __init__(self, name: str | None):
        self.name = name  # PromptLookup field; None: "prompt_lookup"

    def __get__(self, obj, cls=None):
        if self.name is None:
            return False if obj is None else obj.lookup is not None and obj.drafter != "ngram"
        lookup = PromptLookup() if obj is None or obj.lookup is None else obj.lookup
        return getattr(lookup, self.name)


def _accept_flat_lookup(init):
    """``SpecConfig.__init__`` that also takes the flat prompt-lookup keywords. They are
    not dataclass fields, so ``dataclasses.replace`` and ``fields`` see ``lookup`` only."""

    @functools.wraps(init)
    def __init__(self, *args, prompt_lookup: bool | None = None, **kwargs):
        flat = {k: kwargs.pop(k) for k in LOOKUP_KEYWORDS if k in kwargs}
        self._flat_lookup = (prompt_lookup, flat)
        init(self, *args, **kwargs)

    return __init__


SpecConfig.__init__ = _accept_flat_lookup(SpecConfig.__init__)
SpecConfig.prompt_lookup = _LookupAttribute(None)
for _key, _name in LOOKUP_KEYWORDS.items():
    setattr(SpecConfig, _key, _LookupAttribute(_name))


def _short(value) -> str:
    """``repr`` of a setting; a :class:`PromptLookup` names only its non-default fields."""
    if not isinstance(value, PromptLookup):
        return repr(value)
    base = PromptLookup()
    parts = [
        f"{f.name}={getattr(value, f.name)!r}"
        for f in fields(PromptLookup)
        if getattr(value, f.name) != getattr(base, f.name)
    ]
    return f"PromptLookup({', '.join(parts)})"


def describe(spec: SpecConfig) -> str:
    """``spec``'s fields that differ from the defaults, ``"name=value, ..."`` (the chain of
    4 of a plain ``SpecConfig()`` reads ``num_draft_tokens=4``)."""
    default = SpecConfig()
    changed = [
        f"{f.name}={_short(getattr(spec, f.name))}"
        for f in fields(SpecConfig)
        if getattr(spec, f.name) != getattr(default, f.name)
    ]
    return ", ".join(changed or [f"num_draft_tokens={spec.num_draft_tokens}"])


SERVING_FILE = "serving.json"
SERVING_KEYS = ("spec", "quantize_draft", "online", "quantized_target")
# "online": osd.online.config; "quantized_target": {"spec", "quantize_draft"} for a target
# that keeps its GGUF weights quantized


def draft_serving_defaults(
    path, quantized_target: bool = False
) -> tuple[SpecConfig | None, str | None]:
    """A draft checkpoint's recommended serving settings, from ``serving.json`` in its
    directory: ``{"spec": {SpecConfig fields}, "quantize_draft": "Q8_0" or null}``, both
    keys optional; with ``quantized_target``, the keys of its ``"quantized_target"``
    object (the shape measured fastest beside a target that keeps its quantized weights,
    whose verify forwards cost more per row) replace them. ``Engine.from_pretrained``
    uses them for a draft it is given alone when the caller passes no ``spec`` (and
    leaves ``quantize_draft="auto"``); they are the shape measured fastest for that
    draft, and change speed only, never the output. A ``spec`` whose drafter is not
    ``"model"`` (prompt lookup alone) means the draft is not served.

    Returns ``(spec or None, quantize_draft or None)``; ``(None, None)`` for a path
    without the file (or one that is not a directory). A malformed file raises
    ValueError naming it.
    """
    file = os.path.join(os.fspath(path), SERVING_FILE)
    if not os.path.isfile(file):
        return None, None
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        unknown = sorted(set(data) - set(SERVING_KEYS))
        if unknown:
            raise ValueError(f"unknown keys {unknown} (known: {list(SERVING_KEYS)})")
        override = data.get("quantized_target")
        if override is not None:
            if not isinstance(override, dict) or set(override) - {"spec", "quantize_draft"}:
                raise ValueError(
                    "'quantized_target' must be an object with 'spec' and/or 'quantize_draft'"
                )
            if quantized_target:
                data = {**data, **override}
        fields = data.get("spec")
        if fields is not None and not isinstance(fields, dict):
            raise ValueError("'spec' must be an object of SpecConfig fields")
        spec = None if fields is None else SpecConfig(**fields)
        fmt = data.get("quantize_draft")
        if fmt is not None and not isinstance(fmt, str):
            raise ValueError("'quantize_draft' must be a block format name or null")
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"bad draft serving settings in {file}: {exc}") from None
    return spec, fmt


def learning_beside(spec: SpecConfig, alone: SpecConfig) -> SpecConfig:
    """What a draft serves while it learns online beside a target where prompt lookup
    alone (``alone``, the draft's recommendation there) measured fastest: its own
    ``spec`` with ``auto_k``, so each step's chain length follows the goodput measured
    while serving, and its arm 0 is ``alone``'s lookup (the model idle, catching up).
    While the draft's chain does not pay, the steps are prompt lookup's, as long as
    ``alone``'s: an all-lookup step drafts up to ``alone.num_draft_tokens`` when that is
    longer than the chain (the lookup's ``tokens``, whatever ``spec`` had there: a longer
    lookup chain than the recommendation's verifies more rows a step for the same tokens,
    which would make the learning engine slower than the recommendation), else up to
    ``max(num_draft_tokens, lookup.tokens)``; as the draft learns, its chain wins steps
    back. The chain steps draft the model only where lookup drafts nothing (no lookup
    trees: ``tree_below`` 0), so a chain length is measured against plain steps on the
    steps lookup leaves, and its steps elsewhere are lookup alone's. The lookup searches
    ``alone``'s history when ``spec``'s has none. A ``spec`` with a static tree or
    ``adaptive`` is returned as it is (``auto_k`` picks chain lengths)."""
    if spec.tree is not None or spec.adaptive:
        return spec
    lk = spec.lookup
    if lk is not None and alone.lookup is not None:
        if not lk.history:
            lk = dataclasses.replace(lk, history=alone.lookup.history)
        longest = alone.num_draft_tokens if alone.drafter == "ngram" else 0
        if longest > spec.num_draft_tokens:
            lk = dataclasses.replace(lk, tokens=longest)
        if alone.drafter == "ngram":
            lk = dataclasses.replace(lk, tree_below=0)
    return dataclasses.replace(spec, auto_k=True, lookup=lk)


def serving_settings(
    sources: list,
    drafts: list,
    spec: SpecConfig | None,
    quantize_draft: str | None,
    quantized_target: bool = False,
) -> tuple[SpecConfig | None, str | None]:
    """``Engine.from_pretrained``'s ``spec`` and ``quantize_draft``: the caller's, except
    that ``spec=None`` and ``quantize_draft="auto"`` take what a single draft directory
    recommends (:func:`draft_serving_defaults`). ``sources``: the drafts as given (paths
    or models); ``drafts``: the loaded models. The settings were measured on the CPU and
    apply to a draft there only (on a GPU: a chain of 4, float); the block format only
    to a float32 draft (where quantized drafts run); "auto" is None otherwise."""
    rec_spec, rec_fmt = None, None
    if (
        len(sources) == 1
        and isinstance(sources[0], (str, os.PathLike))
        and drafts[0].device.type == "cpu"
    ):
        rec_spec, rec_fmt = draft_serving_defaults(sources[0], quantized_target)
    if spec is None:
        spec = rec_spec
    if quantize_draft == "auto":
        quantize_draft = rec_fmt if drafts and drafts[0].dtype == torch.float32 else None
    return spec, quantize_draft
