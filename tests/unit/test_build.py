"""The one build path: every EP slice of the seeded init equals the single-process init, an EP rank
draws only its own experts, and the load path reads this rank's slice of a checkpoint."""

from __future__ import annotations

import pytest
import torch

from moe.experts import GroupedExperts
from runtime.models import build, from_pretrained, qwen
from runtime.models.hf import config_from_hf
from tests.conftest import TINY_DENSE, TINY_HYBRID, TINY_MOE

CONFIGS = {
    "moe": {**TINY_MOE, "model_type": "qwen3_moe"},
    "hybrid_moe": {**TINY_HYBRID, "model_type": "qwen3_5_moe_text",
                   "layer_types": ["linear_attention", "full_attention"] * 2},
    "next": {**TINY_HYBRID, "model_type": "qwen3_next", "norm_topk_prob": True,
             "layer_types": ["linear_attention", "full_attention"] * 2},
}


def _cfg(name: str):
    return config_from_hf(dict(CONFIGS[name]), expert_backend="eager")


def _expert_owner(model, fqn: str):
    return model.get_submodule(fqn.rpartition(".")[0])


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("ep", [2, 4])
def test_every_ep_slice_equals_the_single_process_init(name, ep):
    cfg = _cfg(name)
    full = dict(build(cfg, torch.float32, "cpu", seed=7).named_parameters())
    for ep_rank in range(ep):
        part = build(cfg, torch.float32, "cpu", seed=7, ep_rank=ep_rank, ep=ep)
        params = dict(part.named_parameters())
        assert params.keys() == full.keys()
        for fqn, p in params.items():
            owner = _expert_owner(part, fqn)
            if isinstance(owner, GroupedExperts):
                lo = owner.expert_offset
                assert (lo, owner.num_experts) == (ep_rank * cfg.num_experts // ep, cfg.num_experts // ep)
                assert torch.equal(p, full[fqn][lo:lo + owner.num_experts]), fqn
            else:
                assert torch.equal(p, full[fqn]), fqn


def test_an_ep_rank_draws_only_its_experts(monkeypatch):
    cfg = _cfg("moe")
    drawn = []
    real = qwen._init_param

    def spy(owner, name, t, gen, std):
        if isinstance(owner, GroupedExperts):
            drawn.append(t.shape)
        real(owner, name, t, gen, std)
    monkeypatch.setattr(qwen, "_init_param", spy)
    build(cfg, torch.float32, "cpu", ep_rank=1, ep=4)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    # one draw of one expert's matrix per local expert, gate_up and down
    assert len(drawn) == moe_layers * 2 * cfg.num_experts // 4
    assert all(len(shape) == 2 for shape in drawn)


def test_seeded_init_is_transformers_like_and_seed_dependent():
    cfg = _cfg("hybrid_moe")
    a = build(cfg, torch.float32, "cpu", seed=0)
    b = build(cfg, torch.float32, "cpu", seed=0)
    c = build(cfg, torch.float32, "cpu", seed=1)
    for (fqn, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), fqn
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), fqn
    experts = a.moe_blocks()[0].experts
    assert abs(experts.gate_up.std().item() - cfg.initializer_range) < 2e-3
    assert not torch.equal(experts.gate_up[0], experts.gate_up[1])  # experts are distinct draws
    assert torch.all(a.model.layers["1"].self_attn.q_norm.weight == 0)  # (1 + w) norm
    gdn = a.model.layers["0"].linear_attn
    assert torch.all(gdn.dt_bias == 1) and torch.all((gdn.A_log.exp() >= 0.01 - 1e-6) & (gdn.A_log.exp() <= 16))
    assert all(not p.is_meta for p in a.parameters()) and not a.model.rotary_emb.inv_freq.is_meta


def test_tied_embeddings_stay_tied():
    cfg = config_from_hf({**TINY_DENSE, "model_type": "qwen3", "tie_word_embeddings": True})
    model = build(cfg, torch.bfloat16, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_load_path_reads_this_ranks_experts(tiny_moe_ckpt):
    full = from_pretrained(tiny_moe_ckpt, expert_backend="eager")
    part = build(full.config, torch.float32, "cpu", path=tiny_moe_ckpt, ep_rank=1, ep=2)
    for fb, pb in zip(full.moe_blocks(), part.moe_blocks()):
        assert pb.experts.expert_offset == 4
        assert torch.equal(pb.experts.gate_up, fb.experts.gate_up[4:])
    assert torch.equal(part.model.embed_tokens.weight, full.model.embed_tokens.weight)
