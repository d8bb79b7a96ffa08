"""Tokenizer, corpus preparation, the packed dataset and the samplers."""
from .dataset import PackedDataset
from .prepare import BUILTIN, DataError, pack, resolve_source, unigram_entropy
from .sampler import BatchPlan, BatchPlanError, BlockDistributedSampler, SkipBatchSampler, epoch_order

__all__ = [
    "BUILTIN", "BatchPlan", "BatchPlanError", "BlockDistributedSampler", "DataError", "PackedDataset",
    "SkipBatchSampler", "epoch_order", "pack", "resolve_source", "unigram_entropy",
]
