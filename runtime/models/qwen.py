"""Qwen3 / Qwen3-MoE and the hybrid Qwen3.5 / Qwen3.5-MoE / Qwen3-Next decoders, assembled from
`attention/` and `moe/` layers. Hybrid models interleave Gated DeltaNet (`linear_attn`) and gated
attention (`self_attn`) blocks by `layer_types`, use (1 + w) RMSNorms, and add a sigmoid-gated
shared expert to every MoE block.

Module names follow the HF checkpoints (model.layers.{i}.self_attn.q_proj, ...mlp.gate, ...) so the
checkpoint mapping in `hf.py` is a rename of the expert tensors only.

    logits_BSV = model(input_ids_BS, position_ids_BS=None, cu_seqlens=None, max_seqlen=None)
    loss_sum = model(input_ids_BS, ..., labels=labels_BS)   # fused lm_head + cross-entropy (runtime.loss)
position_ids restart at 0 at every packed document start; no token attends across documents.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from attention.attention import (
    AttnMeta,
    Qwen3Attention,
    build_attn_meta,
    cu_seqlens_from_position_ids,
)
from attention.context_parallel import CPShard
from attention.gdn import GatedDeltaNet, GatedRMSNorm
from attention.norm import RMSNorm
from attention.rope import RopeConfig, RotaryEmbedding
from moe.dispatch import build_dispatcher
from moe.experts import PROJECTIONS, GroupedExperts
from moe.layer import MoEBlock, SwiGLUMLP
from moe.router import SoftmaxTopKRouter
from runtime.choices import resolve_model_choices
from runtime.loss import LOSS_IMPLS, linear_cross_entropy_sum


@dataclass(frozen=True)
class GDNConfig:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    layout: str  # "qwen3_5" | "qwen3_next": the projections' key layout


@dataclass
class QwenConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02
    # MoE (num_experts == 0: dense Qwen3)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Hybrid models (Qwen3.5, Qwen3-Next); `layer_types` empty means every block is full attention.
    layer_types: tuple[str, ...] = ()
    gated_attention: bool = False
    norm_unit_offset: bool = False
    shared_expert_intermediate_size: int = 0
    gdn: GDNConfig | None = None
    # Runtime choices, not part of the HF config: "auto" is resolved once (runtime.plan) before the layers are
    # built, which receive concrete names
    expert_backend: str = "auto"
    attn_backend: str = "auto"
    norm_rope_impl: str = "auto"
    loss_impl: str = "auto"  # runtime.loss: the fused lm_head + cross-entropy used when labels are given
    gdn_op_set: str = "auto"
    router_aux_loss_coef: float = 0.0
    router_force_balanced: bool = False  # benchmarks: every expert gets the same slot count (moe.router)
    router_bias_update_rate: float = 0.0  # aux-loss-free balancing (moe.router); 0: off
    # The HF config.json this came from, written back by save_pretrained.
    hf_config: dict = field(default_factory=dict, repr=False)

    def is_linear_attention(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


def build_mlp(cfg: QwenConfig, layer: int, device=None, dtype=None) -> nn.Module:
    if not cfg.is_moe_layer(layer):
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, device=device, dtype=dtype)
    router = SoftmaxTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                               cfg.router_aux_loss_coef, force_balanced=cfg.router_force_balanced,
                               bias_update_rate=cfg.router_bias_update_rate, device=device, dtype=dtype)
    experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                             device=device, dtype=dtype)
    shared, shared_gate = None, None
    if cfg.shared_expert_intermediate_size:
        shared = SwiGLUMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, device=device, dtype=dtype)
        shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False, device=device, dtype=dtype)
    # Built single-process: every expert local; runtime.distributed wires the EP dispatcher.
    dispatcher = build_dispatcher("local", None, cfg.num_experts)
    return MoEBlock(router, experts, dispatcher, backend=cfg.expert_backend, shared_expert=shared,
                    shared_expert_gate=shared_gate)


def build_token_mixer(cfg: QwenConfig, layer: int, rotary_dim: int, device=None, dtype=None) -> tuple[str, nn.Module]:
    """(HF module name, module): Gated DeltaNet for linear-attention layers, else (gated) attention."""
    factory = {"device": device, "dtype": dtype}
    if cfg.is_linear_attention(layer):
        g = cfg.gdn
        return "linear_attn", GatedDeltaNet(cfg.hidden_size, g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim,
                                            g.conv_kernel, cfg.rms_norm_eps, layout=g.layout, op_set=cfg.gdn_op_set,
                                            **factory)
    return "self_attn", Qwen3Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       cfg.rms_norm_eps, cfg.attention_bias, cfg.attn_backend, cfg.norm_rope_impl,
                                       gated=cfg.gated_attention, rotary_dim=rotary_dim, **factory)


class DecoderBlock(nn.Module):
    def __init__(self, cfg: QwenConfig, layer: int, rotary_dim: int, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        norm = dict(eps=cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset, **factory)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.mixer_name, mixer = build_token_mixer(cfg, layer, rotary_dim, **factory)
        self.add_module(self.mixer_name, mixer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.mlp = build_mlp(cfg, layer, **factory)
        # Set by runtime.distributed.activation_checkpoint: (fn, *args) -> fn(*args) recomputed.
        self.checkpoint_fn = None

    def forward(self, h_BSH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        if self.checkpoint_fn is not None:
            return self.checkpoint_fn(self._forward, h_BSH, cos, sin, meta)
        return self._forward(h_BSH, cos, sin, meta)

    def _forward(self, h_BSH, cos, sin, meta):
        h_BSH, x_BSH = self.mix(h_BSH, cos, sin, meta)
        return h_BSH + self.mlp(x_BSH)

    def mix(self, h_BSH, cos, sin, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The token-mixing half: the residual stream h + mixer(norm(h)) and the MLP's normed input.
        A method of its own so that the runtime can compile it apart from an MoE block whose token
        exchange cannot be traced (runtime.distributed.compile)."""
        x_BSH = self.input_layernorm(h_BSH)
        if self.mixer_name == "linear_attn":
            h_BSH = h_BSH + self.linear_attn(x_BSH, meta)
        else:
            h_BSH = h_BSH + self.self_attn(x_BSH, cos, sin, meta)
        return h_BSH, self.post_attention_layernorm(h_BSH)


