"""The trainer's data order: sharded across ranks, reshuffled each epoch, resumable at any micro-batch."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

import workbench as wb
from workbench.training import ShardedBatches

DATA = TensorDataset(torch.arange(100))


def ids(batches, n: int) -> list[list[int]]:
    return [next(batches)[0].tolist() for _ in range(n)]


def test_ranks_get_disjoint_shards_of_one_permutation() -> None:
    cfg = wb.RunConfig(micro_batch_size=5, seed=1)
    r0 = ids(ShardedBatches(DATA, cfg, rank=0, world=2, collate_fn=None).iterate(0), 10)
    r1 = ids(ShardedBatches(DATA, cfg, rank=1, world=2, collate_fn=None).iterate(0), 10)
    seen0, seen1 = {i for b in r0 for i in b}, {i for b in r1 for i in b}
    assert not seen0 & seen1 and seen0 | seen1 == set(range(100))


def test_each_epoch_is_a_new_shuffle_and_the_seed_fixes_it() -> None:
    cfg = wb.RunConfig(micro_batch_size=10, seed=7)
    shard = ShardedBatches(DATA, cfg, rank=0, world=1, collate_fn=None)
    assert shard.per_epoch == 10
    two_epochs = ids(shard.iterate(0), 20)
    assert sorted(i for b in two_epochs[:10] for i in b) == list(range(100))
    assert two_epochs[:10] != two_epochs[10:]
    assert ids(ShardedBatches(DATA, cfg, 0, 1, None).iterate(0), 20) == two_epochs
    assert ids(ShardedBatches(DATA, cfg.replace(seed=8), 0, 1, None).iterate(0), 10) != two_epochs[:10]


def test_starting_mid_epoch_continues_the_same_order() -> None:
    cfg = wb.RunConfig(micro_batch_size=10, seed=7)
    full = ids(ShardedBatches(DATA, cfg, 0, 1, None).iterate(0), 25)
    assert ids(ShardedBatches(DATA, cfg, 0, 1, None).iterate(13), 12) == full[13:]


def test_a_training_set_smaller_than_one_micro_batch_per_rank_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match=r"micro_batch_size=64: the training set has 100 samples, 50 per rank over "
                                         r"2 rank\(s\), fewer than one micro-batch"):
        ShardedBatches(DATA, wb.RunConfig(micro_batch_size=64), rank=0, world=2, collate_fn=None)
