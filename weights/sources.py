"""Where a run's first weights come from (`model.init_from`), each source read once and hashed from
the same bytes (nothing pickled runs: `weights_only=True` or safetensors):
  - one of our checkpoint folders, or a run folder (its newest valid checkpoint): the fp32 weights
    of the resume file, verified against the manifest;
  - one of our fp16 weights files (`weights_fp16.safetensors`, or a format-2 checkpoint's `weights_fp16.pth`);
  - a MiniMind2 state dict (`.pth`, MiniMind2's key names: `model.embed_tokens`, ...);
  - a Hugging Face Llama folder (`config.json` + `model.safetensors`), as `export --format hf` writes;
  - a run folder or checkpoint in object storage (`s3://...`): a verified local copy of it, read as the
    folder it is (the record names the step's URL, so a fresh node reads it again from the store).
A LoRA run's checkpoint (train.lora) holds its adapters only: its weights are its base's (read from
where the run read it, checked against the hash the adapters were trained over) with the adapters
folded in (docs/lora.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch

from checkpoint import storage
from common.seeds import generators_apart, seed_all
from model import MiniMindLM, ModelConfig
from model.formats import WeightsError, check_fits, check_tensors, from_llama, hf_differences, hf_model_keys, is_llama, llama_name
from model.lora import LoRAConfig, is_adapter, merged

HF_WEIGHTS, HF_CONFIG, HF_GENERATION = "model.safetensors", "config.json", "generation_config.json"


def local(path: str | Path, key: str) -> tuple[Path, str | None]:
    """(a place to read the source at, the URL of the checkpoint it is when it lives in the store): a run
    folder or checkpoint in object storage comes down to a verified copy in the staging folder, one folder
    per step that nothing prunes or rewrites while a reader reads it (a published step never changes: a
    step asked for again is read from its copy; the ranks of a node take turns, the first fetches); a
    local path as it is."""
    from common.store import is_url, parse, staging_root

    if not is_url(path):
        return Path(path), None
    import fcntl
    import shutil

    from checkpoint import remote

    run, step = remote.split(str(path))
    try:
        bucket, prefix = parse(run, key)
        root = staging_root() / ".sources" / bucket / prefix
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".lock", "w") as lock:
            fcntl.lockf(lock, fcntl.LOCK_EX)
            if step and (root / step / storage.MANIFEST).is_file():
                return root / step, f"{run}/{storage.CHECKPOINTS}/{step}"
            copy = remote.fetch(run, root / ".fetch", step) / storage.CHECKPOINTS  # reused when the store's is the same
            fetched = sorted(f for f in copy.iterdir() if storage.NAME.match(f.name)) if copy.is_dir() else []
            if not fetched:
                raise storage.NoCheckpoint(f"{path}: holds no checkpoint of ours")
            final = root / fetched[-1].name
            if not (final / storage.MANIFEST).is_file():  # linked, not copied: the fetch's copy may be pruned later
                part = root / f".{final.name}.part"
                shutil.rmtree(part, ignore_errors=True)
                shutil.rmtree(final, ignore_errors=True)
                shutil.copytree(fetched[-1], part, copy_function=os.link)
                part.rename(final)
    except storage.NoCheckpoint as e:
        raise WeightsError(f"{key}: {e} (expected in the store a run folder or a checkpoint of ours; a Hugging Face folder "
                           f"or a weights file there is read after downloading it)") from None
    return final, f"{run}/{storage.CHECKPOINTS}/{final.name}"


def read_bytes_of(path: Path, key: str = "model.init_from") -> bytes:
    """The bytes of a weights file that the config key `key` names: a missing one is bad input naming
    the key, another I/O error a failure naming the path."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise WeightsError(f"{key}: {path} does not exist") from None
    except OSError as e:
        raise storage.CheckpointError(f"{path}: cannot be read ({e.strerror})") from None


