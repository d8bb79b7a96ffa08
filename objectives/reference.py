"""The frozen reference model of DPO and GRPO (docs/dpo.md, docs/rl.md): read on every rank from a
weights source, pinned by its identity (weights and architecture) in every checkpoint, and on a resume refused
unless it is the pinned one."""
from __future__ import annotations

import hashlib
from pathlib import Path

from checkpoint import storage
from common.outcome import BadInput, attempt
from data import tokenizer as tokenizers
from model import MiniMindLM
from weights import base_weights, pin, verified_base


def pinned_reference(cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes], source: str, key: str) -> tuple[MiniMindLM, str, str]:
    """The reference, frozen, in eval mode, on this rank's device: `source` (the key's value), else
    model.init_from (the policy's start), else on a resume the pinned source, else the seeded init;
    every rank reads it and they agree; on a resume its weights' sha256 must be the one `meta`
    (the checkpoint's RunMeta) pinned. Records it in `meta.reference`. Returns (model, sha256, path)."""
    pinned = meta.reference if resumed else None
    path = source or cfg.model.init_from or (((pinned or {}).get("source") or {}).get("path", "") if pinned else "")
    got = []

    def read() -> None:
        if pinned:
            state, record = verified_base(cfg.model, cfg.seed, path, pinned, f"the steps of {resumed.path}",
                                          key=key, what="reference", names=key)
        else:
            state, record = base_weights(cfg.model, cfg.seed, path)
        check_tokenizer(record, tok_files, path, key)
        got.append((state, record))

    agree(key, attempt(read))
    state, record = got[0]
    pinned_now = pin(state, cfg.model)
    sha = pinned_now["sha256"]
    meta.reference = {**pinned_now, "source": record}
    reference = MiniMindLM(cfg.model).to(rt.device)
    reference.load_state_dict(state)
    return reference.eval().requires_grad_(False), sha, path


def check_tokenizer(record: dict | None, tok_files: dict[str, bytes], path: str, key: str) -> None:
    """A reference of one of our runs, or a Hugging Face folder with a tokenizer.json, must have the run's tokenizer."""
    if record is None:
        return
    ours = hashlib.sha256(tok_files["tokenizer.json"]).hexdigest() if "tokenizer.json" in tok_files else None
    theirs = None
    if record["format"] == "checkpoint":
        _, manifest, _ = storage.find_checkpoint(Path(record["path"]))
        theirs = (manifest["files"].get("tokenizer.json") or {}).get("sha256")
    elif record["format"] == "hf" and (Path(record["path"]) / "tokenizer.json").is_file():
        data = (Path(record["path"]) / "tokenizer.json").read_bytes()
        # An export of a byte-tokenizer run carries the byte tokenizer as a tokenizers file: it is that tokenizer.
        byte = tokenizers.byte_tokenizer_files(0)[tokenizers.TOKENIZER_FILE]
        theirs = None if data == byte else hashlib.sha256(data).hexdigest()
    else:
        return
    if theirs != ours:
        raise BadInput(f"{key}: {path} was trained with another tokenizer ({'tokenizer.json ' + theirs[:12] if theirs else 'the byte tokenizer'}) "
                       f"than this run's ({'tokenizer.json ' + ours[:12] if ours else 'the byte tokenizer'})")


