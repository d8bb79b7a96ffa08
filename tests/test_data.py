import json
from pathlib import Path
import os

import numpy as np
import pytest
import torch

from data import DataError, PackedDataset, pack, resolve_source, tokenizer
from data.prepare import build_stdlib_corpus, unigram_entropy

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text", ["", "hello", "naïve café – 日本語 🚀", "tabs\tand\nnewlines\r\n", "\x00\x7f"])
def test_any_utf8_text_round_trips_through_the_byte_tokenizer(text):
    ids = tokenizer.ByteTokenizer().encode(text, bos=True, eos=True)
    assert ids[0] == tokenizer.BOS and ids[-1] == tokenizer.EOS
    assert all(0 <= i < tokenizer.VOCAB_SIZE for i in ids)
    assert tokenizer.ByteTokenizer().decode(ids) == text


def test_special_tokens_never_collide_with_a_byte_and_the_model_has_a_row_for_every_id():
    from model import ModelConfig

    every_byte = bytes(range(256)).decode("latin-1")  # 256 characters, whose UTF-8 covers 128 bytes plus lead bytes
    ids = tokenizer.ByteTokenizer().encode(every_byte, bos=True, eos=True)
    specials = {tokenizer.BOS, tokenizer.EOS, tokenizer.PAD}
    assert len(specials) == 3 and not specials & set(ids[1:-1])
    assert tokenizer.ByteTokenizer().decode([tokenizer.BOS, *ids, tokenizer.PAD, tokenizer.EOS]) == every_byte  # specials are dropped
    assert max(specials) < tokenizer.VOCAB_SIZE <= ModelConfig().vocab_size


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_documents_are_framed_joined_and_cut_into_samples_of_seq_len_plus_one(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", ["abc", "de", "fghij"])
    bin_path, meta = pack(src, seq_len=4, cache_dir=tmp_path / "cache")
    stream = tokenizer.ByteTokenizer().encode("abc", True, True) + tokenizer.ByteTokenizer().encode("de", True, True) + tokenizer.ByteTokenizer().encode("fghij", True, True)
    assert len(stream) == 16 and meta["num_samples"] == 3  # 16 // 5, the tail of 1 token dropped
    data = np.fromfile(bin_path, dtype=np.uint16)
    assert data.tolist() == stream[:15]
    ds = PackedDataset(bin_path, 4)
    x, y = ds[1]
    assert x.tolist() == stream[5:9] and y.tolist() == stream[6:10]
    assert x.dtype == torch.int64
    assert meta["source_sha256"] and meta["tokenizer"] == tokenizer.NAME and meta["seq_len"] == 4


def test_the_packed_file_is_reused_until_the_source_changes(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", ["one document of text", "another"])
    bin_path, meta = pack(src, 4, tmp_path / "cache")
    stamp = os.stat(bin_path).st_mtime_ns
    bin2, meta2 = pack(src, 4, tmp_path / "cache")
    same = lambda m: {k: v for k, v in m.items() if k != "sources"}  # noqa: E731 (sources: when each file was last checked)
    assert bin2 == bin_path and os.stat(bin_path).st_mtime_ns == stamp and same(meta2) == same(meta)
    write_jsonl(src, ["one document of text", "changed"])
    _, meta3 = pack(src, 4, tmp_path / "cache")
    assert meta3["source_sha256"] != meta["source_sha256"]
    # another seq_len is another packed file, the first one stays valid
    bin8, _ = pack(src, 8, tmp_path / "cache")
    assert bin8 != bin_path


def test_num_samples_limits_the_dataset_to_the_first_n(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", ["x" * 100])
    bin_path, meta = pack(src, 4, tmp_path / "cache")
    full, first = PackedDataset(bin_path, 4), PackedDataset(bin_path, 4, num_samples=7)
    assert len(first) == 7 and torch.equal(first[6][0], full[6][0])
    with pytest.raises(IndexError):
        first[7]
    with pytest.raises(ValueError, match="data.num_samples"):
        PackedDataset(bin_path, 4, num_samples=meta["num_samples"] + 1)


@pytest.mark.parametrize("content, match", [
    ('{"text": "fine"}\nnot json at all\n', r"c\.jsonl:2: line is not valid JSON"),
    ('{"text": "fine"}\n\n{"txt": "wrong key"}\n', r'c\.jsonl:3: expected an object with a string "text"'),
    ('{"text": 42}\n', r'c\.jsonl:1: expected an object with a string "text"'),
    ("\n\n", r"c\.jsonl: the corpus is empty"),
    ('{"text": "ab"}\n', r"c\.jsonl: 4 tokens do not fill one sample"),
])
def test_bad_input_names_the_file_and_line_and_leaves_no_cache(tmp_path, content, match):
    src = tmp_path / "c.jsonl"
    src.write_text(content)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=match):
        pack(src, 8, cache)
    assert list(cache.iterdir()) == []  # nothing half-written, not even a temporary


def test_a_missing_corpus_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl does not exist"):
        resolve_source(str(tmp_path / "nope.jsonl"), tmp_path)


def test_the_builtin_corpora_are_built_from_stdlib_docstrings_in_minimind_formats(tmp_path, monkeypatch):
    import sysconfig

    from data import chat
    from data.prepare import build_stdlib_chat
    from data.sources import Corpus, Reader

    # Two packages of the real standard library stand for all of it (the whole takes 12 s to parse here).
    real = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**real, "stdlib": str(Path(real["stdlib"]) / "email")})
    path = build_stdlib_corpus(tmp_path / "stdlib.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) > 100
    assert all(isinstance(json.loads(line)["text"], str) for line in lines)
    bin_path, meta = pack(path, 64, tmp_path / "cache")
    # bytes of English text: well above 2 nats, well below uniform over 259
    assert 2.0 < unigram_entropy(bin_path) < 5.0
    conversations = [c for c, _ in Reader(Corpus.of_file(build_stdlib_chat(tmp_path / "chat.jsonl")), parse=chat.parse_conversation)]
    assert len(conversations) > 50
    assert all([m["role"] for m in c[0]][-2:] == ["user", "assistant"] for c in conversations)
    assert sum(c[0][0]["role"] == "system" for c in conversations) == -(-len(conversations) // 7)  # every seventh
