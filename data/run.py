"""The data of a run: its corpus packed once per node, handed to the other ranks, mapped as the
training and validation sets, and its fingerprint (docs/data.md; docs/design.md I20, I22). Called by
train.py with the run's data config and runtime; nothing here imports either."""
from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

from . import handoff
from .chat import ChatOptions
from .dataset import ChatDataset, PackedDataset
from .prepare import pack, resolve_source
from .sources import DataError


def data_of_run(cfg, seq_len: int, seed: int, timeout_s: float, rt, tok) -> tuple[PackedDataset, PackedDataset | None, dict]:
    """Pack the corpus (and a validation file) that `cfg` (the run's data config) names with tokenizer
    `tok` once per node (its first rank; rank 0 alone with data.shared_cache), then every rank maps the
    same files. The others wait on the packer's hand-off file, not in a collective: packing may take
    longer than `timeout_s` (dist.timeout_s; docs/data.md). `rt` is the run's runtime (rank,
    local_rank, world_size, broadcast, all_gather). Returns the training set, the validation set (or
    None) and the fingerprint."""
    cache = Path(cfg.cache_dir)
    chat = None
    if cfg.format == "chat":
        chat = ChatOptions(cfg.loss_on, cfg.pack, cfg.drop_long, cfg.system_prompt_ratio, seed)
    token = rt.broadcast(uuid.uuid4().hex[:12]) if rt.world_size > 1 else "solo"
    packer = 0 if cfg.shared_cache else rt.rank - rt.local_rank
    path = handoff.handoff_path(cache, token, packer)
    if rt.rank == packer:
        result = {}
        try:
            with handoff.Heartbeat(path) if rt.world_size > 1 else contextlib.nullcontext() as beat:
                handoff.clear_stale(cache, path)
                watch = beat.watch if beat else None
                try:
                    bin_path, meta = pack(resolve_source(cfg.path, cache), seq_len, cache, tok,
                                          verify=cfg.verify_source, watch=watch, chat=chat)
                    result = {"bin": str(bin_path), "meta": meta}
                    if cfg.val_path:
                        val_bin, val_meta = pack(resolve_source(cfg.val_path, cache, "data.val_path"), seq_len,
                                                 cache, tok, verify=cfg.verify_source, watch=watch, chat=chat)
                        result.update(val_bin=str(val_bin), val_meta=val_meta)
                except DataError as e:
                    result = {"error": str(e)}
                except OSError as e:  # a full disk, a folder that cannot be written: an I/O failure, not bad input
                    result = {"error": f"{e.filename or cfg.cache_dir}: {e.strerror or e}", "io": True}
                if beat:
                    beat.finish(result)
        except OSError as e:  # the hand-off file itself
            result = {"error": f"{e.filename or cfg.cache_dir}: {e.strerror or e}", "io": True}
    else:
        result = handoff.wait(path, timeout_s, talk=rt.rank == packer + 1)
    # Everyone has the outcome by now: this collective does not wait for packing. It fails every rank together.
    results = rt.all_gather(result)
    if rt.rank == packer:
        path.unlink(missing_ok=True)
    failed = [r for r in results if "error" in r]
    if failed:
        raise (OSError if failed[0].get("io") else DataError)(failed[0]["error"])
    mine = result
    held_out, dtype = cfg.val_samples, mine["meta"]["dtype"]
    kind = ChatDataset if chat else PackedDataset
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
