"""Will it fit: the bytes one rank of a run holds, from the config alone (a meta-device model: nothing is
allocated, no process group is needed).

    python -m runtime.launch --estimate [--world-size N] [--ep N --cp N ...] cfg.yaml
    est = estimate(cfg, dims, cuda=True); print(est.table())

Per rank, in the dtypes the trainer uses (runtime.train.build_model, runtime.optim):
    parameters   frozen ones in model.dtype, trainable ones in their master dtype (fp32 under bf16 autocast
                 on CUDA, or bf16 with optim.master_dtype: bf16); FSDP shards everything over dp_shard*cp
                 (experts over ep x efsdp, the same count per rank); FP4-packed experts (quant) are split
                 over ep only (their buffers are not sharded)
    gradients    the trainable parameters' shards, in their dtype
    optimizer    AdamW's two moments of the trainable shards (fp32, or bf16 with master_dtype: bf16)
    activations  what the layers keep for backward, per token of this rank (micro_batch * seq_len / cp),
                 counted from what each op saves (activation_bytes_per_token; under EP the experts'
                 buffers of every received row, -1 slots included), by parallelism.activation_checkpoint; plus, under autocast, the bf16 copies of fp32
                 trainable weights that forward casts and backward reads
    temporaries  the largest buffers that live at once besides: the chunked loss (one chunk's fp32
                 logits, their softmax and gradient, lm_head's fp32 gradient when it trains) at the end of
                 forward, and FSDP's gathered unit (a block's parameters in bf16, twice with prefetch)
The peak is parameters + optimizer + the larger of (activations + loss temporaries + FSDP unit) at the end
of forward and (gradients + FSDP unit) in backward; with full activation checkpointing backward also holds
every block's input and one block recomputed whole. docs/estimate.md compares it with measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe.experts import GroupedExperts
from quant import FP4Weight, quantize_experts
from runtime.config import Config
from runtime.distributed.mesh import ParallelDims
from runtime.loss import LOGITS_CHUNK_BYTES
from runtime.models.qwen import QwenConfig, QwenForCausalLM

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    end_of_forward: dict[str, int] = field(default_factory=dict)   # temporaries next to the activations
    end_of_backward: dict[str, int] = field(default_factory=dict)  # next to the gradients

    @property
    def peak(self) -> int:
        forward = self.activations + sum(self.end_of_forward.values())
        backward = self.gradients + sum(self.end_of_backward.values())
        return self.parameters + self.optimizer + max(forward, backward)

    def table(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer states", self.optimizer),
                ("activations", self.activations)]
        rows += [(f"end of forward: {k}", v) for k, v in self.end_of_forward.items()]
        rows += [(f"end of backward: {k}", v) for k, v in self.end_of_backward.items()]
        rows.append(("peak (estimate)", self.peak))
        return "\n".join(f"  {name:<44} {value / GIB:8.2f} GiB" for name, value in rows)


def _meta_model(cfg: Config, qcfg: QwenConfig) -> QwenForCausalLM:
    """The run's model on the meta device: LoRA applied, experts packed as the trainer builds them."""
    from runtime.lora import apply_lora

    with torch.device("meta"):
        model = QwenForCausalLM(qcfg, dtype=torch.bfloat16)
        if cfg.quant.base_weights != "none":
            for block in model.moe_blocks():
                quantize_experts(block.experts, cfg.quant.base_weights)
        if cfg.lora.enabled:
            apply_lora(model, cfg.lora)
    return model


def _weights(model: QwenForCausalLM) -> tuple[int, int, int]:
    """(frozen values, trainable values, packed FP4 bytes) of the whole model."""
    frozen = trainable = 0
    for p in model.parameters():
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    packed = sum(m.packed_bytes() for m in model.modules() if isinstance(m, FP4Weight))
    return frozen, trainable, packed


