"""Will it fit: the bytes one rank of a run holds, from the config alone (a meta-device model: nothing is
allocated, no process group is needed).

    python -m runtime.launch --estimate [--world-size N] [--ep N --cp N ...] cfg.yaml
    est = estimate(cfg, dims, cuda=True); print(est.table())

Contract: `estimate(cfg, dims, cuda)` -> MemoryEstimate for one rank, in the dtypes the trainer uses
(runtime.models.factory.build_model, runtime.optim): on CUDA bf16 autocast over fp32 masters (or bf16 masters,
optim.master_dtype), off CUDA every value in its parameter's dtype. Its lines:
    parameters   frozen ones in model.dtype, trainable ones in the master dtype; FSDP shards them over
                 dp_shard*cp (experts over ep x efsdp: the same count per rank), except the frozen dense
                 ones that parallelism.frozen_dense replicates, whole on every rank (the trainable ones too
                 where that leaves no FSDP unit: ep = the world); quantized experts
                 (quant.base_weights: 4.25 / 4.5 / 8 bits per weight, fp8 plus its row scales) are split over
                 ep only (FSDP does not shard buffers)
    gradients    the trainable parameters' shards, in the master dtype
    optimizer    AdamW's two moments of the trainable shards, in the master dtype
    activations  what forward keeps for backward: tokens of this rank (micro_batch_size * seq_len / cp)
                 times activation_bytes_per_token for parallelism.activation_checkpoint
    end of forward / start of backward / end of backward: what lives next to the activations (or, at
                 the end, the gradients) at those moments: the chunked loss's buffers, bf16 copies of fp32
                 weights, lm_head's gradient (the loss computes it in forward), one block's backward
                 buffers, the block that checkpointing recomputes, FSDP's gathered units, the whole-row K/V
                 of context parallelism's all-gather attention
The peak is parameters + optimizer + the largest of the three moments. docs/estimate.md compares it with
measured GPU peaks; tests/unit/test_estimate.py checks the activation count against what tiny models keep
on the CPU, in every checkpointing mode.

The count follows the CUDA kernels that `auto` picks: cuDNN attention for rows of one document (it keeps the kv
heads as they are, as flash varlen does for packed rows), the Triton q/k norm+RoPE, the scattermoe experts and
FLA's Gated DeltaNet ops. Per op it counts what autograd keeps, and an op keeps an input only for a gradient
that is needed: a frozen linear keeps nothing of its input, and in the first block of a LoRA run nothing before
the first adapter keeps anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from attention.attention import QKV_PROJECTIONS, Qwen3Attention
from attention.rope import inv_freq_and_scale
from moe.experts import GroupedExperts
from moe.router import SoftmaxTopKRouter
from quant import QuantizedWeight
from runtime.config import Config
from runtime.distributed.fsdp import frozen_dense_placement, fsdp_gather_dtype, leaves_no_unit
from runtime.distributed.mesh import ParallelDims
from runtime.lora import LoRALinear
from runtime.loss import default_chunk_size
from runtime.models.factory import meta_model, model_config
from runtime.models.qwen import QwenConfig, QwenForCausalLM

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
FLA_CHUNK = 64  # attention/gdn_ops_fla.py: FLA's WY matrix A holds this many values per token and value head
SLOT_MAPS = 12  # scattermoe's SlotOrder: sorted order, its inverse and the row of every slot, int32 each
INDEX = 8  # int64: expert ids, the source token of a row sent under EP
ATTENTION_SITES = ("q_proj", "k_proj", "v_proj", "o_proj")
GDN_INPUTS = {"qwen3_5": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
              "qwen3_next": ("in_proj_qkvz", "in_proj_ba")}
MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Precision:
    """Bytes per value (runtime.models.factory.build_model, runtime.optim.apply_master_dtype)."""
    frozen: int   # model.dtype
    master: int   # trainable parameters, their gradients and AdamW moments
    stream: int   # the residual stream: the embedding's dtype (a trained embedding is a master)
    compute: int  # matmul operands and outputs: bf16 under CUDA autocast, else the parameters' dtype

    @property
    def casts(self) -> bool:
        """Autocast gives each matmul its own bf16 copy of an fp32 activation (it caches weights only)."""
        return self.stream != self.compute


def precision(cfg: Config, cuda: bool) -> Precision:
    frozen = DTYPE_BYTES[cfg.model.dtype]
    master = 2 if cfg.optim.master_dtype == "bf16" else 4 if cuda else frozen
    stream = frozen if cfg.lora.enabled else master
    return Precision(frozen, master, stream, 2 if cuda else stream)


@dataclass(frozen=True)
class Run:
    """What the per-op count needs besides the model's shapes."""
    q: QwenConfig
    p: Precision
    lora_rank: int = 0                # 0: a full fine-tune, every parameter trains
    targets: frozenset = frozenset()  # LoRA target modules
    ep: int = 1
    gathered: bool = False            # the all_gather dispatcher: every token to every EP rank
    gather_capacity: float = 1.0      # its bound on the per-slot buffers, x the valid slots (parallelism.*)

    @property
    def full(self) -> bool:
        return self.lora_rank == 0

    def adapters(self, names: Iterable[str]) -> int:
        """How many of these modules carry a LoRA adapter."""
        return sum(name in self.targets for name in names) if self.lora_rank else 0

    @property
    def visits(self) -> float:
        """Rows a token becomes: 1, or under EP the ranks it is sent to (ep_visits; all of them when gathered)."""
        if self.ep == 1:
            return 1
        return self.ep if self.gathered else ep_visits(self.q.num_experts_per_tok, self.ep)

    @property
    def slot_buffers(self) -> float:
        """The expert-sorted buffers' rows per valid slot: 1, or when gathered the bound's capacity (the valid
        count is on the device only; at most ep, every received slot). A run whose routing needs more grows it."""
        return min(self.ep, self.gather_capacity) if self.gathered else 1


