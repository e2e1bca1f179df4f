"""What ``Engine.from_pretrained`` loads: the target, the drafts, the tokenizer, and the
settings a draft directory recommends (its ``serving.json``: speculation shape, block
format, online recipe) under the caller's own."""

from __future__ import annotations

import os

import torch

from osd.models.eagle import is_eagle_checkpoint, load_eagle
from osd.models.loading import (
    is_gguf_source,
    is_transformers_model,
    load_model,
    load_tokenizer,
    resolve_device,
)
from osd.models.quant import QuantLinear
from osd.online.config import draft_online_recipe, with_recipe
from osd.spec import SpecConfig, learning_beside, serving_settings

# The chain a draft serves while learning online where its directory recommends prompt
# lookup alone beside both targets (the length the chat draft's own settings use).
LEARNING_CHAIN = 3


def load_for_engine(
    target,
    draft,
    *,
    device,
    dtype,
    attention_backend,
    quantized,
    kv_dtype=None,
    tokenizer,
    spec,
    quantize_draft,
    online,
):
    """``(model, draft models, tokenizer, spec, quantize_draft, online)`` for
    ``Engine.from_pretrained`` (its arguments, documented there)."""
    drafts = [] if draft is None else list(draft) if isinstance(draft, (list, tuple)) else [draft]
    for name, source in [("target", target)] + [("draft", d) for d in drafts]:
        if source is not None and not (
            isinstance(source, (str, os.PathLike)) or is_transformers_model(source)
        ):
            raise TypeError(
                f"{name} must be a checkpoint directory path or a transformers "
                f"model, got {type(source).__name__}"
            )
    if quantized is None:  # int8 activations where the CPU has VNNI (load_gguf_model)
        quantized = (
            "int8"
            if is_gguf_source(target)
            and resolve_device(device).type == "cpu"
            and dtype == torch.float32
            else False
        )
    model = load_model(
        target, device=device, dtype=dtype, attention_backend=attention_backend, quantized=quantized
    )
    if kv_dtype is not None:
        set_kv_dtype(model, kv_dtype)
    draft_models = [
        load_eagle(d, model)
        if is_eagle_checkpoint(d)
        else load_model(d, device=device, dtype=dtype, attention_backend=attention_backend)
        for d in drafts
    ]
    if tokenizer is None:
        tokenizer = load_tokenizer(target)
    # The draft's recommendation for a target kept quantized; learning online needs the
    # draft model, so a recommendation of prompt lookup alone gives way to the float one,
    # served so that lookup alone still runs wherever the model's drafts do not pay.
    quantized_target = any(isinstance(m, QuantLinear) for m in model.modules())
    alone = None
    if spec is None and online is not None:
        rec, _ = serving_settings(drafts, draft_models, None, None, quantized_target)
        if quantized_target and rec is not None and rec.drafter != "model":
            alone, quantized_target = rec, False
    recommended = spec is None
    spec, quantize_draft = serving_settings(
        drafts, draft_models, spec, quantize_draft, quantized_target
    )
    if recommended and online is not None and draft_models and spec is not None:
        if spec.drafter == "ngram" and spec.lookup is not None:
            # lookup alone was measured fastest beside either target: learning still
            # needs the model, so it serves a chain behind that lookup, learning beside it
            alone = alone or spec
            spec = SpecConfig(num_draft_tokens=LEARNING_CHAIN, lookup=spec.lookup)
    if alone is not None and spec is not None and spec.drafter == "model":
        spec = learning_beside(spec, alone)
    if recommended and spec is not None and spec.drafter != "model":
        # the draft recommends a draft-free option beside this target: it is not served
        draft_models, quantize_draft = [], None
    if online is not None and len(drafts) == 1:
        online = with_recipe(online, draft_online_recipe(drafts[0]))
    return model, draft_models, tokenizer, spec, quantize_draft, online


def set_kv_dtype(model, kv_dtype) -> None:
    """Make ``model``'s caches keep K/V in ``kv_dtype`` (a ``torch.dtype`` or its name):
    its own dtype, or float16 under a float32 model on the CPU (ValueError otherwise)."""
    given = kv_dtype
    if isinstance(kv_dtype, str):
        kv_dtype = getattr(torch, kv_dtype, None)
    half_ok = model.device.type == "cpu" and model.dtype == torch.float32
    if kv_dtype != model.dtype and not (kv_dtype == torch.float16 and half_ok):
        raise ValueError(
            f"kv_dtype must be the model's dtype ({model.dtype}) or, for a float32 model on "
            f"the CPU, torch.float16; got {given!r}"
        )
    model.kv_dtype = None if kv_dtype == model.dtype else kv_dtype