def _gathered_block_values(model: QwenForCausalLM, dims: ParallelDims) -> int:
    """Values FSDP gathers for the largest block, beyond this rank's shards: the dense part over
    dp_shard*cp, this EP rank's experts over efsdp (runtime/distributed/fsdp.py)."""
    shards = dims.dp_shard * dims.cp
    def gathered(block) -> float:
        experts = sum(p.numel() for m in block.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
        dense = sum(p.numel() for p in block.parameters()) - experts
        return dense * (shards - 1) / shards + experts / dims.ep * (dims.efsdp - 1) / dims.efsdp
    return int(max(gathered(block) for block in model.model.layers.values()))


def ep_visits(num_experts_per_tok: int, ep: int) -> float:
    """EP ranks a token is sent to, on average: ep * (1 - (1 - 1/ep)^k) for uniform routing over the ranks."""
    return ep * (1 - (1 - 1 / ep) ** num_experts_per_tok)


def activation_bytes_per_token(qcfg: QwenConfig, layer: int, c: int, lora_rank: int, mode: str,
                               ep: int = 1) -> int:
    """Bytes one token keeps for backward in decoder block `layer`, compute dtype of `c` bytes.

    none: every tensor the ops save (the RMSNorms' fp32 input and output, projection inputs, q/k before the
    fused norm+RoPE, the attention kernel's q, k, v (kv heads repeated to the query heads, as cuDNN's kernel
    takes them), output and log-sum-exp, the router's fp32 probabilities, the experts' gate_up and SwiGLU
    outputs per top-k slot, LoRA's rank-sized intermediates). selective: the same less what elementwise ops
    saved (the norms' fp32 tensors: recomputed). full: the block's input only."""
    H = qcfg.hidden_size
    if mode == "full":
        return c * H
    norms = 2 * (4 * H + c * H)  # fp32 x and the normed output, twice per block
    if qcfg.is_linear_attention(layer):
        g = qcfg.gdn
        key, value = g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim
        conv = 2 * key + value
        # input, conv in/out, q/k normalized (fp32), v, decay and beta (fp32), output, z, gated norm (fp32)
        mixer = c * (H + 2 * conv + value + 2 * value) + 4 * (2 * key + 2 * g.num_v_heads + value)
        lora_sites = 3
    else:
        D, Hq, Hkv = qcfg.head_dim, qcfg.num_heads, qcfg.num_kv_heads
        gate = Hq * D if qcfg.gated_attention else 0
        mixer = c * (H + (Hq + Hkv) * D + 4 * Hq * D + 2 * gate) + 4 * Hq
        lora_sites = 4
    if qcfg.is_moe_layer(layer):
        k, I = qcfg.num_experts_per_tok, qcfg.moe_intermediate_size
        # under EP a token arrives at `visits` ranks as a row of k slots each; the expert buffers are
        # allocated for every slot of a received row, -1 slots included (scattermoe's [M*k, *] layout)
        visits = ep_visits(k, ep)
        received = c * H * visits if ep > 1 else 0
        mlp = 4 * qcfg.num_experts + received + visits * k * (c * 3 * I + c + 2 * c * lora_rank)
        if qcfg.shared_expert_intermediate_size:
            mlp += c * 3 * qcfg.shared_expert_intermediate_size
    else:
        mlp = c * 4 * qcfg.intermediate_size
    lora = lora_sites * c * lora_rank
    kept = mixer + mlp + lora + norms
    return int(kept - 2 * 4 * H if mode == "selective" else kept)


def estimate(cfg: Config, dims: ParallelDims, cuda: bool = True) -> MemoryEstimate:
    from runtime.train import model_config

    qcfg = model_config(cfg)
    model = _meta_model(cfg, qcfg)
    frozen, trainable, packed = _weights(model)
    model_bytes = DTYPE_BYTES[cfg.model.dtype]
    bf16_master = cfg.optim.master_dtype == "bf16"
    master_bytes = 2 if bf16_master else (4 if cuda else model_bytes)
    compute = 2 if cuda else model_bytes
    shards = dims.dp_shard * dims.cp
    parameters = (frozen * model_bytes + trainable * master_bytes) // shards + packed // dims.ep
    gradients = trainable * master_bytes // shards
    optimizer = 2 * trainable * (2 if bf16_master else 4 if cuda else model_bytes) // shards

    tokens = cfg.train.micro_batch_size * cfg.data.seq_len // dims.cp
    rank = cfg.lora.rank if cfg.lora.enabled else 0
    mode = cfg.parallelism.activation_checkpoint
    per_token = sum(activation_bytes_per_token(qcfg, i, compute, rank, mode, dims.ep) for i in range(qcfg.num_layers))
    activations = tokens * (per_token + compute * qcfg.hidden_size)  # + the final norm's input
    end_of_forward = {}
    if cuda and master_bytes == 4 and trainable:
        # autocast (and the expert kernels) cast fp32 trainable weights to bf16 once per forward; backward
        # reads the copies, so they live from their layer's forward to its backward
        end_of_forward["bf16 copies of fp32 weights"] = 2 * trainable // shards
    lm_head_trains = model.lm_head.weight.requires_grad
    end_of_forward["chunked loss"] = int(3.5 * LOGITS_CHUNK_BYTES) + (
        4 * qcfg.vocab_size * qcfg.hidden_size if lm_head_trains else 0)
    end_of_backward = {}
    if mode == "full":  # the first backward recomputes the last block whole, next to every block's input
        end_of_backward["block inputs kept"] = activations
        end_of_backward["recomputed block"] = tokens * max(
            activation_bytes_per_token(qcfg, i, compute, rank, "none", dims.ep) for i in range(qcfg.num_layers))
    if shards > 1:  # bf16 (FSDP's param_dtype), the current block and the prefetched next
        unit = 2 * 2 * _gathered_block_values(model, dims)
        end_of_forward["FSDP gathered blocks"] = end_of_backward["FSDP gathered blocks"] = unit
    return MemoryEstimate(parameters, gradients, optimizer, activations, end_of_forward, end_of_backward)


def report(cfg: Config, dims: ParallelDims, cuda: bool = True) -> str:
    est = estimate(cfg, dims, cuda)
    mesh = (f"world {dims.world_size} = dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x cp {dims.cp}; "
            f"ep {dims.ep}, efsdp {dims.efsdp}")
    where = "CUDA (bf16 autocast)" if cuda else "CPU"
    return (f"memory per rank, {where}; {mesh}; {cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens per "
            f"micro-batch, activation_checkpoint {cfg.parallelism.activation_checkpoint}\n{est.table()}")