class QwenModel(nn.Module):
    def __init__(self, cfg: QwenConfig, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim, device=device)
        rotary_dim = self.rotary_emb.rotary_dim
        # A ModuleDict keyed by layer index keeps FQNs stable when layers are dropped or reordered.
        self.layers = nn.ModuleDict({str(i): DecoderBlock(cfg, i, rotary_dim, device, dtype)
                                     for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset, device=device,
                            dtype=dtype)


class QwenForCausalLM(nn.Module):
    def __init__(self, cfg: QwenConfig, device=None, dtype=None):
        super().__init__()
        # "auto" left in cfg (a model built without a plan) is resolved once, here, for `device`
        cfg = resolve_model_choices(cfg, device)
        LOSS_IMPLS.get(cfg.loss_impl)  # imported now, outside any compiled region
        self.config = cfg
        self.model = QwenModel(cfg, device, dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # runtime.distributed.context_parallel.ContextParallel when cp > 1 (set by parallelize): the trainer
        # splits each batch along the sequence with it
        self.context_parallel = None
        # runtime.distributed.replicate.ReplicatedGrads where parallelize keeps every trainable parameter whole on
        # every rank without FSDP: the trainer sums their gradients over the ranks with it after backward
        self.replicated_grads = None

    def hidden_states(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                      cp: CPShard | None = None) -> torch.Tensor:
        B, S = input_ids_BS.shape
        h_BSH = self.model.embed_tokens(input_ids_BS)
        if cp is not None:  # this rank's share of the rows; the mixers read the whole rows' metadata in cp
            meta = AttnMeta(cp=cp)
        else:
            if position_ids_BS is not None and cu_seqlens is None and self.config.layer_types:
                # GDN layers need document boundaries; the collator passes them, direct calls may not.
                cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(position_ids_BS)
            meta = build_attn_meta(position_ids_BS, cu_seqlens, max_seqlen, self.config.attn_backend)
        if position_ids_BS is None:
            position_ids_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
        cos, sin = self.model.rotary_emb(position_ids_BS, h_BSH.dtype)
        for block in self.model.layers.values():
            h_BSH = block(h_BSH, cos, sin, meta)
        return self.model.norm(h_BSH)

    def forward(self, input_ids_BS: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                labels: torch.Tensor | None = None, cp: CPShard | None = None,
                num_labels: int | None = None) -> torch.Tensor:
        """Logits [B, S, V]; with `labels` [B, S], the summed cross-entropy over label tokens instead,
        computed by runtime.loss without [B, S, V] logits (inside forward, so FSDP has gathered lm_head);
        `num_labels`, the count of label tokens (or a bound above it) where the caller knows it, spares the loss a
        host sync (runtime.loss).
        With `cp` (context parallelism) every tensor holds this rank's tokens of the rows (CPShard.take)."""
        h_BSH = self.hidden_states(input_ids_BS, position_ids, cu_seqlens, max_seqlen, cp)
        if labels is None:
            return self.lm_head(h_BSH)
        return linear_cross_entropy_sum(h_BSH.flatten(0, 1), self.lm_head.weight, labels.flatten(),
                                        self.config.loss_impl, num_labels)

    def moe_blocks(self) -> list[MoEBlock]:
        """The decoder layers' MoE blocks (a layer's mlp; the training step asks every step, so not a walk of
        every module)."""
        return [layer.mlp for layer in self.model.layers.values() if isinstance(layer.mlp, MoEBlock)]


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one named tensor (crc32 would collide among ~10^4 expert tensors)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def init_weights(model: QwenForCausalLM, seed: int = 0) -> None:
    """Random init as transformers does it (normal(0, initializer_range) for matrices, ones for norms,
    the GDN decay init), each tensor drawn from a generator keyed by (seed, its name) on its own
    device, each expert from one keyed by (seed, name, global expert index). So the values do not
    depend on init order or on the EP split: an EP rank's experts equal the single-process model's
    experts at those indices, and no rank draws experts it does not hold. (CPU and CUDA generators
    differ: the values depend on the device type.) Quantized experts get the quantized values of the
    same draw, one projection of one layer at a time."""
    std = model.config.initializer_range
    gen = None
    for fqn, param in model.named_parameters():
        owner_name, _, name = fqn.rpartition(".")
        owner = model.get_submodule(owner_name)
        if gen is None:
            gen = torch.Generator(param.device)
        if isinstance(owner, GroupedExperts):
            _init_experts(owner, name, fqn, param, gen, seed, std)
        else:
            gen.manual_seed(param_seed(seed, fqn))
            _init_param(owner, name, param, gen, std)
    for prefix, owner in model.named_modules():
        if isinstance(owner, GroupedExperts) and owner.is_quantized:
            for name in PROJECTIONS:
                packed = owner.base_weight(name)
                dense = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
                _init_experts(owner, name, f"{prefix}.{name}", dense, gen, seed, std)
                packed.fill_(dense)
                del dense


def _init_experts(owner: GroupedExperts, name: str, fqn: str, t: torch.Tensor, gen: torch.Generator, seed: int,
                  std: float) -> None:
    for j in range(t.shape[0]):
        gen.manual_seed(param_seed(seed, f"{fqn}/{owner.expert_offset + j}"))
        _init_param(owner, name, t[j], gen, std)


def _init_param(owner: nn.Module, name: str, t: torch.Tensor, gen: torch.Generator, std: float) -> None:
    if isinstance(owner, (nn.Linear, nn.Embedding, SoftmaxTopKRouter)) and name == "weight" or isinstance(owner, GroupedExperts) and name in ("gate_up", "down"):
        t.normal_(0.0, std, generator=gen)
    elif name == "bias" and isinstance(owner, nn.Linear):
        t.zero_()
    elif isinstance(owner, RMSNorm):
        t.fill_(0.0 if owner.unit_offset else 1.0)  # (1 + w) norms start at w = 0
    elif isinstance(owner, GatedRMSNorm):
        t.fill_(1.0)
    elif isinstance(owner, nn.Conv1d):
        # nn.Conv1d's own default (kaiming-uniform, a=sqrt(5)): U(+-1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(owner.in_channels // owner.groups * owner.kernel_size[0])
        t.uniform_(-bound, bound, generator=gen)
    elif isinstance(owner, GatedDeltaNet) and name == "dt_bias":
        t.fill_(1.0)
    elif isinstance(owner, GatedDeltaNet) and name == "A_log":
        # HF: A = exp(A_log) ~ U(0.01, 16), drawn in fp32.
        t.copy_(torch.empty(t.shape, device=t.device).uniform_(0.01, 16, generator=gen).log())
    else:
        raise TypeError(f"init_weights has no rule for {type(owner).__name__}.{name}")