def run_of(cfg: Config, qcfg: QwenConfig, cuda: bool, ep: int = 1) -> Run:
    lora = cfg.lora
    return Run(qcfg, precision(cfg, cuda), lora.rank if lora.enabled else 0, frozenset(lora.target_modules), ep,
               gathered=ep > 1 and cfg.parallelism.dispatcher == "all_gather",
               gather_capacity=cfg.parallelism.gather_capacity)


def ep_visits(num_experts_per_tok: int, ep: int) -> float:
    """EP ranks a token is sent to, on average: ep * (1 - (1 - 1/ep)^k) for uniform routing over the ranks.
    Each receives it as one row of k slots, -1 where the slot's expert lives elsewhere."""
    return ep * (1 - (1 - 1 / ep) ** num_experts_per_tok)


# ----------------------------------------------------------------------------- activations, per token


@dataclass(frozen=True)
class Count:
    """Bytes per token a block keeps for backward: under plain autograd (`kept`); the outputs of its matmuls
    and attention kernel (under EP also of its token exchange), which selective checkpointing caches
    (`matmuls`); what autograd nodes hold on their ctx, outside the saved tensors that checkpointing
    replaces, so in every mode (`held`, part of `kept`)."""
    kept: float = 0
    matmuls: float = 0
    held: float = 0

    def __add__(self, other: Count) -> Count:
        return Count(self.kept + other.kept, self.matmuls + other.matmuls, self.held + other.held)

    def under(self, mode: str, block_input: float) -> float:
        """Checkpointing keeps the block's input (a checkpoint argument) instead of its saved tensors."""
        if mode == "none":
            return self.kept
        return block_input + self.held + (self.matmuls if mode == "selective" else 0)


def _input(run: Run, savers: int) -> float:
    """A norm's output (stream dtype) read by `savers` matmuls that keep it: under autocast with an fp32
    stream each keeps its own bf16 copy, else they share it."""
    if savers == 0:
        return 0
    H = run.q.hidden_size
    return savers * run.p.compute * H if run.p.casts else run.p.stream * H


def _norm(run: Run, dim: int, unit_offset: bool, records: bool) -> float:
    """RMSNorm (attention/norm_rope.rms_norm_reference): its fp32 input (the input itself when fp32) and
    1/rms, and when its weight trains the normalized input ((1 + w) norms multiply in fp32)."""
    if not records:
        return 0
    normed = (4 if unit_offset else run.p.stream) * dim if run.full else 0
    return 4 * dim + 4 + normed


