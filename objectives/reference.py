"""The frozen models an objective reads beside the one it trains: DPO's and GRPO's reference
(docs/dpo.md, docs/rl.md) and distillation's teacher (docs/distill.md). Each is read on every rank
from a weights source, pinned by its identity (weights and architecture) in every checkpoint, and on
a resume refused unless it is the pinned one."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from checkpoint import storage
from common.outcome import BadInput, attempt
from data import tokenizer as tokenizers
from model import MiniMindLM
from model.formats import WeightsError
from weights import base_weights, pin, verified_base


def pinned_reference(cfg, rt, meta, resumed, agree, tok_files: dict[str, bytes], source: str, key: str, model_cfg=None,
                     slot: str = "reference", what: str = "reference", check=None, hint: str = "") -> tuple[MiniMindLM, str, str]:
    """The frozen model, in eval mode, on this rank's device: `source` (the key's value), else
    model.init_from (the policy's start), else on a resume the pinned source, else the seeded init;
    every rank reads it and they agree; on a resume its identity must be the one `meta` (the
    checkpoint's RunMeta) pinned in `slot` ("reference", or "teacher"). `model_cfg`: its
    architecture (default: the run's model.*); `check(record, tok_files, path, key)`: its tokenizer
    against the run's (default: the same tokenizer, `check_tokenizer`). Weights that cannot be read
    or do not fit are bad input naming `key` (and `hint`: where the architecture came from). Records
    the pin in `meta.<slot>`. Returns (model, identity, path)."""
    model_cfg = model_cfg or cfg.model
    pinned = getattr(meta, slot) if resumed else None
    path = source or cfg.model.init_from or (((pinned or {}).get("source") or {}).get("path", "") if pinned else "")
    got = []

    def read() -> None:
        try:
            if pinned:
                state, record = verified_base(model_cfg, cfg.seed, path, pinned, f"the steps of {resumed.path}",
                                              key=key, what=what, names=key)
            else:
                state, record = base_weights(model_cfg, cfg.seed, path, key)
        except WeightsError as e:
            said = str(e) if str(e).startswith(key) else f"{key}: {e}"
            raise WeightsError(said + (f" ({hint})" if hint else "")) from None
        (check or check_tokenizer)(record, tok_files, path, key)
        got.append((state, record))

    agree(key, attempt(read))
    state, record = got[0]
    pinned_now = pin(state, model_cfg)
    sha = pinned_now["sha256"]
    setattr(meta, slot, {**pinned_now, "source": record})
    reference = MiniMindLM(model_cfg).to(rt.device)
    reference.load_state_dict(state)
    return reference.eval().requires_grad_(False), sha, path


def source_tokenizer(record: dict | None) -> tuple[str, bytes] | None:
    """The tokenizer a weights source was trained with, as (a name for messages, its tokenizer.json
    bytes; b"" for the byte tokenizer), when the source says: one of our checkpoints (its own
    tokenizer files, verified) or a Hugging Face folder with a tokenizer.json; None when it does
    not (a weights file, a folder without one)."""
    if record is None:
        return None
    if record["format"] == "checkpoint":
        folder, manifest, _ = storage.find_checkpoint(Path(record["path"]))
        if "tokenizer.json" not in manifest["files"]:
            return "the byte tokenizer", b""
        data = storage.read_verified(folder, "tokenizer.json", manifest)
    elif record["format"] == "hf" and (Path(record["path"]) / "tokenizer.json").is_file():
        data = (Path(record["path"]) / "tokenizer.json").read_bytes()
        # An export of a byte-tokenizer run carries the byte tokenizer as a tokenizers file: it is that tokenizer.
        if data == tokenizers.byte_tokenizer_files(0)[tokenizers.TOKENIZER_FILE]:
            return "the byte tokenizer", b""
    else:
        return None
    return f"tokenizer.json {hashlib.sha256(data).hexdigest()[:12]}", data


def run_tokenizer(tok_files: dict[str, bytes]) -> tuple[str, bytes]:
    """The run's own tokenizer, as `source_tokenizer` names it."""
    data = tok_files.get("tokenizer.json")
    return (f"tokenizer.json {hashlib.sha256(data).hexdigest()[:12]}", data) if data else ("the byte tokenizer", b"")


def check_tokenizer(record: dict | None, tok_files: dict[str, bytes], path: str, key: str) -> None:
    """A reference of one of our runs, or a Hugging Face folder with a tokenizer.json, must have the run's tokenizer."""
    theirs = source_tokenizer(record)
    if theirs is None:
        return
    ours = run_tokenizer(tok_files)
    if theirs[1] != ours[1]:
        raise BadInput(f"{key}: {path} was trained with another tokenizer ({theirs[0]}) than this run's ({ours[0]})")


def vocabulary(data: bytes) -> dict[int, str]:
    """id -> token of a tokenizer.json (its model's vocabulary and its added tokens; b"": the byte
    tokenizer's, as its Hugging Face file writes it)."""
    if not data:
        data = tokenizers.byte_tokenizer_files(0)[tokenizers.TOKENIZER_FILE]
    spec = json.loads(data)
    out = {int(i): t for t, i in ((spec.get("model") or {}).get("vocab") or {}).items()}
    out.update({int(t["id"]): t["content"] for t in spec.get("added_tokens") or []})
    return out
