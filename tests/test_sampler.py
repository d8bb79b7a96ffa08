import pytest
import torch
from torch.utils.data import DistributedSampler

from data import BatchPlan, BatchPlanError, BlockDistributedSampler, SkipBatchSampler, epoch_order

pytestmark = pytest.mark.unit

N, G, SEED = 1000, 24, 7


def rank_streams(plan, epoch=0, n=N):
    samplers = [BlockDistributedSampler(n, plan, r, SEED) for r in range(plan.world_size)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


def test_the_epoch_order_is_distributed_samplers_permutation():
    ds = list(range(N))
    ref = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    for epoch in (0, 3):
        ref.set_epoch(epoch)
        assert epoch_order(N, SEED, epoch).tolist() == list(ref)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_ranks_together_consume_the_epochs_planned_prefix_exactly_once(world):
    plan = BatchPlan(G, 2, world)
    samplers, streams = rank_streams(plan, epoch=1)
    seen = [i for stream in streams for batch in stream for i in batch]
    spe = N // G
    assert len(seen) == len(set(seen)) == spe * G
    assert sorted(seen) == sorted(epoch_order(N, SEED, 1)[: spe * G].tolist())
    # and step by step: step s consumes exactly positions [s*G, (s+1)*G) of the order
    order = epoch_order(N, SEED, 1)
    for s in range(spe):
        step = [i for stream in streams for batch in stream[s * plan.accum : (s + 1) * plan.accum] for i in batch]
        assert sorted(step) == sorted(order[s * G : (s + 1) * G].tolist()) == sorted(samplers[0].step_indices(s))


def test_micro_batch_i_of_a_step_is_the_same_block_whatever_the_world_size():
    blocks = {}
    for world in (1, 2, 3, 4):
        plan = BatchPlan(G, 2, world)
        _, streams = rank_streams(plan)
        for r, stream in enumerate(streams):
            for k, batch in enumerate(stream):
                s, j = divmod(k, plan.accum)
                blocks.setdefault((s, j * world + r), set()).add(tuple(batch))
    assert all(len(v) == 1 for v in blocks.values())


@pytest.mark.parametrize("skip", [0, 1, 7, 40])
def test_skipping_k_batches_yields_the_same_remainder_as_iterating_past_them(skip):
    sampler = BlockDistributedSampler(N, BatchPlan(G, 3, 2), 1, SEED)
    sampler.set_epoch(2)
    full = list(sampler)
    rest = list(SkipBatchSampler(sampler, skip))
    assert rest == full[skip:] and len(SkipBatchSampler(sampler, skip)) == len(full) - skip


def test_a_resume_on_another_world_size_continues_the_prefix_with_nothing_skipped_or_repeated():
    s_done = 5
    before = BatchPlan(G, 2, 2)
    _, streams = rank_streams(before)
    consumed = [i for st in streams for b in st[: s_done * before.accum] for i in b]
    after = BatchPlan(G, 3, 4)  # another world size and another micro batch, same G
    samplers = [BlockDistributedSampler(N, after, r, SEED) for r in range(4)]
    rest = [i for s in samplers for b in SkipBatchSampler(s, s_done * after.accum) for i in b]
    spe = N // G
    assert len(consumed) + len(rest) == spe * G
    assert sorted(consumed + rest) == sorted(epoch_order(N, SEED, 0)[: spe * G].tolist())


def test_same_seed_and_epoch_give_the_same_order_another_epoch_another():
    assert torch.equal(epoch_order(N, SEED, 0), epoch_order(N, SEED, 0))
    assert not torch.equal(epoch_order(N, SEED, 0), epoch_order(N, SEED, 1))
    assert not torch.equal(epoch_order(N, SEED, 0), epoch_order(N, SEED + 1, 0))


def test_each_epoch_drops_the_tail_that_does_not_fill_a_global_batch():
    for world in (1, 2, 4):
        plan = BatchPlan(G, 2, world)
        assert plan.steps_per_epoch(N) == N // G
        assert len(BlockDistributedSampler(N, plan, 0, SEED)) == (N // G) * plan.accum


def test_a_global_batch_that_does_not_divide_is_an_error_suggesting_micro_batches_that_do():
    with pytest.raises(BatchPlanError, match=r"train.global_batch=24 .* micro batches that divide it on 2 process\(es\): 1, 2, 3, 4, 6, 12"):
        BatchPlan(24, 5, 2)
    with pytest.raises(BatchPlanError, match="multiple of the world size 5"):
        BatchPlan(24, 1, 5)


def test_the_order_is_one_tensor_and_skipping_far_computes_no_skipped_batch(monkeypatch):
    sampler = BlockDistributedSampler(10_000_000, BatchPlan(1024, 64, 2), 1, SEED)
    assert sampler.order().perm.dtype == torch.int64 and sampler.order().perm.numel() == 10_000_000
    positions = []
    real = sampler.global_position
    monkeypatch.setattr(sampler, "global_position", lambda k: positions.append(k) or real(k))
    it = iter(SkipBatchSampler(sampler, len(sampler) - 1))
    last = next(it)
    assert len(last) == 64 and next(it, None) is None
    assert positions == [len(sampler) - 1]  # only the batch it yielded: the skip is arithmetic


def test_a_world_size_that_does_not_divide_the_micro_batches_names_the_sizes_that_work():
    with pytest.raises(BatchPlanError, match=r"M = 6 micro-batches per step\) the world sizes that work are 1, 2, 3, 6"):
        BatchPlan(12, 2, 4)
