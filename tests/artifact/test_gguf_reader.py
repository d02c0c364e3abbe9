"""`gguf_reader` reads what gguf-py reads, value for value and byte for byte, and refuses
what is not GGUF with an `ArtifactError` naming the field; strings that are not UTF-8 are
refused naming the key and the index, except a SentencePiece token, kept as its bytes
(issue 30, defect 6)."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from slotserve.artifact.gguf_file import open_gguf, read_metadata
from slotserve.artifact.gguf_reader import GGUFFile, read_gguf
from slotserve.artifact.gguf_tokenizer import tokenizer_from_gguf
from slotserve.errors import ArtifactError
from slotserve.testing import write_tiny_gguf
from slotserve.tokenizer.spm import SpmVocab
from tests.artifact.gguf_bytes import (
    FIRST_KEY,
    array_element_at,
    gguf_file,
    gguf_kv,
    gguf_string,
    replace_bytes,
    tensor_dims_at,
    value_at,
)

STRING, ARRAY, UINT32 = 8, 9, 4


def assert_same_as_gguf_py(ours: GGUFFile, path: Path) -> None:
    theirs = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, their in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.data_offset) == (
            their.name, their.tensor_type, their.data_offset
        )  # fmt: skip
        assert mine.shape == tuple(int(n) for n in their.shape)
        assert (mine.n_elements, mine.n_bytes) == (their.n_elements, their.n_bytes)
        assert mine.data.dtype == their.data.dtype and mine.data.shape == their.data.shape
        assert np.array_equal(mine.data, their.data, equal_nan=True), mine.name
    # Read with its values skipped (as choosing a weight format reads it): the same tensor
    # table, and of the metadata only the alignment.
    skipped = read_gguf(path, values=False)
    alignment = {k: v for k, v in fields.items() if k == "general.alignment"}
    assert skipped.metadata == alignment and skipped.data_offset == ours.data_offset
    assert [(t.name, t.tensor_type, t.shape, t.data_offset) for t in skipped.tensors] == [
        (t.name, t.tensor_type, t.shape, t.data_offset) for t in ours.tensors
    ]


@pytest.mark.parametrize(
    ("kind", "qtype"),
    [("llama", "F32"), ("qwen2", "F16"), ("qwen3", "BF16"), ("gemma3", "Q8_0"),
     ("llama", "Q4_0"), ("qwen2", "Q4_1"), ("gemma3", "Q4_K_M"), ("gemma3", "Q6_K")],
)  # fmt: skip
def test_tiny_files_read_as_gguf_py_reads_them(tmp_path: Path, kind: str, qtype: str) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", kind, qtype)
    assert_same_as_gguf_py(read_gguf(path), path)


def test_the_bundled_model_reads_as_gguf_py_reads_it() -> None:
    from slotserve.artifact.bundled import bundled_gguf_path

    path = bundled_gguf_path()
    assert_same_as_gguf_py(read_gguf(path), path)


def test_gemma3_reads_as_gguf_py_reads_it() -> None:
    from slotserve.artifact.gemma3 import gemma3_gguf_path

    try:
        path = gemma3_gguf_path()
    except ArtifactError as missing:
        pytest.skip(f"Gemma 3 270M is not installed: {missing}")
    assert_same_as_gguf_py(read_gguf(path), path)


# -- strings that are not UTF-8 ---------------------------------------------------------------


def _tiny(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0")


def _refusal(path: Path) -> ArtifactError:
    with pytest.raises(ArtifactError) as err:
        meta = read_metadata(open_gguf(path))
        tokenizer_from_gguf(meta, str(path))
    assert err.value.path == str(path)
    assert "codec" not in str(err.value)  # not Python's bare UnicodeDecodeError text
    return err.value


def test_a_bpe_token_that_is_not_utf8_is_refused_naming_its_index(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    data = path.read_bytes()
    at = array_element_at(data, "tokenizer.ggml.tokens", 200)
    old = data[at + 8 : at + 10]
    assert len(old.decode()) == 1  # a two-byte character of the byte-level alphabet
    replace_bytes(path, old, b"\xf4\x80", after=at)
    err = _refusal(path)
    assert err.field == "tokenizer.ggml.tokens"
    assert "token 200 is not UTF-8" in str(err) and "0xf4" in str(err)


def test_a_chat_template_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    replace_bytes(
        path, b"{%", b"\xf4%", after=value_at(path.read_bytes(), "tokenizer.chat_template")
    )
    err = _refusal(path)
    assert err.field == "tokenizer.chat_template" and "0xf4 at offset 0" in str(err)


def test_a_string_value_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    replace_bytes(
        path, b"gpt-2", b"gpt\xff2", after=value_at(path.read_bytes(), "tokenizer.ggml.pre")
    )
    err = _refusal(path)
    assert err.field == "tokenizer.ggml.pre" and "0xff at offset 3 of 5" in str(err)


def test_an_element_of_a_string_array_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    merges = [gguf_string(b"a b"), gguf_string(b"c d"), gguf_string(b"e \xc3")]
    array = struct.pack("<IQ", STRING, len(merges)) + b"".join(merges)
    path = gguf_file(tmp_path / "m.gguf", [gguf_kv(b"tokenizer.ggml.merges", ARRAY, array)])
    err = _refusal(path)
    assert err.field == "tokenizer.ggml.merges" and "element 2 is not UTF-8" in str(err)


def test_a_key_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    replace_bytes(path, b"tokenizer.ggml.pre", b"tokenizer.ggml.pr\xe9")
    err = _refusal(path)
    assert err.field == "key 10 of 17" and "is not UTF-8" in str(err)


def test_a_tensor_name_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    replace_bytes(path, b"blk.0.attn_q.weight", b"blk.0.attn_q.weigh\x80")
    err = _refusal(path)
    assert err.field is not None and err.field.startswith("tensor ") and "UTF-8" in str(err)


def _spm_file(path: Path, model: str) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    bytes_tokens = [f"<0x{b:02X}>".encode() for b in range(256)]
    writer.add_tokenizer_model(model)
    writer.add_token_list([b"<unk>", b"<s>", b"</s>", b"a", b"\xe4\xb8", b"\xad", *bytes_tokens])
    writer.add_token_scores([0.0] * 262)
    writer.add_token_types([2, 3, 3, 1, 1, 1] + [6] * 256)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_sentencepiece_token_that_is_not_utf8_keeps_its_bytes(tmp_path: Path) -> None:
    """As llama.cpp: the token decodes to the file's bytes (two of them make 中), and the
    encoder never produces it (中 is one character, not a token: its three byte tokens)."""
    from slotserve.tokenizer import Tokenizer

    path = _spm_file(tmp_path / "spm.gguf", "llama")
    tokenizer = tokenizer_from_gguf(read_metadata(open_gguf(path)), str(path))
    for each in (tokenizer, Tokenizer.from_json(tokenizer.to_json())):
        vocab = each.backend
        assert isinstance(vocab, SpmVocab)
        assert vocab.piece(4) == b"\xe4\xb8" and vocab.piece(5) == b"\xad"
        assert each.decode([4, 5]) == "中"
        assert each.encode("a中", add_bos=False) == [3, 6 + 0xE4, 6 + 0xB8, 6 + 0xAD]


def test_the_same_token_in_a_byte_level_vocabulary_is_refused(tmp_path: Path) -> None:
    path = _spm_file(tmp_path / "bpe.gguf", "gpt2")
    err = _refusal(path)
    assert err.field == "tokenizer.ggml.tokens" and "token 4 is not UTF-8" in str(err)


# -- what is not GGUF --------------------------------------------------------------------------


def _refused(path: Path) -> ArtifactError:
    """The refusal of ``path``, which a read skipping the metadata's values gives too."""
    with pytest.raises(ArtifactError) as err:
        read_gguf(path)
    with pytest.raises(ArtifactError) as skipping:
        read_gguf(path, values=False)
    assert (str(skipping.value), skipping.value.field) == (str(err.value), err.value.field)
    return err.value


