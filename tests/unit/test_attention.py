"""Our attention layers vs transformers' on the same weights (fp32): Qwen3 and the gated
Qwen3-Next attention (partial rotary, (1+w) q/k norms, sigmoid output gate), forward and grads."""

from __future__ import annotations

import pytest
import torch

from attention.attention import AttnMeta, Qwen3Attention
from attention.rope import RopeConfig, RotaryEmbedding
from tests.conftest import perturb_


def _hf_layer(kind: str):
    if kind == "qwen3":
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention as HF
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Rot

        cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention as HF
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding as Rot

        cfg = Qwen3NextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              partial_rotary_factor=0.25)
    cfg._attn_implementation = "sdpa"
    return cfg, HF(cfg, layer_idx=0), Rot(cfg)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next"])
def test_attention_matches_transformers(kind):
    cfg, hf, hf_rope = _hf_layer(kind)
    perturb_(hf, seed=1)
    gated = kind == "qwen3_next"
    rope = RopeConfig(theta=cfg.rope_parameters["rope_theta"],
                      partial_rotary_factor=cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    rotary = RotaryEmbedding(rope, 16)
    ours = Qwen3Attention(64, 4, 2, 16, cfg.rms_norm_eps, gated=gated, rotary_dim=rotary.rotary_dim,
                          norm_rope_impl="torch")
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 10, 64, requires_grad=True)
    pos = torch.arange(10).expand(2, 10)
    cos, sin = rotary(pos, x.dtype)
    hf_cos, hf_sin = hf_rope(x, pos)
    assert torch.allclose(cos, hf_cos, atol=1e-6)
    mask = torch.ones(10, 10, dtype=torch.bool).tril().expand(2, 1, 10, 10)
    ref = hf(x, (hf_cos, hf_sin), attention_mask=mask)[0]
    out = ours(x, cos, sin, AttnMeta())
    assert (out - ref).abs().max() <= 1e-5
    g = torch.randn_like(out)
    ref_grads = torch.autograd.grad((ref * g).sum(), [x, *hf.parameters()])
    our_grads = torch.autograd.grad((out * g).sum(), [x, *ours.parameters()])
    for a, b in zip(our_grads, ref_grads):
        assert (a - b).norm() / b.norm() <= 1e-5
