"""For people who only want the model: the fp16 weights file of a checkpoint, verified and loaded
safely, and a sampler over it (`python -m checkpoint generate` uses both)."""
from __future__ import annotations

from pathlib import Path

import torch

from checkpoint import storage as io
from data import tokenizer
from model import MiniMindLM, ModelConfig


def load_model(path: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> MiniMindLM:
    """The model of a checkpoint (or a run folder's newest), from its fp16 weights file.

    The folder is verified against its manifest first, the model's shape comes from the manifest's
    config, and the weights are read with `weights_only=True`: nothing in the files can run.
    """
    folder, manifest, _ = io.find_checkpoint(path)
    try:
        cfg = ModelConfig(**manifest["config"]["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise io.CheckpointError(f"{folder / io.MANIFEST}: no usable model config ({type(e).__name__}: {e})") from None
    weights = io.safe_load(folder / io.WEIGHTS_FILE, map_location="cpu")
    model = MiniMindLM(cfg)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    if missing or unexpected:
        raise io.CheckpointError(f"{folder / io.WEIGHTS_FILE}: does not fit model {cfg} (missing {missing}, unexpected {unexpected})")
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def generate(model: MiniMindLM, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, seed: int = 0) -> str:
    """Sample a continuation of `prompt` with the byte tokenizer (temperature 0: greedy)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([tokenizer.encode(prompt, bos=True)], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits, _ = model(ids[:, -model.cfg.seq_len:])
        logits = logits[0, -1, : tokenizer.VOCAB_SIZE].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))
        if nxt == tokenizer.EOS:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tokenizer.decode(ids[0].tolist()[1:])
