"""runtime.graph_step.agreed_buckets on a gloo group: ranks whose rows differ agree on one bucket per
micro-batch, the largest of theirs, so every rank pads alike (and captures and replays the same graph)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.data.packing import Batch
from runtime.graph_step import LABEL_BUCKET, agreed_buckets, bucket_of


def _row(seqlens: list[int], labels: int) -> Batch:
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.zeros(1, sum(seqlens), dtype=torch.long)
    return Batch(ids, ids.clone(), ids.clone(), cu, max(seqlens), labels)


def _agree(rank, world_size):
    rows = {0: [_row([1000] * 3 + [5192], 3000), _row([4096, 4096], 8000)],
            1: [_row([100] * 81 + [92], 6000), _row([8192], 8191)]}[rank]
    group = dist.new_group(backend="gloo")
    return [bucket_of(b) for b in rows], agreed_buckets(rows, group)


def test_ranks_agree_on_the_largest_bucket_of_each_micro_batch(run_dist):
    (own0, agreed0), (own1, agreed1) = run_dist(_agree, 2)
    assert own0 == [(4, 8192, 3 * LABEL_BUCKET), (2, 4096, 8 * LABEL_BUCKET)]
    assert own1 == [(128, 128, 6 * LABEL_BUCKET), (1, 8192, 8 * LABEL_BUCKET)]
    assert agreed0 == agreed1 == ((128, 8192, 6 * LABEL_BUCKET), (2, 8192, 8 * LABEL_BUCKET))