def _lora(run: Run, outputs: dict[str, int]) -> Count:
    """LoRALinear sites: x A^T [r] kept by the B product; selective also caches both products."""
    c, r = run.p.compute, run.lora_rank
    sites = [out for name, out in outputs.items() if run.adapters([name])]
    return Count(kept=c * r * len(sites), matmuls=sum(c * (r + out) for out in sites))


def _attention(run: Run, records: bool) -> Count:
    """(Gated) attention: the q and k projections' outputs (the norm+RoPE kernel keeps them; q's holds the
    gate too), cuDNN's q, k, v (kv heads as they are) and output in the compute dtype and its fp32 log-sum-exp,
    with the gate sigmoid(g) and the gated output; o_proj keeps its input when it trains."""
    q, c = run.q, run.p.compute
    D, Hq, Hkv, H = q.head_dim, q.num_heads, q.num_kv_heads, q.hidden_size
    q_out = Hq * D * (2 if q.gated_attention else 1)
    lora = _lora(run, {"q_proj": q_out, "k_proj": Hkv * D, "v_proj": Hkv * D, "o_proj": H})
    matmuls = c * (q_out + 2 * Hkv * D + H) + c * Hq * D + 4 * Hq + lora.matmuls
    if not records:
        return Count(matmuls=matmuls)
    o_keeps = run.full or run.adapters(["o_proj"])
    kept = (_input(run, 3 if run.full else run.adapters(ATTENTION_SITES[:3])) + c * (q_out + Hkv * D)
            + c * (2 * Hq + 2 * Hkv) * D + 4 * Hq + lora.kept)
    if q.gated_attention:
        kept += c * Hq * D * (2 if o_keeps else 1)
    return Count(kept, matmuls)


def _gdn(run: Run, records: bool) -> Count:
    """Gated DeltaNet on FLA's ops: the conv's input and output (v is a view of it), the delta rule's
    normalized q, k and their 1/norm, the decay's cumsum, the WY matrix A, beta; the decay's fp32 softplus;
    the gated norm's fp32 o, z, silu(z) and 1/rms, weight * normed o, and out_proj's input when it trains."""
    q, c = run.q, run.p.compute
    g, H = q.gdn, q.hidden_size
    key, value, HV = g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim, g.num_v_heads
    conv = 2 * key + value
    outputs = {"in_proj_qkv": conv, "in_proj_z": value, "in_proj_b": HV, "in_proj_a": HV,
               "in_proj_qkvz": conv + value, "in_proj_ba": 2 * HV, "out_proj": H}
    lora = _lora(run, outputs)
    matmuls = c * (conv + value + 2 * HV + H) + lora.matmuls
    if not records:
        return Count(matmuls=matmuls)
    inputs = GDN_INPUTS[g.layout]
    kept = _input(run, len(inputs) if run.full else run.adapters(inputs))
    kept += 2 * c * conv + 2 * c * key + 8 * g.num_k_heads + 4 * HV + c * FLA_CHUNK * HV + c * HV
    kept += 9 * HV + (4 * HV if run.full else 0)  # softplus: input, exp, x > 20; A_log's factor when it trains
    weight = run.p.master if run.full else run.p.frozen  # the gated norm's weight: weight * normed takes its dtype
    kept += 12 * value + 4 * HV + max(c, weight) * value  # gated norm: fp32 o, z, silu(z); 1/rms; weight * normed
    kept += c * value * ((1 if run.full else 0) + (1 if run.full or run.adapters(["out_proj"]) else 0))
    return Count(kept + lora.kept, matmuls)


