"""quant.train_fp8 (full fine-tune GEMMs in FP8) on the CPU: the grouped_mm backend's FP8 expert GEMMs against
the eager backend in fp32 (within FP8's error, and visibly FP8), what runtime.float8 converts, and a training
run of the tiny example against the same run without FP8."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from runtime.config import ConfigError, load_config
from runtime.float8 import apply_fp8_training
from runtime.launch import run
from runtime.models import build
from runtime.models.hf import config_from_hf
from runtime.plan import plan
from tests.conftest import TINY_MOE, sentinel_routing

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"
FP8_REL = 0.08  # e4m3's error over a GEMM (tests/unit/test_quant_fp8.py)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def test_grouped_mm_trains_the_experts_in_fp8_within_fp8_error_of_fp32():
    torch.manual_seed(0)
    fp8 = GroupedExperts(4, 64, 32)
    ref = copy.deepcopy(fp8)
    fp8.fp8_training = True
    M, k = 24, 2
    x, ids, w = sentinel_routing(M, k, 64)
    y = expert_backend("grouped_mm")(x, ids, w, fp8)
    y_ref = expert_backend("eager")(x, ids, w, ref)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, w, fp8.gate_up, fp8.down], dy)
    grads_ref = torch.autograd.grad(y_ref, [x, w, ref.gate_up, ref.down], dy)
    assert 1e-4 < _rel(y, y_ref) <= FP8_REL  # FP8 ran, and close to fp32
    for g, g_ref in zip(grads, grads_ref):
        assert _rel(g, g_ref) <= FP8_REL
    assert not grads[2][3].any() and not grads[3][3].any()  # the expert without tokens gets no gradient


def test_experts_and_dense_linears_that_fp8_converts():
    from torchao.float8.float8_linear import Float8Linear

    model = build(config_from_hf({**TINY_MOE, "model_type": "qwen3_moe"}, expert_backend="grouped_mm"),
                  torch.float32, "cpu", seed=0)
    names = {n: type(m) for n, m in model.named_modules()}
    apply_fp8_training(model, "experts+dense")
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {n for n, t in names.items() if t is nn.Linear and n.startswith("model.layers.")
                         and not n.endswith("shared_expert_gate")}  # attention, shared expert MLPs, not the 1-wide gate
    assert "lm_head" not in converted and converted
    assert all(m.fp8_training for m in model.modules() if isinstance(m, GroupedExperts))
    experts_only = build(model.config, torch.float32, "cpu", seed=0)
    apply_fp8_training(experts_only, "experts")
    assert not any(isinstance(m, Float8Linear) for m in experts_only.modules())


def test_fp8_training_follows_the_bf16_free_run_and_refuses_lora():
    """Six steps of the tiny example (fp32 model) with FP8 expert and dense GEMMs stay within 1% of the run
    without them, step by step; LoRA with train_fp8 is one ConfigError naming the key for an FP8 base, and so is
    a compile on the CPU."""
    def losses(mode: str, out: str) -> list[float]:
        records = run([str(EXAMPLE), "--max-steps", "6", "--output-dir", out, "--set", f"quant.train_fp8={mode}",
                       "--set", "logging.progress_bar=false", "--set", "checkpoint.every_n_steps=0"])
        return [r["loss"] for r in records]

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        plain, fp8 = losses("none", f"{tmp}/plain"), losses("experts+dense", f"{tmp}/fp8")
    assert fp8 != plain and fp8[-1] < fp8[0]
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(fp8, plain)), (fp8, plain)
    cfg = load_config(EXAMPLE, {"quant.train_fp8": "experts", "lora.enabled": True})
    with pytest.raises(ConfigError, match=r"^quant.train_fp8: experts trains .* set quant.base_weights: fp8"):
        plan(cfg, world=1, device="cpu")
    cfg = load_config(EXAMPLE, {"quant.train_fp8": "experts", "compile.enabled": True, "model.dtype": "bfloat16"})
    with pytest.raises(ConfigError, match=r"^quant.train_fp8: experts does not compile on the CPU"):
        plan(cfg, world=1, device="cpu")
