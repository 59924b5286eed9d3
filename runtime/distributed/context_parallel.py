"""Context parallelism in the runtime: the cp group of each rank, and the one place a batch is split along the
sequence (ContextParallel.shard, called by runtime.train.train_step once per micro-batch; a split batch cannot
be split again). What cp needs of the config and the model is checked by runtime.plan, before any process group.

    cp = ContextParallel.build(meshes, dims, rank, cfg)     # None with cp 1
    local = cp.shard(batch)      # a CPBatch: this rank's tokens of every row + the CPShard the mixers read

The cp ranks of one data slice hold the same whole rows (ParallelDims.dp_rank); each keeps its zigzag share
(attention/context_parallel.py). The loss is this rank's label tokens' sum; divided by the global label
count and summed over every rank (FSDP over dp_shard*cp sums the gradients) it is the whole batch's loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from attention.attention import build_attn_meta
from attention.context_parallel import CPShard
from runtime.config import Config
from runtime.distributed.mesh import Meshes, ParallelDims
from runtime.loss import IGNORE_INDEX
from runtime.models.qwen import QwenConfig


@dataclass
class CPBatch:
    """This rank's share of a Batch's rows (runtime.data.Batch fields, [B, S/cp]) and its CPShard."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    num_label_tokens: int
    cp: CPShard
    cu_seqlens: None = None  # the whole rows' boundaries live in cp.meta
    max_seqlen: None = None

    @property
    def loss_rows(self) -> int:
        """The loss's row count (runtime.data.Batch.loss_rows): this rank's label count."""
        return self.num_label_tokens


@dataclass
class ContextParallel:
    group: dist.ProcessGroup
    rank: int
    size: int
    mode: str
    attn_backend: str
    gdn_mode: str = "heads"
    gdn_conv_tail: int = 0  # GDN conv window - 1: the tokens a piece's conv reads from its predecessor (state)

    @classmethod
    def build(cls, meshes: Meshes | None, dims: ParallelDims, rank: int, cfg: Config,
              model_cfg: QwenConfig) -> ContextParallel | None:
        if dims.cp == 1:
            return None
        # runtime.plan checked cp against the data and the model; model_cfg.attn_backend is a concrete name
        conv_tail = model_cfg.gdn.conv_kernel - 1 if model_cfg.gdn is not None else 0
        return cls(meshes.world.get_group("cp"), rank % dims.cp, dims.cp, cfg.parallelism.cp_attention,
                   model_cfg.attn_backend, cfg.parallelism.cp_gdn, conv_tail)

    def shard(self, batch) -> CPBatch:
        """This rank's tokens of every row; the whole rows' metadata goes into the CPShard (on the batch's
        device). Raises on a CPBatch: a batch is split along the sequence exactly once."""
        if isinstance(batch, CPBatch):
            raise TypeError("this batch is already split along the sequence (context parallelism shards a "
                            "batch once, in runtime.train.train_step)")
        meta = build_attn_meta(batch.position_ids, batch.cu_seqlens, batch.max_seqlen, self.attn_backend)
        shard = CPShard(self.group, self.rank, self.size, meta, batch.position_ids, self.mode, self.gdn_mode,
                        self.gdn_conv_tail)
        labels = shard.take(batch.labels)
        return CPBatch(input_ids=shard.take(batch.input_ids), labels=labels,
                       position_ids=shard.take(batch.position_ids),
                       num_label_tokens=int((labels != IGNORE_INDEX).sum()), cp=shard)
