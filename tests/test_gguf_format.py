"""The GGUF file format (``osd.models.gguf.format``): metadata value types, array element
types and alignment as written and read back, and the errors for missing, foreign,
truncated and unsupported files, on tiny models converted as in ``tests.test_gguf``."""

import struct

import numpy as np
import pytest
import torch

from osd.models.gguf import GGMLType, GGUFFile, write_gguf
from osd.models.loading import load_model
from tests.test_gguf import tiny_hf_model, to_gguf

T = GGMLType


def test_written_numpy_arrays_keep_their_element_type(tmp_path):
    """``write_gguf`` stores a numpy array with its dtype (llama.cpp reads token_type only
    as int32), a list of ints as u32."""
    meta = {
        "general.architecture": "llama",
        "i32": np.array([2, -3, 7], dtype=np.int32),
        "f32": np.array([0.5, -1.0], dtype=np.float32),
        "u8": np.array([1, 255], np.uint8),
        "ints": [1, 2, 3],
    }
    write_gguf(tmp_path / "a.gguf", meta, {})
    raw = (tmp_path / "a.gguf").read_bytes()
    for key, etype in (("i32", 5), ("f32", 6), ("u8", 0), ("ints", 4)):
        at = raw.index(key.encode()) + len(key)
        assert struct.unpack_from("<II", raw, at) == (9, etype), key  # array of etype
    back = GGUFFile(tmp_path / "a.gguf").metadata
    assert back["i32"].tolist() == [2, -3, 7] and back["f32"].tolist() == [0.5, -1.0]
    assert back["u8"].tolist() == [1, 255] and list(back["ints"]) == [1, 2, 3]


def test_metadata_value_types_and_alignment(tmp_path):
    """A hand-packed file with every metadata value type and a 64-byte alignment."""

    def s(x):
        return struct.pack("<Q", len(x.encode())) + x.encode()

    kv = [
        ("general.architecture", 8, s("llama")),
        ("u8", 0, struct.pack("<B", 200)),
        ("i8", 1, struct.pack("<b", -5)),
        ("u16", 2, struct.pack("<H", 60000)),
        ("i16", 3, struct.pack("<h", -300)),
        ("u32", 4, struct.pack("<I", 4000000000)),
        ("i32", 5, struct.pack("<i", -7)),
        ("f32", 6, struct.pack("<f", 0.5)),
        ("bool", 7, struct.pack("<?", True)),
        ("u64", 10, struct.pack("<Q", 2**40)),
        ("i64", 11, struct.pack("<q", -(2**40))),
        ("f64", 12, struct.pack("<d", 0.1)),
        ("general.alignment", 4, struct.pack("<I", 64)),
        ("arr_i16", 9, struct.pack("<IQ", 3, 3) + struct.pack("<3h", -1, 0, 1)),
        ("arr_str", 9, struct.pack("<IQ", 8, 2) + s("a b") + s("ü")),
        ("arr_arr", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1) + struct.pack("<I", 9)),
    ]
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv))
    header += b"".join(s(k) + struct.pack("<I", t) + v for k, t, v in kv)
    header += s("w") + struct.pack("<I", 2) + struct.pack("<2Q", 4, 2) + struct.pack("<IQ", 0, 0)
    data = np.arange(8, dtype=np.float32).tobytes()
    path = tmp_path / "types.gguf"
    path.write_bytes(header + b"\0" * (-len(header) % 64) + data)
    g = GGUFFile(path)
    m = g.metadata
    assert (m["u8"], m["i8"], m["u16"], m["i16"], m["u32"], m["i32"]) == (
        200,
        -5,
        60000,
        -300,
        4000000000,
        -7,
    )
    assert (m["f32"], m["bool"], m["u64"], m["i64"], m["f64"]) == (0.5, True, 2**40, -(2**40), 0.1)
    assert m["arr_i16"].tolist() == [-1, 0, 1] and m["arr_str"] == ["a b", "ü"]
    assert m["arr_arr"][0].tolist() == [9]
    assert g.data_start % 64 == 0 and g.tensors["w"].shape == (2, 4)
    assert torch.equal(g.tensor("w"), torch.arange(8.0).reshape(2, 4))


# -- errors ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    return to_gguf(
        tiny_hf_model("llama", seed=6), tmp_path_factory.mktemp("good") / "m.gguf", T.Q4_0
    )


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(bad)
    bad.write_bytes(b"GG")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(bad)
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(ValueError, match="unsupported GGUF version 1"):
        load_model(bad)


def test_truncated_files(good_file, tmp_path):
    data = good_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    in_infos = data.index(b"blk.1.ffn_up.weight") + 5
    for size, where in (
        (40, "the header ends"),
        (in_infos, "the header ends"),
        (len(data) - 100, "tensor"),
    ):
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=f"truncated GGUF file.*{where}"):
            load_model(cut)


def test_unsupported_architecture_and_quantization(good_file, tmp_path):
    data = good_file.read_bytes()
    other = tmp_path / "falcon.gguf"
    other.write_bytes(
        data.replace(
            b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00gpt-2", 1
        )
    )
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt-2'.*llama"):
        load_model(other)
    # Re-type one tensor as IQ2_XXS: its type field follows the name, n_dims and the dims.
    name = b"blk.1.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    assert struct.unpack_from("<I", data, at)[0] == T.Q4_0
    iq = tmp_path / "iq2_xxs.gguf"
    iq.write_bytes(data[:at] + struct.pack("<I", T.IQ2_XXS) + data[at + 4 :])
    with pytest.raises(ValueError, match="'blk.1.ffn_up.weight' has quantization type IQ2_XXS"):
        load_model(iq)
    iq.write_bytes(data[:at] + struct.pack("<I", 99) + data[at + 4 :])
    with pytest.raises(ValueError, match="unknown type 99"):
        load_model(iq)


def test_missing_metadata_tensor_and_ambiguous_directory(tmp_path):
    hf = tiny_hf_model("llama", seed=7)
    to_gguf(hf, tmp_path / "a.gguf", skip=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match="missing 1 tensors: model.layers.1.mlp.down_proj"):
        load_model(tmp_path / "a.gguf")
    to_gguf(hf, tmp_path / "b.gguf", extra={"llama.block_count": None})
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="no metadata llama.block_count"):
        load_model(tmp_path / "b.gguf")
