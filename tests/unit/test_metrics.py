"""The FLOP count behind MFU, checked against hand counts of small configs."""

from __future__ import annotations

from runtime.models.hf import config_from_hf
from runtime.observe.metrics import flops_per_token
from tests.conftest import TINY_DENSE, TINY_HYBRID


def test_dense_flops_by_hand():
    cfg = config_from_hf({**TINY_DENSE, "model_type": "qwen3"})
    H, D, S = 64, 16, 128
    attn = H * (4 * D + 2 * 2 * D) + 4 * D * H
    per_layer = 6 * (attn + 3 * H * 96) + 3 * 2 * 2 * 4 * D * S / 2
    assert flops_per_token(cfg, S) == 2 * per_layer + 6 * H * 320


def test_hybrid_counts_gdn_layers_without_quadratic_attention():
    cfg = config_from_hf({**TINY_HYBRID, "model_type": "qwen3_5_moe_text",
                          "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    short, long = flops_per_token(cfg, 128), flops_per_token(cfg, 256)
    # only the one full-attention block grows with the sequence: 3*2*2*heads*D*(dS/2)
    assert long - short == 3 * 2 * 2 * 4 * 16 * 128 / 2
    H = 64
    moe = 3 * H * 32 * 2 + H * 8 + 3 * H * 48 + H
    gdn = H * (2 * 32 + 2 * 64 + 2 * 4) + 64 * H
    gated_attn = H * (4 * 16 * 2 + 2 * 2 * 16) + 4 * 16 * H
    expected = (6 * (H * 320 + 3 * (gdn + moe) + gated_attn + moe) + 3 * 3 * 2 * 2 * 4 * 16 * 16
                + 3 * 2 * 2 * 4 * 16 * 128 / 2)
    assert short == expected