def _moe(run: Run, records: bool) -> tuple[Count, bool]:
    """Router, scattermoe experts and the gated shared expert; returns the count and whether the block's
    output needs a gradient.

    Router: fp32 probabilities, the top-k values and their sum (renormalized), the routing weights (stream
    dtype) the experts keep. Experts, per valid slot (k per token: under EP the dispatcher's valid-slot count
    sizes them, not the received rows' M*k; all_gather's bound: gather_capacity x k per token): gate_up [2I]
    and the weighted SwiGLU [I] in the compute dtype, LoRA's two rank-sized products; per received slot (-1
    ones included): the slot maps and the expert ids
    (these on ctx: kept in every mode). Under EP: the received rows in the compute dtype and each sent row's
    source token; selective checkpointing also keeps the exchange's outputs (received rows, weights and ids,
    and the partial sums combine brings back) rather than exchange again in backward."""
    q, c, s = run.q, run.p.compute, run.p.stream
    E, k, I, H = q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.hidden_size
    Is, v, lora = q.shared_expert_intermediate_size, run.visits, run.adapters(["experts"])
    router = records or run.full  # the router and the shared expert record when their input needs a gradient
    matmuls = c * E + (c * (2 * Is + H) + c if Is else 0)
    if run.ep > 1:
        matmuls += run.visits * (s * H + s * k + INDEX * k + c * H)
    if not (router or lora):
        return Count(matmuls=matmuls), False
    held = k * v * (SLOT_MAPS + INDEX)
    savers = (1 if run.full else 0) + (1 if run.ep == 1 else 0) + (3 if run.full and Is else 0)
    slots = k * run.slot_buffers
    kept = _input(run, savers) + held + v * s * k + slots * c * (3 * I + (2 * run.lora_rank if lora else 0))
    if run.ep > 1:
        kept += v * (c * H + INDEX)
    if router:
        kept += 4 * E + (4 * k + 4 if q.norm_topk_prob else 0) + (INDEX * k if run.ep > 1 else 0)
        if Is:  # SwiGLU's gate, silu(gate) and up; down_proj's input when it trains; sigmoid(g) and the output
            kept += 3 * c * Is + (c * Is if run.full else 0) + c + c * H
    return Count(kept, matmuls, held), True


def _mlp(run: Run, records: bool) -> Count:
    """Dense SwiGLU MLP: gate, silu(gate), up; down_proj's input and the block input when they train."""
    c, I, H = run.p.compute, run.q.intermediate_size, run.q.hidden_size
    matmuls = c * (2 * I + H)
    if not (records or run.full):
        return Count(matmuls=matmuls)
    return Count(_input(run, 2 if run.full else 0) + 3 * c * I + (c * I if run.full else 0), matmuls)


def block_count(run: Run, layer: int, records: bool) -> tuple[Count, bool]:
    """Block `layer` given whether its input needs a gradient; returns whether its output does."""
    q = run.q
    H, unit = q.hidden_size, q.norm_unit_offset
    linear = q.is_linear_attention(layer)
    sites = GDN_INPUTS[q.gdn.layout] + ("out_proj",) if linear else ATTENTION_SITES
    mixed = records or run.full or run.adapters(sites) > 0
    count = Count(kept=_norm(run, H, unit, records)) + (_gdn if linear else _attention)(run, mixed)
    count += Count(kept=_norm(run, H, unit, mixed))
    if q.is_moe_layer(layer):
        mlp, grad = _moe(run, mixed)
        return count + mlp, grad or mixed
    return count + _mlp(run, mixed), mixed


def blocks(run: Run) -> list[Count]:
    """Every block's count, the gradient flag passed along (a LoRA run's stream needs one from its first adapter)."""
    counts, records = [], run.full
    for layer in range(run.q.num_layers):
        count, records = block_count(run, layer, records)
        counts.append(count)
    return counts


def rotary_dim(q: QwenConfig) -> int:
    return 2 * inv_freq_and_scale(q.rope, q.head_dim)[0].numel()


def activation_bytes_per_token(run: Run, mode: str) -> float:
    """What forward keeps per token: every block (its input under checkpointing), RoPE's cos and sin (kept
    by the norm+RoPE kernel and by checkpointing), the final norm and the loss's d loss / d h."""
    q, s = run.q, run.p.stream
    H = q.hidden_size
    total = sum(count.under(mode, s * H) for count in blocks(run))
    attention = not all(q.is_linear_attention(i) for i in range(q.num_layers))
    if attention or mode != "none":
        total += 2 * rotary_dim(q) * s
    return total + _norm(run, H, q.norm_unit_offset, True) + s * H


# ----------------------------------------------------------------------------- transients


def loss_buffers(vocab: int, hidden: int, tokens: int, compute: int, lm_head_bytes: int, lm_head_trains: bool) -> int:
    """The chunked loss's peak (runtime.loss.chunked) beyond its inputs and d loss / d h (an activation): one
    chunk's fp32 logits and the [chunk, vocab] temporary of their logsumexp (at::native::logsumexp), the
    previous chunk's gradient (the loop still holds it), lm_head cast to the compute dtype, and its fp32
    gradient accumulator when it trains. Every token is counted as a label token."""
    chunk = min(default_chunk_size(vocab), tokens)
    previous = compute if tokens > chunk else 0
    cast = compute * vocab * hidden if lm_head_bytes != compute else 0
    return (8 + previous) * chunk * vocab + cast + (4 * vocab * hidden if lm_head_trains else 0)