def test_big_endian_and_old_versions_are_refused(tmp_path: Path) -> None:
    big = gguf_file(tmp_path / "be.gguf", [], version=3 << 24)
    assert "big-endian" in str(_refused(big))
    old = gguf_file(tmp_path / "v1.gguf", [], version=1)
    assert _refused(old).field == "version" and "version 1" in str(_refused(old))


def test_malformed_metadata_is_refused_naming_the_key(tmp_path: Path) -> None:
    one = struct.pack("<I", 1)
    cases = {
        "twice": [gguf_kv(b"a.key", UINT32, one), gguf_kv(b"a.key", UINT32, one)],
        "unknown GGUF value type 13": [gguf_kv(b"a.key", 13, one)],
        "array of arrays": [gguf_kv(b"a.key", ARRAY, struct.pack("<IQ", ARRAY, 0))],
        "unknown GGUF array element type 99": [gguf_kv(b"a.key", ARRAY, struct.pack("<IQ", 99, 0))],
    }
    for words, pairs in cases.items():
        err = _refused(gguf_file(tmp_path / "m.gguf", pairs))
        assert err.field == "a.key" and words in str(err), err


def test_a_bad_alignment_is_refused(tmp_path: Path) -> None:
    three = gguf_kv(b"general.alignment", UINT32, struct.pack("<I", 3))
    assert "power of two" in str(_refused(gguf_file(tmp_path / "a.gguf", [three])))
    wide = gguf_kv(b"general.alignment", 10, struct.pack("<Q", 32))
    assert "not uint32" in str(_refused(gguf_file(tmp_path / "b.gguf", [wide])))


@pytest.mark.parametrize("n_dims", [0, 5, 1 << 31])
def test_a_dimension_count_outside_one_to_four_is_refused(tmp_path: Path, n_dims: int) -> None:
    path = _tiny(tmp_path)
    data = bytearray(path.read_bytes())
    at = tensor_dims_at(bytes(data), "blk.0.attn_q.weight") - 4
    data[at : at + 4] = struct.pack("<I", n_dims)
    path.write_bytes(bytes(data))
    err = _refused(path)
    assert err.field == "blk.0.attn_q.weight" and f"has {n_dims} dimensions" in str(err)


def test_a_file_cut_inside_a_value_is_refused_naming_its_key(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: value_at(data, "tokenizer.chat_template") + 20])
    err = _refused(path)
    assert err.field == "tokenizer.chat_template" and "12 bytes are left" in str(err)


def test_a_header_cut_short_is_refused(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    path.write_bytes(path.read_bytes()[: FIRST_KEY - 3])
    err = _refused(path)
    assert err.field == "kv_count" and "needs 8 bytes" in str(err)
