"""The data of a run: its corpus packed once per node, handed to the other ranks, mapped as the
training and validation sets, and its fingerprint (docs/data.md; docs/design.md I20, I22). Called by
train.py with the run's data config and runtime; nothing here imports either."""
from __future__ import annotations

import logging
from pathlib import Path

from common.outcome import RankFailed
from runtime.board import hand_off

from .chat import ChatOptions
from .dataset import ChatDataset, PackedDataset, PreferenceDataset, PromptDataset
from .prepare import pack, resolve_source
from .sources import DataError

log = logging.getLogger("minimind")


def _pack(cfg, seq_len: int, tok, chat, watch) -> dict:
    """The packer's work: the corpus (and the validation file) packed, as an outcome every rank can
    read: {"bin", "meta", ...}, or {"error", "outcome"} whatever went wrong (bad data: bad_input; an
    I/O error, a tokenizer's own exception, a bug: failed)."""
    cache = Path(cfg.cache_dir)
    try:
        bin_path, meta = pack(resolve_source(cfg.path, cache), seq_len, cache, tok, verify=cfg.verify_source, watch=watch, chat=chat)
        outcome = {"bin": str(bin_path), "meta": meta}
        if cfg.val_path:
            val_bin, val_meta = pack(resolve_source(cfg.val_path, cache, "data.val_path"), seq_len, cache, tok,
                                     verify=cfg.verify_source, watch=watch, chat=chat)
            outcome.update(val_bin=str(val_bin), val_meta=val_meta)
        return outcome
    except DataError as e:
        return {"error": str(e), "outcome": "bad_input"}
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
    chat = ChatOptions(cfg.loss_on, cfg.pack, cfg.drop_long, cfg.system_prompt_ratio, seed, cfg.format) if cfg.format != "text" else None
    packer = 0 if cfg.shared_cache else rt.rank - rt.local_rank
    outcomes = hand_off(rt, "pack", packer, lambda progress: _pack(cfg, seq_len, tok, chat, progress), timeout_s, "the packer")
    for r, outcome in outcomes.items():
        if "error" in outcome:
            raise RankFailed(r, outcome["outcome"], outcome["error"], "packing")
    mine = outcomes[packer]
    held_out, dtype = cfg.val_samples, mine["meta"]["dtype"]
    kind = PackedDataset if chat is None else {"preference": PreferenceDataset, "prompts": PromptDataset, "agent": PromptDataset}.get(chat.kind, ChatDataset)
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


def summary(fingerprint: dict, loss_on: str, entropy: float) -> str:
    """What the run's data is, in one line of the log."""
    m = fingerprint
    if "prompts" in m:
        return f"{m['prompts']} prompts, {m['tokens']} tokens, the longest {m['max_prompt']}"
    if "taught" not in m:
        return f"unigram entropy of the corpus {entropy:.4f} nats/token (a model that beats it has learnt context)"
    what = f"{m['pairs']} pairs" if "pairs" in m else f"{m['conversations']} conversations"
    return (f"{what}, {m['taught']} of {m['tokens']} tokens taught (data.loss_on={loss_on}), "
            f"{100 * m['padding'] / max(1, m['tokens'] + m['padding']):.1f}% of the rows' positions padding")