def expert_backward_buffers(run: Run, tokens: int) -> float:
    """scattermoe's backward of one MoE block (moe/backends/scattermoe.py), per valid slot: d gate_up [2I] with
    g [I] and dy in slot order [H] (when the expert weights train), or with the dx slots [H]; then the dx
    rows [H] per received row."""
    q, c = run.q, run.p.compute
    k, I, H = q.num_experts_per_tok, q.moe_intermediate_size, q.hidden_size
    slots = k * run.slot_buffers
    per_token = max(slots * (3 * I + (H if run.full else 0)), slots * (2 * I + H) + run.visits * H)
    return tokens * c * per_token


def _recomputed_block(run: Run, tokens: int, model: QwenForCausalLM, copies: bool, mode: str) -> int:
    """Checkpointing recomputes one block at a time in backward: the largest block's recomputation adds what
    plain autograd keeps for it, less what selective checkpointing cached in forward (its matmul, attention and
    exchange outputs, already among the activations), with its `copies` of fp32 weights (autocast's cache is
    gone by then: each recomputation casts its block's weights again, the experts' too). An upper bound: the
    last block, recomputed first, may be smaller, and by the time a larger one is recomputed the blocks after it
    have released their activations (while their gradients have grown, which this does not count)."""
    cached = mode == "selective"
    kept = tokens * max(max(0.0, count.kept - (count.matmuls if cached else 0)) for count in blocks(run))
    if copies:
        kept += run.p.compute * max(sum(p.numel() for p in block.parameters() if p.requires_grad)
                                    for block in model.model.layers.values())
    return int(kept)


# ----------------------------------------------------------------------------- weights


def _expert_values(module: nn.Module) -> int:
    return sum(p.numel() for m in module.modules() if isinstance(m, GroupedExperts) for p in m.parameters())


@dataclass
class _Weights:
    frozen: int            # frozen values
    frozen_dense: int      # of them, outside the experts
    trainable: int         # trainable values
    trainable_dense: int   # of them, outside the experts
    packed: int            # quantized expert bytes


def _weights(model: QwenForCausalLM) -> _Weights:
    """The model's values by kind (_Weights)."""
    w = _Weights(0, 0, 0, 0, 0)
    experts = {p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    for p in model.parameters():
        dense = 0 if p in experts else p.numel()
        if p.requires_grad:
            w.trainable += p.numel()
            w.trainable_dense += dense
        else:
            w.frozen += p.numel()
            w.frozen_dense += dense
    w.packed = sum(m.packed_bytes() for m in model.modules() if isinstance(m, QuantizedWeight))
    return w


def weight_copies(model: QwenForCausalLM, mode: str, in_backward: bool, experts: bool = True) -> int:
    """Trainable values that get a compute-dtype copy: the matmul weights autocast casts (its cache holds them
    until forward ends) and, without checkpointing, the expert weights scattermoe casts and keeps (`experts`:
    False where FSDP gathers them in bf16, freed after forward). In
    backward (autocast exited) only what autograd keeps: nothing under checkpointing, and no lora_A of the
    first block's input projections, whose input (the frozen embedding's output) needs no gradient. A
    LoRALinear without dropout and fused q/k/v projections (attention.projection) cast their parameters
    themselves and keep only what their backward takes, so their copies follow the backward rule at either
    moment. Neither the embedding (never cast) nor lm_head (the loss casts it: loss_buffers)."""
    first = ("model.layers.0.self_attn.", "model.layers.0.linear_attn.in_proj")
    cast = (nn.Linear, SoftmaxTopKRouter) + ((GroupedExperts,) if mode == "none" and experts else ())
    fused = {id(p) for m in model.modules() if isinstance(m, Qwen3Attention) and m.fuse_qkv
             for p in map(m.get_submodule, QKV_PROJECTIONS)}
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, cast) or name == "lm_head":
            continue
        kept_only = in_backward or id(module) in fused or (isinstance(module, LoRALinear) and module.lora_dropout == 0)
        if kept_only and mode != "none":
            continue
        for pname, p in module.named_parameters(recurse=False):
            gradient_free_input = pname == "lora_A" and name.startswith(first) and not name.endswith("o_proj")
            if p.requires_grad and not (kept_only and gradient_free_input):
                total += p.numel()
    return total


