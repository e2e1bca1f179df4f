"""Training the zoo's tokenizer and its Llama target and draft on the stdlib corpus.

Plain PyTorch: transformers' own ``LlamaForCausalLM``, AdamW with linear warm-up and
cosine decay, gradient clipping, a tqdm progress bar. Batch rows are random windows of
the concatenated documents of one domain (documents separated by the EOS token); a
model's ``code_fraction`` is the probability that a row comes from the ``code`` domain,
which is how the draft is made to learn mostly prose while the target learns both.

Checkpoints are written with ``save_pretrained`` (safetensors) plus the tokenizer files,
so they load with transformers and with ``osd``. Weights may be stored in float16 to
halve their size; ``config.json`` keeps ``"dtype": "float32"``, so loaders that follow
the config (transformers' ``dtype="auto"``) upcast them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from osd.zoo import corpus, locate

EOS = "<|endoftext|>"
PAD = "<|pad|>"
VOCAB_SIZE = 2048
# Context length the models are trained at; config.json allows longer (RoPE), but quality
# beyond this is untested.
TRAIN_CONTEXT = 256
MAX_POSITIONS = 1024


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama model and how it is trained."""

    hidden_size: int  # model width
    num_layers: int  # decoder layers
    num_heads: int  # attention heads (no GQA: as many KV heads)
    intermediate_size: int  # SwiGLU hidden width
    steps: int  # optimizer steps
    batch_size: int  # sequences per step
    seq_len: int  # tokens per sequence
    lr: float  # peak AdamW learning rate
    warmup: int  # linear warm-up steps
    code_fraction: float  # probability that a training sequence comes from "code"
    seed: int  # initialisation and batch sampling seed


# Target: trained on both domains. Draft: one wide layer, mostly prose, so that its
# acceptance on the code stream starts low and has room to rise with online distillation.
# Code draft: the same shape and schedule on code only, the matching draft for a router to
# find (with 10% prose it came close to the draft on prose; see docs/zoo.md).
TARGET = ModelSpec(
    hidden_size=320,
    num_layers=6,
    num_heads=5,
    intermediate_size=864,
    steps=480,
    batch_size=8,
    seq_len=TRAIN_CONTEXT,
    lr=2e-3,
    warmup=30,
    code_fraction=0.7,
    seed=0,
)
DRAFT = ModelSpec(
    hidden_size=256,
    num_layers=1,
    num_heads=4,
    intermediate_size=768,
    steps=220,
    batch_size=8,
    seq_len=TRAIN_CONTEXT,
    lr=3e-3,
    warmup=20,
    code_fraction=0.1,
    seed=1,
)
DRAFT_CODE = replace(DRAFT, code_fraction=1.0, seed=2)
# Checkpoint directory name -> recipe.
MODELS = {"target": TARGET, "draft": DRAFT, "draft_code": DRAFT_CODE}


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style pre-tokenization) trained on ``texts``.

    Special tokens: ``<|endoftext|>`` (id 0; BOS, EOS and document separator) and
    ``<|pad|>`` (id 1). Nothing is added automatically around encoded text.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
    )


def encode_documents(
    tokenizer: PreTrainedTokenizerFast, docs: list[corpus.Document]
) -> torch.Tensor:
    """The documents' tokens concatenated, each followed by EOS: int64 ``[N]``."""
    encoded = tokenizer.backend_tokenizer.encode_batch(
        [d.text for d in docs], add_special_tokens=False
    )
    flat = []
    for enc in encoded:
        flat.extend(enc.ids)
        flat.append(tokenizer.eos_token_id)
    return torch.tensor(flat, dtype=torch.long)


def llama_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The transformers config of a model of shape ``spec``."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _sample_batch(
    streams: dict[str, torch.Tensor], spec: ModelSpec, gen: torch.Generator
) -> torch.Tensor:
    """``[batch_size, seq_len]`` random windows; each row's domain drawn by code_fraction."""
    rows = []
    pick_code = torch.rand(spec.batch_size, generator=gen) < spec.code_fraction
    for is_code in pick_code.tolist():
        stream = streams["code" if is_code else "prose"]
        start = int(torch.randint(0, stream.numel() - spec.seq_len, (1,), generator=gen))
        rows.append(stream[start : start + spec.seq_len])
    return torch.stack(rows)


def _lr_at(step: int, spec: ModelSpec) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train_model(
    spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, streams: dict[str, torch.Tensor], desc: str
) -> tuple[LlamaForCausalLM, dict]:
    """Train a fresh ``LlamaForCausalLM`` of shape ``spec`` on ``streams``.

    Args:
        spec: model shape and training schedule.
        tokenizer: the zoo tokenizer (sets the vocabulary and special ids).
        streams: ``{"prose": [N1], "code": [N2]}`` int64 token streams.
        desc: progress-bar label.

    Returns:
        ``(model, info)``: the model in eval mode, float32; ``info`` has the mean loss
        of the last 20 steps, the wall time and the number of training tokens seen.
    """
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(llama_config(spec, tokenizer))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(spec.seed)
    losses = []
    start = time.perf_counter()
    bar = tqdm(range(spec.steps), desc=desc, unit="step", dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, spec)
        batch = _sample_batch(streams, spec, gen)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())  # host sync once per step, for the progress bar
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    info = {
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "train_seconds": round(time.perf_counter() - start, 1),
        "train_tokens": spec.steps * spec.batch_size * spec.seq_len,
    }
    return model, info


