"""The MiniMind-style language model and its configuration."""
from .config import ModelConfig
from .model import MiniMindLM

__all__ = ["ModelConfig", "MiniMindLM"]
