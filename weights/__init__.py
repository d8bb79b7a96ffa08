"""Weights in and out of a run: where a run's first weights come from (`model.init_from`: our
checkpoints, MiniMind's .pth, Hugging Face folders; sources.py), the model and tokenizer a
checkpoint holds, for generation and chat (ours.py), and the exports for MiniMind and Hugging Face
(exports.py). Every source is read once and hashed from the same bytes; nothing pickled runs."""
from .exports import FORMATS, export
from .adapters import lora_start, read_adapters
from .ours import load_model, load_model_and_tokenizer, load_tokenizer, tokenizer_files
from .sources import architecture_of, base_weights, checkpoint_weights, identity, init_from, model_config, pin, read_source, verified_base

__all__ = ["FORMATS", "architecture_of", "base_weights", "checkpoint_weights", "export", "identity", "init_from", "load_model", "load_model_and_tokenizer", "load_tokenizer", "lora_start", "model_config",
           "pin", "read_adapters", "read_source", "tokenizer_files", "verified_base"]
