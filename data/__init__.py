"""Tokenizer, corpus preparation, the packed dataset and the samplers."""
from .dataset import PackedDataset
from .sampler import BatchPlan, BatchPlanError, BlockDistributedSampler, SkipBatchSampler, epoch_order
from .sources import Corpus, DataError

__all__ = [
    "BUILTIN", "BatchPlan", "Corpus", "BatchPlanError", "BlockDistributedSampler", "DataError", "PackedDataset",
    "SkipBatchSampler", "epoch_order", "pack", "resolve_source", "unigram_entropy",
]
_FROM_PREPARE = ("BUILTIN", "pack", "resolve_source", "unigram_entropy")


def __getattr__(name: str):
    # data.prepare is imported on first use, so that `python -m data.prepare` runs it as __main__
    # without the package having imported it first (runpy warns about that).
    if name in _FROM_PREPARE:
        from . import prepare

        return getattr(prepare, name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")
