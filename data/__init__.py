"""Tokenizer, corpus preparation, the packed dataset and the samplers."""
from .dataset import PackedDataset
from .prepare import BUILTIN, pack, resolve_source, unigram_entropy
from .sources import Corpus, DataError
from .sampler import BatchPlan, BatchPlanError, BlockDistributedSampler, SkipBatchSampler, epoch_order

__all__ = [
    "BUILTIN", "BatchPlan", "Corpus", "BatchPlanError", "BlockDistributedSampler", "DataError", "PackedDataset",
    "SkipBatchSampler", "epoch_order", "pack", "resolve_source", "unigram_entropy",
]
