"""osd.models.gguf.export.write_draft_gguf (scripts/draft_to_gguf.py): a draft directory
written as a GGUF file for llama.cpp's draft mode loads back (through osd's GGUF reader,
which undoes llama.cpp's Q/K row order) as the same model up to its Q8_0 rounding, with the
target's tokenizer metadata and its own shape; a draft of another vocabulary is refused."""

import pytest
import torch

from osd.models import load_model
from osd.models.gguf import GGUFFile
from osd.models.gguf.export import write_draft_gguf
from tests.test_gguf import tiny_hf_model, to_gguf


def test_round_trip(tmp_path):
    target = tiny_hf_model("llama", tie=True, seed=0)
    to_gguf(target, tmp_path / "target.gguf", extra={"tokenizer.ggml.model": "gpt2"})
    draft = tiny_hf_model("llama", tie=True, seed=1)
    draft.save_pretrained(tmp_path / "draft")
    write_draft_gguf(
        str(tmp_path / "target.gguf"), str(tmp_path / "draft"), str(tmp_path / "d.gguf")
    )
    g = GGUFFile(tmp_path / "d.gguf")
    meta = g.metadata
    layer0 = {n.split(".")[2] for n in g.tensors if n.startswith("blk.0.")}
    assert layer0 == {  # llama.cpp's names for a Llama layer
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
        "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
    }  # fmt: skip
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
    with pytest.raises(ValueError, match="vocabulary"):
        write_draft_gguf(
            str(tmp_path / "target.gguf"), str(tmp_path / "draft"), str(tmp_path / "d.gguf")
        )
