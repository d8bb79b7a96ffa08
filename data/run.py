"""The data of a run: its corpus packed once per node, handed to the other ranks, mapped as the
training and validation sets, and its fingerprint (docs/data.md; docs/design.md I20, I22). Called by
train.py with the run's data config and runtime; nothing here imports either."""
from __future__ import annotations

import logging
from pathlib import Path

from common.outcome import BadInput, Failed, RankFailed
from runtime.board import hand_off

from .chat import ChatOptions
from .dataset import PackedDataset
from .formats import format_of
from .mix import MixDataset, MixValidation, dropped, parse_mix
from .prepare import pack, resolve_source
from .sources import DataError

log = logging.getLogger("minimind")


def _pack(cfg, seq_len: int, tok, chat, watch) -> dict:
    """The packer's work: the corpus (and the validation file) packed, as an outcome every rank can
    read: {"bin", "meta", ...}, or {"error", "outcome"} whatever went wrong (bad data: bad_input; an
    I/O error, a tokenizer's own exception, a bug: failed)."""
    cache = cfg.cache_dir  # a folder, or s3://BUCKET/PREFIX (data/remote.py)
    try:
        if cfg.mix:  # each source packed once, as a corpus of its own (data/mix.py)
            outcome = {"mix": {}}
            for source in parse_mix(cfg.mix, cfg.format):
                bin_path, meta = pack(resolve_source(source.path, cache, f"data.mix[{source.name}].path"), seq_len, cache, tok,
                                      verify=cfg.verify_source, watch=watch, chat=chat)
                outcome["mix"][source.name] = {"bin": str(bin_path), "meta": meta, "weight": source.weight}
        else:
            bin_path, meta = pack(resolve_source(cfg.path, cache), seq_len, cache, tok, verify=cfg.verify_source, watch=watch, chat=chat)
            outcome = {"bin": str(bin_path), "meta": meta}
        if cfg.val_path:
            val_bin, val_meta = pack(resolve_source(cfg.val_path, cache, "data.val_path"), seq_len, cache, tok,
                                     verify=cfg.verify_source, watch=watch, chat=chat)
            outcome.update(val_bin=str(val_bin), val_meta=val_meta)
        return outcome
    except (DataError, BadInput) as e:  # a corpus line; a store that refuses the credentials or lacks the bucket
        return {"error": str(e), "outcome": "bad_input"}
    except Failed as e:  # the store did not answer (after its retries): named endpoint and object
        return {"error": str(e), "outcome": "failed"}
    except OSError as e:  # a full disk, a folder that cannot be written: an I/O failure, not bad input
        return {"error": f"{e.filename or cfg.cache_dir}: {e.strerror or e}", "outcome": "failed"}
    except Exception as e:  # noqa: BLE001 - a tokenizer's own exception, a bug: every rank fails with it, named
        log.error("packing %s failed", cfg.path, exc_info=True)
        return {"error": f"packing {cfg.path}: {type(e).__name__}: {e}", "outcome": "failed"}


def data_of_run(cfg, seq_len: int, seed: int, timeout_s: float, rt, tok) -> tuple[PackedDataset, PackedDataset | None, dict]:
    """Pack the corpus (and a validation file) that `cfg` (the run's data config) names with tokenizer
    `tok` once per node (its first rank; rank 0 alone with data.shared_cache), then every rank maps the
    same files. Every rank waits for every packer's outcome on the launch's board, not in a collective:
    a pack may take longer than `timeout_s` (dist.timeout_s) as long as the packer's heartbeat moves,
    on a node whose cache is cold beside one whose cache is warm (docs/data.md). A packer's failure of
    any kind fails every rank with the same RankFailed, naming it. `rt` is the run's runtime (rank,
    local_rank, world_size, all_gather, board). Returns the training set, the validation set (or None)
    and the fingerprint."""
    fmt = format_of(cfg.format)
    chat = ChatOptions(cfg.loss_on, cfg.pack, cfg.drop_long, cfg.system_prompt_ratio, seed, cfg.format) if fmt.chat else None
    packer = 0 if cfg.shared_cache else rt.rank - rt.local_rank
    outcomes = hand_off(rt, "pack", packer, lambda progress: _pack(cfg, seq_len, tok, chat, progress), timeout_s, "the packer")
    for r, outcome in outcomes.items():
        if "error" in outcome:
            raise RankFailed(r, outcome["outcome"], outcome["error"], "packing")
    mine = outcomes[packer]
    if "mix" in mine:
        return _mix_of_run(cfg, seq_len, seed, mine)
    held_out, dtype = cfg.val_samples, mine["meta"]["dtype"]
    kind = fmt.dataset
    corpus = kind(Path(mine["bin"]), seq_len, cfg.num_samples, dtype=dtype)
    if held_out >= len(corpus):
        raise DataError(f"data.val_samples={held_out}: the corpus has only {len(corpus)} samples of {seq_len + 1} tokens")
    dataset = kind(Path(mine["bin"]), seq_len, len(corpus) - held_out, dtype=dtype)
    val = None
    if held_out:  # the tail: the same samples on every world size, never in a training batch
        val = kind(Path(mine["bin"]), seq_len, len(corpus), start=len(corpus) - held_out, dtype=dtype)
    elif cfg.val_path:
        val = kind(Path(mine["val_bin"]), seq_len, dtype=dtype)
    # What identifies the corpus, without when each file was last checked (data/prepare.py).
    fingerprint = {**{k: v for k, v in mine["meta"].items() if k != "sources"}, "num_samples": len(dataset),
                   "val_samples": len(val) if val else 0,
                   **({"val_source_sha256": mine["val_meta"]["source_sha256"]} if cfg.val_path else {}),
                   **({"order": cfg.order} if cfg.order != "randperm" else {})}  # absent: randperm, as before the option
    return dataset, val, fingerprint


