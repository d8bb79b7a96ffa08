"""MiniMind's language models: the model and its configuration (model.*), its weights under other
projects' names (formats.py), and generation with a KV cache (generate.py)."""
from .config import ModelConfig
from .model import KVCache, MiniMindLM

__all__ = ["KVCache", "ModelConfig", "MiniMindLM"]
