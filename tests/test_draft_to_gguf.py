"""scripts/draft_to_gguf.py: a draft directory written as a GGUF file for llama.cpp's
draft mode loads back (through osd's GGUF reader, which undoes llama.cpp's Q/K row order)
as the same model up to its Q8_0 rounding, with the target's tokenizer metadata and its own
shape; a draft of another vocabulary is refused."""

import importlib.util
import os

import pytest
import torch

from osd.models import load_model
from osd.models.gguf import GGUFFile
from tests.test_gguf import to_gguf, tiny_hf_model

_SPEC = importlib.util.spec_from_file_location(
    "draft_to_gguf",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "draft_to_gguf.py"),
)
draft_to_gguf = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(draft_to_gguf)


def test_round_trip(tmp_path):
    target = tiny_hf_model("llama", tie=True, seed=0)
    to_gguf(target, tmp_path / "target.gguf", extra={"tokenizer.ggml.model": "gpt2"})
    draft = tiny_hf_model("llama", tie=True, seed=1)
    draft.save_pretrained(tmp_path / "draft")
    draft_to_gguf.convert(
        str(tmp_path / "target.gguf"), str(tmp_path / "draft"), str(tmp_path / "d.gguf")
    )
    meta = GGUFFile(tmp_path / "d.gguf").metadata
    assert meta["tokenizer.ggml.model"] == "gpt2"  # the target's tokenizer
    assert meta["llama.block_count"] == draft.config.num_hidden_layers
    ids = torch.randint(
        0, draft.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        ref = load_model(tmp_path / "draft")
        got = load_model(tmp_path / "d.gguf")
        a, b = ref(ids, ref.new_cache(1, 16)), got(ids, got.new_cache(1, 16))
    # Q8_0 weights (the tiny model's are drawn wide): within 10%; a wrong Q/K row order
    # would be far off
    assert (a - b).abs().max() <= 0.1 * a.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_other_vocabulary_is_refused(tmp_path):
    to_gguf(tiny_hf_model("llama", tie=True), tmp_path / "target.gguf")
    draft = tiny_hf_model("llama", tie=True, seed=1)
    draft.resize_token_embeddings(draft.config.vocab_size + 32)
    draft.save_pretrained(tmp_path / "draft")
    with pytest.raises(SystemExit, match="vocabulary"):
        draft_to_gguf.convert(
            str(tmp_path / "target.gguf"), str(tmp_path / "draft"), str(tmp_path / "d.gguf")
        )
