"""`python -m checkpoint inspect PATH`: what a checkpoint holds, as JSON (model_sha256: the model's identity),
and for a run folder every checkpoint with its validity."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from checkpoint import format, storage

from .arguments import place

HELP = "print a checkpoint's step, geometry, model_sha256 and files as JSON"


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=place)


def inspect_checkpoint(path: Path, manifest: dict) -> dict:
    """Describe a checkpoint folder whose manifest is `manifest` (its files present; each read is verified)."""
    from model import MiniMindLM

    from weights import model_config

    metadata = storage.read_metadata(path, manifest)
    model, cfg = storage.read_tensors(path, manifest, "model."), model_config(path, manifest)
    same, sha = storage.identity_matches(manifest, "model_sha256", model, cfg.architecture())
    keys = format.keys(metadata)
    return {
        "path": str(path),
        "step": manifest["step"],
        "epoch": manifest.get("epoch"),
        "samples_seen": manifest.get("samples_seen"),
        "world_size": manifest.get("world_size"),
        "global_batch": manifest.get("global_batch"),
        "micro_batch": manifest.get("micro_batch"),
        "accum": manifest.get("accum"),
        "threads": manifest.get("threads"),
        "reduce": manifest.get("reduce"),
        "strategy": manifest.get("strategy"),
        "run_id": manifest.get("run_id"),
        "model_sha256": sha,
        "identity": manifest.get("identity", 1),
        "signed": storage.MAC in manifest,
        "manifest_model_sha256_matches": same,
        "parameters": MiniMindLM(cfg).num_parameters(),
        "optimizer_state_bytes": format.tensor_bytes(metadata, "optimizer.state."),
        "ranks_with_rng_state": len({k.split(".")[1] for k in keys if k.startswith("rng.")}),
        "data_fingerprint": {k: (manifest.get("data_fingerprint") or {}).get(k) for k in (
            "source", "source_sha256", "tokenizer", "tokenizer_source", "vocab_size", "dtype", "seq_len", "num_samples", "mix")},
        "files": {name: entry["bytes"] for name, entry in manifest["files"].items()},
    }


def inspect_path(path: Path) -> dict:
    """A checkpoint folder, or a run folder: its newest valid checkpoint, with every checkpoint listed."""
    found, manifest, listing = storage.find_checkpoint(path, verify_all=True)
    if not listing:  # a checkpoint folder
        return inspect_checkpoint(found, manifest)
    return {**inspect_checkpoint(found, manifest), "checkpoints": [
        {"step": step, "path": str(f), "valid": error is None, **({"error": error} if error else {})} for step, f, error in listing]}


def run(args: argparse.Namespace) -> int:
    print(json.dumps(inspect_path(args.path), indent=1))
    return 0
