"""Configuration of speculative decoding (``osd.SpecConfig``)."""

from __future__ import annotations

import dataclasses
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


@dataclass
class SpecConfig:
    """How drafts are proposed and verified.

    ``tree=None`` drafts a chain of ``num_draft_tokens``; a list of child-rank paths gives
    a static tree (e.g. ``[(0,), (1,), (0, 0)]``); a :class:`DynamicTree` grows one per
    step. Trees use the draft's top-ranked children (deterministic), verified with the
    multi-draft rule, which is lossless for sampling too.

    ``prompt_lookup=True`` (with a draft model or self-speculation) first looks the
    context's suffix up in the row's own prompt and output, as the ``"ngram"`` drafter
    does; when every row of the step has a match, those continuations (up to
    ``num_draft_tokens``) are the drafts, verified as a chain, and the draft model does not
    run (its cache catches up on the next step it drafts). Otherwise the draft model
    drafts: a chain, in which the rows that do have a match verify their continuation
    instead (unless ``adaptive``), or the ``tree`` when one is set. Lookup is nearly free
    and, where text repeats (code, edits, retrieval), long and accurate; the draft model
    covers the rest. ``lookup_tokens`` lets those lookup steps verify longer continuations
    than the draft model's chains: their drafts cost no draft forward, only verify rows.

    ``lookup_tree_below=m`` (with ``prompt_lookup``) lets a match draft alone only when it
    is at least ``m`` tokens long. Unless every row has such a match, the draft model
    drafts a greedy chain of ``num_draft_tokens`` and the step verifies a tree per row:
    a row with a long match its lookup chain, any other row the model's chain beside its
    lookup continuation (up to ``max(num_draft_tokens, lookup_tokens)`` drafts, as a
    lookup step's; none without a match), two branches of one tree. A one-token match is
    often wrong where the model is right, and one verify forward tries both.
    ``m = ngram_max + 1`` puts every match beside the model. A row's drafts depend on its
    own context only, as without trees.

    ``lookup_history=n`` (with ``prompt_lookup`` or the ``"ngram"`` drafter) also looks the
    suffix up in the newest ``n`` tokens of the engine's finished requests (their outputs,
    :class:`osd.lookup_history.LookupHistory`), at each suffix length after the request's
    own text: traffic that repeats across requests (a task asked again, an answer
    template) is then drafted from earlier answers.

    ``auto_k=True`` (chains) lets each step choose its chain length among a few values from
    0 to ``num_draft_tokens`` by the goodput measured at the step's batch size (tokens
    emitted per second of step time, ``osd.speculative.DraftLengthController``): where
    drafting does not pay (a weak draft, a large batch whose verify forward is compute
    bound) the steps become plain decoding through the verify path. The output stays the
    target's (greedy: token for token; sampled: in distribution), but sampled tokens for a
    fixed seed then depend on the batch a request ran in, since the chain lengths do.
    """

    num_draft_tokens: int = 4  # k: chain length / most drafts per step
    tree: object = None  # None | list of rank paths | DynamicTree
    drafter: str = "model"  # "model" (separate draft), "self" (layer skip), "ngram"
    skip_layers: tuple[int, ...] | None = None  # self: target layers skipped (default: odd ones)
    ngram_max: int = 3  # ngram: longest suffix matched in the context
    ngram_min: int = 1  # ngram: shortest suffix matched
    prompt_lookup: bool = False  # model/self: prompt lookup first (a chain); the draft
    #                                      model (chain or tree) where some row has no match
    lookup_history: int = 0  # lookup also in this many tokens of finished
    #                                      requests (0: only the request's own text)
    lookup_tokens: int = 0  # prompt lookup: most drafts of a step whose rows all
    #                                      match (0: num_draft_tokens)
    lookup_tree_below: int = 0  # prompt lookup: matches shorter than this verify
    #                                      beside the model's chain, in one tree (0: off)
    adaptive: bool = False  # stop drafting a row when the draft is unsure
    adaptive_floor: float = 0.35  # adaptive: stop when P(reach and accept) < floor
    adaptive_init_threshold: float = 0.3  # adaptive: confidence threshold before calibration
    auto_k: bool = False  # chain length per step from measured goodput per
    #                                      batch size, 0 (plain decoding) when drafts do not pay
    exact_alpha: bool = True  # report 1 - TV(p, q) (one softmax per drafted row)
    cuda_graphs: bool = True  # capture draft and verify forwards on CUDA

    def lookup_alone(self) -> "SpecConfig":
        """This config's prompt lookup without a draft model: the ``"ngram"`` drafter with
        the same n-gram sizes and history, drafting up to ``max(num_draft_tokens,
        lookup_tokens)`` tokens. What ``prompt_lookup=True`` means when no draft is given."""
        return dataclasses.replace(
            self,
            drafter="ngram",
            prompt_lookup=False,
            tree=None,
            lookup_tokens=0,
            lookup_tree_below=0,
            adaptive=False,
            num_draft_tokens=max(self.num_draft_tokens, self.lookup_tokens),
        )

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"SpecConfig.drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if not 1 <= self.num_draft_tokens < MAX_TREE_NODES:
            raise ValueError(
                f"SpecConfig.num_draft_tokens must be in 1..{MAX_TREE_NODES - 1}, "
                f"got {self.num_draft_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"SpecConfig needs 1 <= ngram_min <= ngram_max, got "
                f"{self.ngram_min}, {self.ngram_max}"
            )
        if not 0.0 < self.adaptive_floor < 1.0:
            raise ValueError(
                f"SpecConfig.adaptive_floor must be in (0, 1), got {self.adaptive_floor}"
            )
        if self.tree is not None and not isinstance(self.tree, (DynamicTree, StaticTree)):
            self.tree = StaticTree.from_paths(self.tree)
        if self.tree is not None and self.drafter == "ngram":
            raise ValueError("the ngram drafter proposes a chain; use tree=None")
        if self.prompt_lookup and self.drafter == "ngram":
            raise ValueError(
                "SpecConfig(prompt_lookup=True) adds prompt lookup to a model "
                "drafter; drafter='ngram' already is prompt lookup"
            )
        if not 0 <= self.lookup_tokens < MAX_TREE_NODES:
            raise ValueError(
                f"SpecConfig.lookup_tokens must be in 0..{MAX_TREE_NODES - 1}, "
                f"got {self.lookup_tokens}"
            )
        if self.lookup_tokens and not self.prompt_lookup:
            raise ValueError(
                "SpecConfig.lookup_tokens sets prompt lookup's chain length: set "
                "prompt_lookup=True (the ngram drafter's is num_draft_tokens)"
            )
        if not 0 <= self.lookup_tree_below <= self.ngram_max + 1:
            raise ValueError(
                f"SpecConfig.lookup_tree_below must be in 0..ngram_max + 1 = "
                f"{self.ngram_max + 1}, got {self.lookup_tree_below}"
            )
        if self.lookup_tree_below and not self.prompt_lookup:
            raise ValueError(
                "SpecConfig.lookup_tree_below puts prompt lookup beside the draft "
                "model: set prompt_lookup=True"
            )
        if self.lookup_tree_below and (self.tree is not None or self.adaptive):
            raise ValueError(
                "SpecConfig.lookup_tree_below builds its own tree from the model's "
                "chain: it does not combine with tree= or adaptive=True"
            )
        if self.lookup_tree_below and (
            1 + max(self.num_draft_tokens, self.lookup_tokens) + self.num_draft_tokens
            > MAX_TREE_NODES
        ):
            raise ValueError(
                f"SpecConfig.lookup_tree_below verifies up to 1 + "
                f"max(num_draft_tokens, lookup_tokens) + num_draft_tokens nodes, "
                f"at most {MAX_TREE_NODES}: got num_draft_tokens="
                f"{self.num_draft_tokens}, lookup_tokens={self.lookup_tokens}"
            )
        if self.lookup_history < 0:
            raise ValueError(f"SpecConfig.lookup_history must be >= 0, got {self.lookup_history}")
        if self.lookup_history and not (self.prompt_lookup or self.drafter == "ngram"):
            raise ValueError(
                "SpecConfig.lookup_history extends prompt lookup: set "
                "prompt_lookup=True (or drafter='ngram')"
            )
        if self.auto_k and (self.tree is not None or self.adaptive):
            raise ValueError(
                "SpecConfig(auto_k=True) picks a chain length per step; it does "
                "not combine with trees or adaptive=True"
            )

    @property
    def is_tree(self) -> bool:
        return self.tree is not None


def describe(spec: SpecConfig) -> str:
    """``spec``'s fields that differ from the defaults, ``"name=value, ..."`` (the chain of
    4 of a plain ``SpecConfig()`` reads ``num_draft_tokens=4``)."""
    default = SpecConfig()
    changed = [
        f"{f.name}={getattr(spec, f.name)!r}"
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
