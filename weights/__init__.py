"""Weights in and out of a run: where a run's first weights come from (`model.init_from`: our
checkpoints, MiniMind's .pth, Hugging Face folders; sources.py), the model and tokenizer a
checkpoint holds, for generation and chat (ours.py), and the exports for MiniMind and Hugging Face
(exports.py). Every source is read once and hashed from the same bytes; nothing pickled runs."""
from .exports import FORMATS, export
from .ours import checkpoint_weights, load_model, load_tokenizer, tokenizer_files
from .sources import init_from, read_source

__all__ = ["FORMATS", "checkpoint_weights", "export", "init_from", "load_model", "load_tokenizer", "read_source", "tokenizer_files"]
