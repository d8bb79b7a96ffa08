"""Real tokenizers: MiniMind's own file (../shared/minimind, used as it is), one trained here with
`python -m data.tokenizer train`, uint32 packing, and the tokenizer as part of a run's identity."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import launch
from conftest import MINIMIND_SHARED, needs_referee, train_cli
from checkpoint import storage
from run import folder as runfolder
from data import PackedDataset, pack
from data import tokenizer as tokenizers

ROOT = Path(__file__).resolve().parents[1]
MINIMIND = MINIMIND_SHARED / "tokenizer.json"
needs_minimind = needs_referee(MINIMIND, "MiniMind's tokenizer")


@needs_minimind
@pytest.mark.unit
@pytest.mark.parametrize("text", ["你好，世界！这是一个测试。", "Return the number of items in the container.",
                                  "MiniMind 是一个小型语言模型, trained from scratch in 2 hours.", ""])
def test_minimind_tokenizer_round_trips_chinese_and_english_and_reads_its_special_ids_from_its_config(text):
    tok = tokenizers.load(str(MINIMIND))
    config = json.loads(MINIMIND.with_name(tokenizers.CONFIG_FILE).read_text())
    vocab = json.loads(MINIMIND.read_text())["added_tokens"]
    ids_of = {t["content"]: t["id"] for t in vocab}
    assert (tok.bos, tok.eos, tok.pad) == (ids_of[config["bos_token"]], ids_of[config["eos_token"]], ids_of[config["pad_token"]]) == (1, 2, 0)
    assert tok.vocab_size == 6400 and tok.name.startswith("sha256:")
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == text
    if any("\u4e00" <= c <= "\u9fff" for c in text):  # BPE merges Chinese: fewer ids than UTF-8 bytes
        assert len(ids) - 2 < len(text.encode("utf-8")) / 2
    packed = tok.pack_batch([text, text])
    assert packed.dtype == np.uint16 and packed.tolist() == ids + ids


@pytest.mark.e2e
def test_a_tokenizer_trained_twice_on_the_same_corpus_gives_the_same_bytes(tmp_path, corpus, trained):
    again = tmp_path / "b"
    proc = train_cli("--vocab-size", "400", "--out", str(again), str(corpus))
    assert proc.returncode == 0, proc.stderr
    for name in (tokenizers.TOKENIZER_FILE, tokenizers.CONFIG_FILE):
        assert (again / name).read_bytes() == trained.with_name(name).read_bytes()
    tok = tokenizers.load(str(trained))
    assert tok.vocab_size == 400 and (tok.pad, tok.bos, tok.eos) == (0, 1, 2)  # MiniMind's special tokens first
    assert tok.decode(tok.encode("The model saves a checkpoint.")) == "The model saves a checkpoint."
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": 1}\n')
    proc = train_cli("--vocab-size", "400", "--out", str(tmp_path / "c"), str(bad))
    assert proc.returncode == 2 and f"{bad}:2: expected an object" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.unit
def test_a_tokenizer_file_without_its_special_tokens_or_a_vocab_size_that_disagrees_is_a_config_error(tmp_path, trained, tiny):
    lone = tmp_path / "lone" / tokenizers.TOKENIZER_FILE
    lone.parent.mkdir()
    shutil.copy(trained, lone)  # without tokenizer_config.json
    code, err = launch.in_process(*tiny, f"data.tokenizer={lone}", f"out_dir={tmp_path / 'r1'}")
    assert code == 2 and "tokenizer_config.json: missing" in err and "bos_token" in err
    code, err = launch.in_process(*tiny, f"data.tokenizer={trained}", "model.vocab_size=259", f"out_dir={tmp_path / 'r2'}")
    assert code == 2 and f"model.vocab_size=259, but data.tokenizer={trained} has 400 ids" in err
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


@pytest.mark.unit
def test_a_packed_file_needing_uint32_ids_round_trips(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "big"
    folder.mkdir()
    tok.save(str(folder / tokenizers.TOKENIZER_FILE))
    (folder / tokenizers.CONFIG_FILE).write_text(json.dumps({"bos_token": "w1", "eos_token": "w69999", "pad_token": "w0"}))
    big = tokenizers.load(str(folder))
    docs = [" ".join(f"w{i}" for i in range(start, start + 9)) for start in (65_530, 3, 69_990)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    bin_path, meta = pack(src, 4, tmp_path / "cache", big)
    stream = [i for d in docs for i in big.encode(d, bos=True, eos=True)]
    assert meta["dtype"] == "uint32" and max(stream) > 65_535 and meta["vocab_size"] == 70_000
    assert bin_path.stat().st_size == meta["num_samples"] * 5 * 4
    ds = PackedDataset(bin_path, 4, dtype=meta["dtype"])
    got = [i for k in range(len(ds)) for i in ds[k][0].tolist() + [ds[k][1][-1].item()]]
    assert got == stream[: len(got)] and len(got) == 5 * (len(stream) // 5)
    again, meta2 = pack(src, 4, tmp_path / "cache", big)  # reused: the fingerprint holds the dtype
    assert again == bin_path and {**meta2, "sources": None} == {**meta, "sources": None}


@needs_minimind
@pytest.mark.e2e
def test_a_killed_preparation_leaves_nothing_that_is_used_and_two_packers_at_once_end_with_one_complete_file(tmp_path):
    """SIGKILL a real packing process midway (its temp file exists), then pack again; and two packers
    on the same cache at once (as two nodes do) both finish with the same complete file."""
    src = tmp_path / "big.jsonl"
    line = json.dumps({"text": "检查点保存在磁盘上，恢复后继续训练。The run resumes bit for bit. " * 40}, ensure_ascii=False)
    src.write_text((line + "\n") * 4000)  # ~11 MB: a few seconds of packing
    cache = tmp_path / "cache"
    child = ("import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; from data import pack, tokenizer as t; "
             "pack(Path(sys.argv[2]), 64, Path(sys.argv[3]), t.load(sys.argv[4]), batch_bytes=1 << 18)")
    cmd = [sys.executable, "-c", child, str(ROOT), str(src), str(cache), str(MINIMIND)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    launch.wait_for(lambda: any(p.stat().st_size > 0 for p in cache.glob(".*.tmp-*")) if cache.exists() else False, timeout=60, proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not list(cache.glob("*.bin")) and not list(cache.glob("*.json"))  # the temp file is never a cache
    both = [subprocess.Popen(cmd, cwd=ROOT) for _ in range(2)]
    assert [p.wait(timeout=120) for p in both] == [0, 0]
    bins, metas = list(cache.glob("*.bin")), list(cache.glob("*.json"))
    assert len(bins) == 1 and len(metas) == 1 and not list(cache.glob(".*tmp*"))  # the killed one's temp removed too
    meta = json.loads(metas[0].read_text())
    assert bins[0].stat().st_size == meta["num_samples"] * 65 * 2
    fresh, fresh_meta = pack(src, 64, tmp_path / "fresh", tokenizers.load(str(MINIMIND)))
    assert fresh.read_bytes() == bins[0].read_bytes() and fresh_meta["num_tokens"] == meta["num_tokens"]


@needs_minimind
@pytest.mark.e2e
def test_a_run_with_minimind_tokenizer_halted_and_resumed_ends_bit_identical(tmp_path, epochs):
    """In this process (the resume across processes and world sizes is proved with the byte tokenizer;
    what is particular here is the tokenizer: its ids, its files in the checkpoint, its fingerprint)."""
    tok = f"data.tokenizer={MINIMIND}"
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert launch.in_process(*epochs, tok, f"out_dir={ref}")[0] == 0
    assert launch.in_process(*epochs, tok, "checkpoint.interval=5", "train.halt_at=7", f"out_dir={out}")[0] == 0
    assert launch.in_process(*epochs, tok, "checkpoint.interval=5", f"out_dir={out}")[0] == 0
    launch.assert_identical(out, ref)
    assert launch.inspect(out)["data_fingerprint"]["vocab_size"] == 6400
    manifest = launch.storage_manifest(out, 20)
    assert set(manifest["files"]) == {storage.WEIGHTS_FILE, *storage.TOKENIZER_FILES, "state/.metadata", "state/__0_0.distcp", "state/__0_1.distcp"}  # the tokenizer files travel in every checkpoint
    ckpt = out / runfolder.CHECKPOINTS / storage.step_dir_name(20)
    assert (ckpt / tokenizers.TOKENIZER_FILE).read_bytes() == MINIMIND.read_bytes()


@pytest.mark.e2e
def test_a_resume_with_another_tokenizer_fails_naming_both_and_generate_uses_the_checkpoints_own(tmp_path, tiny, trained):
    own = tmp_path / "own"
    shutil.copytree(trained.parent, own)
    run = tmp_path / "run"
    assert launch.in_process(*tiny, f"data.tokenizer={own / tokenizers.TOKENIZER_FILE}", "train.halt_at=3", f"out_dir={run}")[0] == 0
    before = {p: p.read_bytes() for p in (run / runfolder.CHECKPOINTS).rglob("*") if p.is_file()}
    code, err = launch.in_process(*tiny, "train.halt_at=4", f"out_dir={run}")  # the byte tokenizer now
    assert code == 2
    assert "data tokenizer is sha256:" in err and f"({own / tokenizers.TOKENIZER_FILE})" in err and "bytes-v1 in this run" in err
    assert {p: p.read_bytes() for p in before} == before  # nothing lost
    shutil.rmtree(own)  # from here on only the checkpoint has the tokenizer
    proc = subprocess.run([sys.executable, "-m", "checkpoint", "generate", str(run), "--prompt", "The model", "--tokens", "12",
                           "--temperature", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from cli.generate import generate_text as generate
    from weights import load_model, load_tokenizer

    tok = load_tokenizer(run)
    assert tok.vocab_size == 400 and tok.sha256 == tokenizers.load(str(trained)).sha256
    assert proc.stdout.rstrip("\n") == generate(load_model(run), "The model", 12, 0.0, 0, tok)
    assert proc.stdout.startswith("The model")  # decoded by the BPE: the prompt comes back as text, not bytes
    ckpt = storage.find_checkpoint(run)[0]
    data = (ckpt / tokenizers.TOKENIZER_FILE).read_bytes()
    (ckpt / tokenizers.TOKENIZER_FILE).write_bytes(data[:-1] + (b" " if data[-1:] != b" " else b"\n"))  # same size, changed
    proc = subprocess.run([sys.executable, "-m", "checkpoint", "generate", str(ckpt)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "tokenizer.json" in proc.stderr and "does not match the manifest" in proc.stderr  # damaged: exit 1 in a tool
