"""The FLOP count behind MFU, checked against hand counts of small configs; the recompile count and its\nwarning, and metrics.jsonl carrying it."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters

import runtime.distributed.parallelize as parallelize_module
from runtime.distributed.compile import apply_compile
from runtime.launch import run
from runtime.models.hf import config_from_hf
from runtime.observe.metrics import RecompileCounter, flops_per_token
from tests.conftest import TINY_DENSE, TINY_HYBRID

ROOT = Path(__file__).resolve().parents[2]


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


def test_recompile_counter_counts_recompiles_and_warns_past_the_warmup(caplog):
    torch._dynamo.reset()
    counter = RecompileCounter()
    scale = torch.compile(lambda x, n: x * n, backend="eager", dynamic=False)  # every new n recompiles
    counts = []
    with caplog.at_level(logging.WARNING, logger="runtime"):
        for step, n in enumerate([2, 3, 3, 3, 3, 4], start=1):
            scale(torch.ones(2), n)
            counts.append(counter.after_step(step))
    counter.close()
    assert counts == [0, 1, 1, 1, 1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # step 2's recompile falls in the warm-up; step 6's is named with dynamo's reason (the guard on n)
    assert len(warnings) == 1 and warnings[0].startswith("step 6 recompiled"), warnings
    assert "<lambda> (" in warnings[0] and "failed guard 0/1: n == 3." in warnings[0], warnings[0]


HYBRID_RUN = """
model:
  config:
    model_type: qwen3_5_moe_text
    vocab_size: 520
    hidden_size: 64
    num_hidden_layers: 2
    layer_types: [linear_attention, full_attention]
    num_attention_heads: 4
    num_key_value_heads: 2
    head_dim: 16
    moe_intermediate_size: 32
    shared_expert_intermediate_size: 48
    num_experts: 8
    num_experts_per_tok: 2
    linear_num_key_heads: 2
    linear_num_value_heads: 4
    linear_key_head_dim: 16
    linear_value_head_dim: 16
    linear_conv_kernel_dim: 4
    max_position_embeddings: 256
  dtype: bfloat16
  expert_backend: grouped_mm
  norm_rope_impl: torch
data:
  path: {root}/examples/tiny/data/train.jsonl
  tokenizer: {root}/examples/tiny/tokenizer
  seq_len: 64
train:
  max_steps: 6
  micro_batch_size: 2
compile:
  enabled: true
checkpoint:
  save_final: false
logging:
  progress_bar: false
"""


def test_metrics_carry_recompiles_of_a_compiled_run(tmp_path, monkeypatch):
    """A compiled hybrid model trained on the packed chat data (documents per row change every step):
    every metrics.jsonl record carries the recompile count, which stays at the first step's one (GDN and
    attention blocks share DecoderBlock.forward: the second kind is a recompile)."""
    # aot_eager traces what inductor would without C++ codegen on the CPU
    monkeypatch.setattr(parallelize_module, "apply_compile", functools.partial(apply_compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    config = tmp_path / "hybrid.yaml"
    config.write_text(HYBRID_RUN.format(root=ROOT))
    records = run([str(config), "--output-dir", str(tmp_path / "run")])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["recompiles"] for r in logged] == [r["recompiles"] for r in records] == [1] * 6, logged
    assert counters["stats"]["unique_graphs"] == 2
