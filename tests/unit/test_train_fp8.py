"""quant.train_fp8 (full fine-tune GEMMs in FP8) on the CPU: the grouped_mm backend's FP8 expert GEMMs against
the eager backend in fp32 (within FP8's error, and visibly FP8), what runtime.float8 converts, and a training
run of the tiny example against the same run without FP8."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from moe.backends import expert_backend
from moe.experts import GroupedExperts
from runtime.config import ConfigError, load_config
from runtime.float8 import apply_fp8_training
from runtime.launch import run
from runtime.models import build
from runtime.models.hf import config_from_hf
from runtime.models.qwen import QwenForCausalLM
from runtime.plan import plan
from tests.conftest import TINY_MOE, sentinel_routing

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"
FP8_REL = 0.08  # e4m3's error over a GEMM (tests/unit/test_quant_fp8.py)
DENSE_GRAD_REL = 0.25  # e5m2 output gradients of torchao's tensorwise recipe


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


def _one_layer_config(**dims):
    return config_from_hf({**TINY_MOE, "model_type": "qwen3_moe", "num_hidden_layers": 1, **dims},
                          expert_backend="grouped_mm")


# Qwen3-30B-A3B's attention and expert dims (one layer, 8 experts, a small vocab): what experts+dense converts
QWEN3_30B_LAYER = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                   "moe_intermediate_size": 768, "vocab_size": 512}


def test_what_fp8_training_converts_at_qwen3_30b_dims():
    """experts+dense: the experts, and the dense linears torchao expects FP8 to speed up (q_proj 2048 -> 4096,
    o_proj 4096 -> 2048; not the 512-wide k_proj, v_proj), so q, k, v no longer fuse; never the lm_head;
    experts: no dense linear."""
    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        model = QwenForCausalLM(_one_layer_config(**QWEN3_30B_LAYER), dtype=torch.bfloat16)
    apply_fp8_training(model, "experts+dense")
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"}
    assert model.model.layers["0"].self_attn.fuse_qkv is False  # the FP8 q_proj runs its own GEMM
    assert all(m.fp8_training for m in model.modules() if isinstance(m, GroupedExperts))
    experts_only = build(_one_layer_config(), torch.float32, "cpu", seed=0)
    apply_fp8_training(experts_only, "experts")
    assert not any(isinstance(m, Float8Linear) for m in experts_only.modules())
    assert experts_only.model.layers["0"].self_attn.fuse_qkv is True


def test_converted_dense_linears_train_within_fp8_error():
    """One layer with a q_proj wide enough to convert (65 heads of 16: 1040 outputs; torchao's CPU FP8 GEMM is
    slow, so the other dims stay tiny): the logits within FP8 error of
    the unconverted model's and visibly FP8; q_proj's weight gradient and the whole gradient's norm close to
    theirs. Tensorwise quantizes output gradients to e5m2 (2 mantissa bits), hence DENSE_GRAD_REL; single
    gradients downstream of the top-k choice (the router's) move more, as any perturbation moves them: the
    training curves are the real check (benchmarks/gpu_fp8.sh accuracy)."""
    from torchao.float8.float8_linear import Float8Linear

    plain = build(_one_layer_config(num_attention_heads=65, num_key_value_heads=5, head_dim=16), torch.float32, "cpu",
                  seed=0)
    fp8 = copy.deepcopy(plain)
    apply_fp8_training(fp8, "experts+dense")
    assert isinstance(fp8.model.layers["0"].self_attn.q_proj, Float8Linear)
    ids = torch.randint(0, plain.config.vocab_size, (2, 32))
    outs = []
    for model in (plain, fp8):
        logits = model(ids)
        logits.square().mean().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (ref, ref_grads), (got, grads) = outs
    assert 1e-4 < _rel(got, ref) <= FP8_REL
    assert grads.keys() == ref_grads.keys()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert _rel(grads[q], ref_grads[q]) <= DENSE_GRAD_REL

    def norm(g):
        return torch.cat([t.flatten() for t in g.values()]).norm()
    assert abs(norm(grads) / norm(ref_grads) - 1) <= FP8_REL


def test_fp8_training_follows_the_bf16_free_run_and_refuses_lora():
    """Six steps of the tiny example (fp32 model) with quant.train_fp8 experts+dense (its FP8 expert GEMMs: no
    dense linear of the tiny dims passes torchao's filter) stay within 1% of the run without, step by step; LoRA with train_fp8 is one ConfigError naming the key for an FP8 base, and so is
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
    with pytest.raises(ConfigError, match=r"^model.expert_backend: .* in eager mode only, but compile.enabled is true"):
        plan(cfg, world=1, device="cpu")
