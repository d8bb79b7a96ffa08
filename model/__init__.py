"""The MiniMind-style language model and its configuration."""
from .config import ModelConfig
from .model import KVCache, MiniMindLM

__all__ = ["KVCache", "ModelConfig", "MiniMindLM"]