# What names one source's corpus (the mix's fingerprint keeps them per source) or describes its packing alone.
_OWN = ("source", "source_sha256", "source_sha256_source", "files", "sources", "build_seconds")


def _mix_of_run(cfg, seq_len: int, seed: int, mine: dict) -> tuple[MixDataset, PackedDataset | None, dict]:
    """A mix's training set (its sources end to end, sorted by name), the validation set and the
    fingerprint: what the sources share, and each one's identity under its name. The weights are
    not in it: they may change on a resume (a new phase, data/mix.py)."""
    packed = mine["mix"]
    metas = [p["meta"] for p in packed.values()]
    dtype = metas[0]["dtype"]
    held, parts, tails = cfg.val_samples, [], []
    kind = format_of(cfg.format).dataset  # every source's rows: text or chat
    for name, p in sorted(packed.items()):  # data.val_samples: the last N samples of each source, never in a training batch
        n = len(kind(Path(p["bin"]), seq_len, dtype=dtype))
        if held >= n:
            raise DataError(f"data.val_samples={held}: data.mix's source {name!r} has only {n} samples of {seq_len + 1} tokens")
        parts.append((name, kind(Path(p["bin"]), seq_len, n - held, dtype=dtype)))
        if held:
            tails.append((name, kind(Path(p["bin"]), seq_len, n, start=n - held, dtype=dtype)))
    # What a resume keeps of each source: its corpus and its training samples (data.val_samples takes from them).
    identities = {name: f"sha256 {packed[name]['meta']['source_sha256'][:16]}, {len(d)} samples" for name, d in parts}
    mix = MixDataset(parts, [packed[n]["weight"] for n, _ in parts], identities, seed, cfg.order, dropped(cfg.mix_drop))
    val = kind(Path(mine["val_bin"]), seq_len, dtype=dtype) if cfg.val_path else MixValidation(tails) if tails else None
    shared = {k: v for k, v in metas[0].items() if k not in _OWN and all(m.get(k) == v for m in metas)}
    fingerprint = {**{k: v for k, v in shared.items() if k in ("format", "tokenizer", "tokenizer_source", "tokenizer_sha256",
                                                               "vocab_size", "dtype", "seq_len", "options")},
                   "mix": {name: {"source_sha256": p["meta"]["source_sha256"], "source": p["meta"]["source"],
                                  "samples": len(d)} for (name, d), p in zip(parts, [packed[n] for n, _ in parts])},
                   "val_samples": len(val) if val else 0,
                   **({"val_source_sha256": mine["val_meta"]["source_sha256"]} if cfg.val_path else {}),
                   **({"order": cfg.order} if cfg.order != "randperm" else {})}
    return mix, val, fingerprint


def summary(fingerprint: dict, loss_on: str, entropy: float) -> str:
    """What the run's data is, in one line of the log."""
    m = fingerprint
    if "mix" in m:
        return "a mix of " + ", ".join(f"{n} ({v['samples']} samples)" for n, v in m["mix"].items()) + (
            f"; unigram entropy of {next(iter(m['mix']))}, the first source, {entropy:.4f} nats/token")
    if "prompts" in m:
        return f"{m['prompts']} prompts, {m['tokens']} tokens, the longest {m['max_prompt']}"
    if "taught" not in m:
        return f"unigram entropy of the corpus {entropy:.4f} nats/token (a model that beats it has learnt context)"
    unit = format_of(m.get("options", {}).get("format", "chat")).unit
    what = f"{m[unit]} {unit}"
    return (f"{what}, {m['taught']} of {m['tokens']} tokens taught (data.loss_on={loss_on}), "
            f"{100 * m['padding'] / max(1, m['tokens'] + m['padding']):.1f}% of the rows' positions padding")