def save_checkpoint(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    path: str,
    *,
    storage_dtype: torch.dtype = torch.float16,
    meta: dict | None = None,
) -> None:
    """Write ``model`` and ``tokenizer`` to the directory ``path`` (created or replaced).

    The weights go to ``model.safetensors`` in ``storage_dtype`` while ``config.json``
    records the model's compute dtype (float32). ``meta`` is written to ``zoo.json``.
    """
    state = {k: v.detach().to(storage_dtype).contiguous() for k, v in model.state_dict().items()}
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(path)
    _portable_tokenizer_files(path, tokenizer)
    if meta is not None:
        with open(os.path.join(path, "zoo.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")


def _portable_tokenizer_files(path: str, tokenizer: PreTrainedTokenizerFast) -> None:
    """Name the tokenizer class every transformers release knows and write the special
    tokens map that older releases read."""
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    special = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
    }
    for name, data in (
        (config_file, config),
        (os.path.join(path, "special_tokens_map.json"), special),
    ):
        with open(name, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")


def scaled(spec: ModelSpec, scale: float) -> ModelSpec:
    """``spec`` with its step and warm-up counts multiplied by ``scale`` (at least 2 steps)."""
    steps = max(2, round(spec.steps * scale))
    return replace(spec, steps=steps, warmup=max(1, min(spec.warmup, steps // 4)))


def build(
    out_dir: str,
    *,
    scale: float = 1.0,
    root: str | None = None,
    roles: tuple[str, ...] = tuple(MODELS),
    specs: dict[str, ModelSpec] | None = None,
) -> dict[str, str]:
    """Train the tokenizer and the models named in ``roles``; write ``out_dir/<role>``.

    The checkpoints are first written to a temporary directory beside ``out_dir`` and
    then moved into place, so an interrupted build never leaves a half-written model.
    Other subdirectories of ``out_dir`` are left alone.

    Args:
        out_dir: destination; existing subdirectories named in ``roles`` are replaced.
        scale: multiplies every training step count (1.0 = the shipped recipe).
        root: stdlib directory (default: the running interpreter's).
        roles: which of :data:`MODELS` to (re)train. The tokenizer is retrained either
            way, deterministically, so models built in separate runs share it.
        specs: recipes by role (default :data:`MODELS`).

    Returns:
        ``{role: checkpoint directory}`` for every role built.

    Raises:
        ValueError: on an unknown role.
    """
    specs = MODELS if specs is None else specs
    unknown = [r for r in roles if r not in specs]
    if unknown:
        raise ValueError(f"unknown zoo roles {unknown}; known: {sorted(specs)}")
    texts = {dom: corpus.documents(dom, "train", root) for dom in corpus.DOMAINS}
    tokenizer = train_tokenizer([d.text for dom in corpus.DOMAINS for d in texts[dom]])
    streams = {dom: encode_documents(tokenizer, texts[dom]) for dom in corpus.DOMAINS}
    common = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corpus_tokens": {dom: int(s.numel()) for dom, s in streams.items()},
        "threads": torch.get_num_threads(),
    }
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".zoo-build-", dir=os.path.dirname(out_dir))
    try:
        for name in roles:
            spec = scaled(specs[name], scale)
            model, info = train_model(spec, tokenizer, streams, desc=f"zoo {name}")
            meta = {"role": name, "spec": asdict(spec), **info, **common}
            save_checkpoint(model, tokenizer, os.path.join(tmp, name), meta=meta)
        os.makedirs(out_dir, exist_ok=True)
        for name in roles:
            dest = os.path.join(out_dir, name)
            if os.path.isdir(dest):
                shutil.rmtree(dest)
            os.replace(os.path.join(tmp, name), dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    built = {name: os.path.join(out_dir, name) for name in roles}
    print(f"zoo: wrote {', '.join(built.values())}", file=sys.stderr)
    return built


def main(argv=None) -> int:
    """``python -m osd.zoo.train``: train the built-in pair into the zoo cache, where
    ``osd.zoo.default_pair`` finds it when neither ``$OSD_ZOO_WEIGHTS`` nor a source
    checkout has it (``scripts/build_zoo.py`` is the same build into the checkout)."""
    parser = argparse.ArgumentParser(
        prog="python -m osd.zoo.train",
        description="Train the built-in pair (tokenizer, target, draft, draft_code) on the "
        "running Python's standard library.",
    )
    parser.add_argument(
        "--out",
        default=locate.cache_dir(),
        help="zoo directory; each model goes to OUT/<name> (default %(default)s)",
    )
    parser.add_argument(
        "--only",
        choices=tuple(MODELS),
        default=None,
        help=f"train one model only (default: all of {', '.join(MODELS)})",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every training step count (1.0)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    build(args.out, scale=args.scale, roles=(args.only,) if args.only else tuple(MODELS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