def _safetensors(data: bytes, path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a name our fp16 weights file records as an alias (a tied tensor,
    written once: storage.ALIASES) given the tensor it names."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        state = load(data)
        meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
        aliases = json.loads(meta.get(storage.ALIASES, "{}"))
        if not isinstance(aliases, dict) or not all(isinstance(v, str) and v in state for v in aliases.values()):
            raise ValueError(f"its {storage.ALIASES} {aliases!r} name tensors it does not hold")
        state.update({name: state[target] for name, target in aliases.items()})
        return state
    except (SafetensorError, ValueError, UnicodeDecodeError, AttributeError) as e:
        raise WeightsError(f"{path}: not a safetensors file ({e})") from None


def model_config(folder: Path, manifest: dict) -> ModelConfig:
    """The model a checkpoint's manifest describes."""
    try:
        return ModelConfig.from_dict(manifest["config"]["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise storage.CheckpointError(f"{folder / storage.MANIFEST}: no usable model config ({type(e).__name__}: {e})") from None


def lora_of(manifest: dict) -> LoRAConfig:
    """The adapters a checkpoint's run trained (rank 0: none, the checkpoint holds the whole model)."""
    return LoRAConfig.of((manifest.get("config", {}).get("train") or {}).get("lora"))


def base_weights(cfg: ModelConfig, seed: int, path: str, key: str = "model.init_from") -> tuple[dict[str, torch.Tensor], dict | None]:
    """A LoRA run's base, fp32, under our keys: the weights at `path` (any model.init_from source; `key`
    the config key that names it), or with no path the seeded init of `seed` (drawn apart: the caller's
    generators are left as they were). Returns (weights, the source's record or None)."""
    if not path:
        with generators_apart():  # python's, numpy's and torch's generators as the run left them (docs/design.md I6)
            seed_all(seed)
            return MiniMindLM(cfg).state_dict(), None
    state, record = read_source(path, cfg, key)
    names = llama_name if record["keys"] == "llama" else (lambda k: k)
    check_fits(state, _base_shapes(cfg), str(path), names)
    check_tensors(state, str(path), names)
    return {k: v.to(torch.float32) for k, v in state.items()}, record


def _base_shapes(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return MiniMindLM(cfg).state_dict()


def identity(state: dict[str, torch.Tensor], cfg: ModelConfig) -> str:
    """The model's identity (docs/design.md "One model identity"): its weights and `cfg`'s architecture."""
    return storage.model_sha256(state, cfg.architecture())


def pin(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """The record that pins a model (a LoRA base, a DPO or GRPO reference): its identity and the identity's version."""
    return {"sha256": identity(state, cfg), "identity": storage.IDENTITY}


def verified_base(cfg: ModelConfig, seed: int, path: str, pinned: dict, whose: str, key: str = "train.lora",
                  what: str = "base", names: str = "model.init_from") -> tuple[dict[str, torch.Tensor], dict | None]:
    """`base_weights`, refused unless they are the model `pinned` (a `pin` record, or an earlier
    release's {sha256}) names: a LoRA run's base, which `whose` adapters were trained over, or (key,
    what, names) another pinned model's, e.g. DPO's reference."""
    state, record = base_weights(cfg, seed, path, names)
    same, got = storage.identity_matches(pinned, "sha256", state, cfg.architecture())
    if not same:
        where = path or f"the seeded init of seed {seed}"
        raise WeightsError(f"{key}: the {what} at {where} has identity {got}, but {whose} were trained over "
                           f"identity {pinned.get('sha256')} ({names} names the {what}: give the one they were trained over)")
    return state, record


def checkpoint_weights(path: Path) -> tuple[Path, dict, ModelConfig, dict[str, torch.Tensor]]:
    """(folder, manifest, model config, fp32 weights) of a checkpoint folder (or a run folder's newest
    valid checkpoint); the weights assembled from every rank's state files, each verified, and their
    identity the manifest's. A LoRA
    run's: its base (verified) with the adapters folded in."""
    folder, manifest, _ = storage.find_checkpoint(path)
    cfg, state = model_config(folder, manifest), storage.read_tensors(folder, manifest, "model.")
    same, got = storage.identity_matches(manifest, "model_sha256", state, cfg.architecture())
    if not same:  # what was read is not what was saved (docs/design.md "One model identity")
        raise storage.CheckpointError(f"{folder}: the weights read have identity {got}, not the {manifest.get('model_sha256')} "
                                      f"its manifest recorded at the save: the checkpoint is damaged")
    lora = lora_of(manifest)
    if lora.rank:
        base, _ = checkpoint_base(folder, manifest, cfg)
        state = merged(base, state, lora.scale)
    return folder, manifest, cfg, state


def checkpoint_base(folder: Path, manifest: dict, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict | None]:
    """A LoRA checkpoint's base, read from where its run read it, verified against the manifest's hash."""
    base = manifest.get("base") or {}
    if "sha256" not in base:
        raise storage.CheckpointError(f"{folder / storage.MANIFEST}: a LoRA checkpoint without the hash of its base")
    source = (base.get("init_from") or {}).get("path", "")
    return verified_base(cfg, int(manifest["config"].get("seed", 0)), source, base, f"the adapters of {folder}")


def architecture_of(path: str | Path, given: ModelConfig | None, seq_len: int, key: str) -> tuple[ModelConfig, str]:
    """The architecture of the model at `path`, read from the source itself where it carries one: a
    run or checkpoint folder its manifest's model config, a Hugging Face folder its config.json; a
    weights file (a MiniMind .pth, safetensors, our fp16 file) carries none, and `given` (the keys
    that describe it) is used. `seq_len`: the positions it will read (rotary tables, not weights).
    Returns (the config, where it came from); a source that cannot be read is bad input naming `key`."""
    path, _ = local(path, key)
    if not path.exists():
        raise WeightsError(f"{key}: {path} does not exist")
    try:
        if path.is_dir() and (path / HF_CONFIG).is_file():
            hf = json.loads(read_bytes_of(path / HF_CONFIG, key))
            keys, where = hf_model_keys(hf if isinstance(hf, dict) else {}), f"{path / HF_CONFIG}"
        elif path.is_dir():
            try:
                folder, manifest, _ = storage.find_checkpoint(path)
            except storage.NoCheckpoint as e:
                raise WeightsError(f"{key}: {e}") from None
            keys, where = dict(manifest["config"]["model"]), f"{folder / storage.MANIFEST}'s model config"
        elif given is None:
            raise WeightsError(f"{key}: {path} is a weights file, which carries no architecture: describe it")
        else:
            keys, where = dataclasses.asdict(given), "given"
        keys.update(seq_len=seq_len, dropout=0.0, init_from="")
        return ModelConfig.from_dict(keys), where
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{key}: {path / HF_CONFIG} does not parse ({e})") from None
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, WeightsError):
            raise
        raise WeightsError(f"{key}: {path} describes no model we can build ({type(e).__name__}: {e})") from None


def read_source(path: str | Path, cfg: ModelConfig, key: str = "model.init_from") -> tuple[dict[str, torch.Tensor], dict]:
    """(the weights under our key names, the record of where they came from: path, sha256, format);
    `key`: the config key that names the source, in the errors."""
    path, url = local(path, key)
    if path.is_dir() and (path / HF_CONFIG).is_file():
        config_bytes, data = read_bytes_of(path / HF_CONFIG, key), read_bytes_of(path / HF_WEIGHTS, key)
        try:
            hf = json.loads(config_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path / HF_CONFIG}: does not parse ({e})") from None
        if not isinstance(hf, dict):
            raise WeightsError(f"{path / HF_CONFIG}: not a mapping of config fields")
        # Shapes alone do not tell 8 heads of 4 from 4 heads of 8: every architectural field is compared.
        diffs = hf_differences(hf, cfg)
        if diffs:
            raise WeightsError(f"{path / HF_CONFIG}: describes another model than model.* ({'; '.join(diffs)})")
        state = _safetensors(data, path / HF_WEIGHTS)
        # The source's identity is both files: another config.json over the same tensors is another model.
        files = {HF_CONFIG: hashlib.sha256(config_bytes).hexdigest(), HF_WEIGHTS: hashlib.sha256(data).hexdigest()}
        combined = hashlib.sha256("".join(f"{name}:{sha}\n" for name, sha in files.items()).encode()).hexdigest()
        record = {"path": str(path.resolve()), "sha256": combined, "format": "hf", "files": files}
    elif path.is_dir():  # one of our checkpoints, or a run folder
        folder, manifest, _, state = checkpoint_weights(path)
        # The source's identity: a hash of its state files' sha256s (as the manifest lists them: every
        # one was checked as it was read), and the weights' own sha256.
        listing = "".join(f"{k}:{e['sha256']}\n" for k, e in sorted(manifest["files"].items()) if k.startswith("state/"))
        record = {"path": url or str(folder.resolve()), "sha256": hashlib.sha256(listing.encode()).hexdigest(), "format": "checkpoint",
                  "model_sha256": identity(state, cfg)}
    else:
        data = read_bytes_of(path, key)
        if path.suffix == ".safetensors":
            state = _safetensors(data, path)
        else:
            try:
                state = storage.safe_load_bytes(data, path)
            except storage.CheckpointError as e:  # pickled code, or not a torch file: a source we refuse, bad input
                raise WeightsError(f"{key}: {e}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise WeightsError(f"{path}: not a state dict (a mapping of names to tensors)")
        record = {"path": str(path.resolve()), "sha256": hashlib.sha256(data).hexdigest(),
                  "format": "minimind" if is_llama(state) else "weights"}
    llama = is_llama(state)
    if llama:
        state = from_llama(state)
    record["keys"] = "llama" if llama else "ours"
    return state, record


def init_from(model: MiniMindLM, path: str | Path) -> dict:
    """Load the weights at `path` into `model` (fp32); keys and shapes must match exactly (a model with
    adapters takes them into its base and keeps its adapters). Returns the source's record."""
    state, record = read_source(path, model.cfg)
    names = llama_name if record["keys"] == "llama" else (lambda k: k)
    base = {k: v for k, v in model.state_dict().items() if not is_adapter(k)}
    check_fits(state, base, str(path), names)
    check_tensors(state, str(path), names)
    missing, _ = model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    assert all(is_adapter(k) for k in missing), missing
    return record
