"""Context parallelism in the runtime: the cp group of each rank, the checks a config must pass before any
collective, and the one place a batch is split along the sequence (ContextParallel.shard, called by
runtime.train.train_step once per micro-batch; a split batch cannot be split again).

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

from attention.attention import build_attn_meta, resolve_attn_backend
from attention.context_parallel import CPShard, zigzag_index
from runtime.config import Config, ConfigError
from runtime.distributed.mesh import Meshes, ParallelDims
from runtime.loss import IGNORE_INDEX
from runtime.models.qwen import GDNConfig, QwenConfig


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
        check_context_parallel(cfg, model_cfg)
        conv_tail = model_cfg.gdn.conv_kernel - 1 if model_cfg.gdn is not None else 0
        return cls(meshes.world.get_group("cp"), rank % dims.cp, dims.cp, cfg.parallelism.cp_attention,
                   model_cfg.attn_backend, cfg.parallelism.cp_gdn, conv_tail)

    def shard(self, batch) -> CPBatch:
        """This rank's tokens of every row; the whole rows' metadata goes into the CPShard (on the batch's
        device). Raises on a CPBatch: a batch is split along the sequence exactly once."""
        if isinstance(batch, CPBatch):
            raise TypeError("this batch is already split along the sequence (context parallelism shards a "
                            "batch once, in runtime.train.train_step)")
        device = batch.input_ids.device
        backend = resolve_attn_backend(self.attn_backend, device)
        meta = build_attn_meta(batch.position_ids, batch.cu_seqlens, batch.max_seqlen, backend)
        shard = CPShard(self.group, self.rank, self.size, meta, batch.position_ids, self.mode, self.gdn_mode,
                        self.gdn_conv_tail)
        labels = shard.take(batch.labels)
        return CPBatch(input_ids=shard.take(batch.input_ids), labels=labels,
                       position_ids=shard.take(batch.position_ids),
                       num_label_tokens=int((labels != IGNORE_INDEX).sum()), cp=shard)


def check_context_parallel(cfg: Config, model_cfg: QwenConfig) -> None:
    """What cp > 1 needs of the data and the model, as ConfigErrors (every rank raises alike, before any
    collective): rows cut into 2*cp equal pieces, heads that split for Ulysses and for head-parallel GDN layers,
    GDN state passing with pieces no shorter than the conv tail."""
    cp, mode = cfg.parallelism.cp, cfg.parallelism.cp_attention
    try:
        zigzag_index(cfg.data.seq_len, cp, 0)
    except ValueError as err:
        raise ConfigError(f"data.seq_len: {err}") from None
    if mode == "ulysses":
        if model_cfg.num_heads % cp:
            raise ConfigError(f"parallelism.cp_attention: ulysses splits the {model_cfg.num_heads} query heads over "
                              f"cp={cp}, which does not divide them; use cp_attention: allgather or another cp")
        kv = model_cfg.num_kv_heads
        if kv % cp and cp % kv:
            raise ConfigError(f"parallelism.cp_attention: ulysses needs the {kv} kv heads to divide cp={cp} or be "
                              "divisible by it; use cp_attention: allgather or another cp")
    if any(model_cfg.is_linear_attention(i) for i in range(model_cfg.num_layers)):
        _check_gdn(cfg, model_cfg.gdn)


def _check_gdn(cfg: Config, gdn: GDNConfig) -> None:
    """GDN layers under parallelism.cp_gdn: heads need cp | num_k_heads; state needs pieces of at least
    conv_kernel-1 tokens (either op set)."""
    cp, piece = cfg.parallelism.cp, cfg.data.seq_len // (2 * cfg.parallelism.cp)
    if cfg.parallelism.cp_gdn == "heads":
        if gdn.num_k_heads % cp:
            raise ConfigError(f"parallelism.cp={cp}: Gated DeltaNet layers run head-parallel (parallelism.cp_gdn: "
                              f"heads) and need cp to divide linear_num_key_heads={gdn.num_k_heads}; or set "
                              "parallelism.cp_gdn: state")
        return
    if piece < gdn.conv_kernel - 1:
        raise ConfigError(f"parallelism.cp_gdn: state reads conv tails of linear_conv_kernel_dim-1 = "
                          f"{gdn.conv_kernel - 1} tokens from the previous zigzag piece, but pieces hold "
                          f"data.seq_len/(2*cp) = {piece}; use a longer data.seq_len or a smaller cp")