def _gathered_block_values(model: QwenForCausalLM, dims: ParallelDims, replicate: bool) -> int:
    """Values FSDP gathers for the largest block, beyond this rank's shards: the dense part over
    dp_shard*cp (no block unit where frozen_dense replicates), this EP rank's experts over efsdp
    (runtime/distributed/fsdp.py)."""
    shards = dims.dp_shard * dims.cp

    def gathered(block) -> float:
        experts = _expert_values(block)
        dense = 0 if replicate else sum(p.numel() for p in block.parameters()) - experts
        return dense * (shards - 1) / shards + experts / dims.ep * (dims.efsdp - 1) / dims.efsdp
    return int(max(gathered(block) for block in model.model.layers.values()))


def _root_values(model: QwenForCausalLM, replicate: bool) -> int:
    """FSDP's root unit, which stays gathered from the start of forward to the end of backward: the parameters
    outside the blocks (embedding, lm_head, final norm), or where frozen_dense replicates every trainable one
    outside the experts."""
    if replicate:
        experts = {p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
        return sum(p.numel() for p in model.parameters() if p.requires_grad and p not in experts)
    in_blocks = sum(p.numel() for p in model.model.layers.parameters())
    return sum(p.numel() for p in model.parameters()) - in_blocks


# ----------------------------------------------------------------------------- the estimate


@dataclass
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    end_of_forward: dict[str, int] = field(default_factory=dict)    # next to the activations
    start_of_backward: dict[str, int] = field(default_factory=dict)  # next to the activations
    end_of_backward: dict[str, int] = field(default_factory=dict)   # next to the gradients

    @property
    def moments(self) -> dict[str, int]:
        return {"end of forward": self.activations + sum(self.end_of_forward.values()),
                "start of backward": self.activations + sum(self.start_of_backward.values()),
                "end of backward": self.gradients + sum(self.end_of_backward.values())}

    @property
    def peak(self) -> int:
        return self.parameters + self.optimizer + max(self.moments.values())

    def table(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer states", self.optimizer),
                ("activations", self.activations)]
        for moment, extra in (("end of forward", self.end_of_forward), ("start of backward", self.start_of_backward),
                              ("end of backward", self.end_of_backward)):
            rows += [(f"{moment}: {name}", value) for name, value in extra.items() if value]
        rows += [(f"at the {moment} (+ parameters, optimizer)", self.parameters + self.optimizer + value)
                 for moment, value in self.moments.items()]
        rows.append(("peak (estimate)", self.peak))
        unit, size = ("GiB", GIB) if self.peak >= GIB else ("MiB", 2 ** 20)  # one unit, read down the column
        return "\n".join(f"  {name:<52} {value / size:8.2f} {unit}" for name, value in rows)


def estimate(cfg: Config, dims: ParallelDims, cuda: bool = True,
             device_memory_bytes: int | None = None) -> MemoryEstimate:
    """See the module docstring. `device_memory_bytes` resolves parallelism.frozen_dense auto as the run
    would on that device (None: the CPU's fixed cap)."""
    qcfg = model_config(cfg)
    model = meta_model(cfg, qcfg, torch.bfloat16)
    run = run_of(cfg, qcfg, cuda, dims.ep)
    p, mode = run.p, cfg.parallelism.activation_checkpoint
    w = _weights(model)
    shards = dims.dp_shard * dims.cp
    placement = frozen_dense_placement(cfg.parallelism.frozen_dense, cfg.lora.enabled, w.frozen_dense * p.frozen,
                                       device_memory_bytes)
    replicate = placement == "replicate"
    whole = w.frozen_dense * p.frozen if replicate else 0  # replicated: every rank holds all of it
    # no FSDP unit at all: the trainables outside the experts stay whole too
    no_units = leaves_no_unit(cfg, qcfg, placement, dims, "cuda" if cuda else "cpu")
    dense_shards = 1 if no_units else shards
    trainable = (w.trainable - w.trainable_dense) // shards + w.trainable_dense // dense_shards
    parameters = whole + (w.frozen * p.frozen - whole) // shards + trainable * p.master + w.packed // dims.ep
    gradients = trainable * p.master
    optimizer = 2 * trainable * p.master
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len // dims.cp
    activations = int(tokens * activation_bytes_per_token(run, mode))

    forward, start, end = {}, {}, {}
    # FSDP's bf16 gathers are the compute weights; one GPU and fp32 gathers have autocast's cast copies instead,
    # except the experts' own units under EP, which gather in bf16 either way
    fp32_gathers = shards > 1 and cuda and fsdp_gather_dtype(cfg.parallelism.fsdp_param_dtype, dims.ep) == "fp32"
    copies = (shards == 1 or fp32_gathers) and p.master != p.compute
    if copies:
        experts_cast = dims.ep == 1
        forward["bf16 copies of fp32 weights"] = p.compute * weight_copies(model, mode, False, experts_cast)
        start["bf16 copies of fp32 weights"] = p.compute * weight_copies(model, mode, True, experts_cast)
    lm_head = model.lm_head.weight
    lm_head_bytes = (p.compute if shards > 1 and cuda and not fp32_gathers and not replicate
                     else p.master if lm_head.requires_grad else p.frozen)
    forward["chunked loss"] = loss_buffers(qcfg.vocab_size, qcfg.hidden_size, tokens, p.compute, lm_head_bytes,
                                           lm_head.requires_grad)
    if lm_head.requires_grad:  # computed by the loss in forward, kept until backward hands it over
        start["lm_head gradient"] = lm_head_bytes * lm_head.numel()
    if qcfg.num_experts:
        start["expert backward buffers"] = end["expert backward buffers"] = int(expert_backward_buffers(run, tokens))
    if mode != "none":
        start["recomputed block"] = _recomputed_block(run, tokens, model, copies, mode)
    if cfg.parallelism.cp > 1 and cfg.parallelism.cp_attention == "allgather":
        varlen = cuda and cfg.model.attn_backend != "sdpa"  # auto and flash take the varlen kernel on CUDA
        start["cp gathered K/V"] = forward["cp gathered K/V"] = _allgather_kv(run, tokens, dims.cp, mode, varlen)
    if shards > 1 and not no_units:  # FSDP's param dtype (the experts' share at fp32 gathers over-counted): the
        # current block, the prefetched next, the root unit
        unit_bytes = p.compute if cuda and not fp32_gathers else p.master
        fsdp = int(unit_bytes * (2 * _gathered_block_values(model, dims, replicate)
                                 + _root_values(model, replicate) * (shards - 1) / shards))
        forward["FSDP gathered units"] = start["FSDP gathered units"] = end["FSDP gathered units"] = fsdp
    return MemoryEstimate(parameters, gradients, optimizer, activations, forward, start, end)


def _allgather_kv(run: Run, tokens: int, cp: int, mode: str, varlen: bool) -> int:
    """All-gather context parallelism: every attention layer keeps K and V for backward (one layer at a time
    under checkpointing). On the varlen kernel those are the packed keys of this rank's segments, at most
    cp + 1/2 times this rank's tokens (a document seen from both zigzag pieces has its keys twice); with the
    masked SDPA (no varlen kernel), the whole rows' K and V (cp times) and one [s, S] boolean mask for all."""
    q, c = run.q, run.p.compute
    layers = sum(not q.is_linear_attention(i) for i in range(q.num_layers)) if mode == "none" else 1
    kv_bytes = layers * 2 * c * q.num_kv_heads * q.head_dim
    if varlen:
        return int(tokens * (cp + 0.5) * kv_bytes)
    return int(tokens * cp * (kv_bytes + 1))


def report(cfg: Config, dims: ParallelDims, cuda: bool = True) -> str:
    est = estimate(cfg, dims, cuda)
    mesh = (f"world {dims.world_size} = dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x cp {dims.cp}; "
            f"ep {dims.ep}, efsdp {dims.efsdp}")
    where = "CUDA (bf16 autocast)" if cuda else "CPU"
    return (f"memory per rank, {where}; {mesh}; {cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens per "
            f"micro-batch, activation_checkpoint {cfg.parallelism.activation_checkpoint}\n{est.table()}")
