"""GPU: our model vs transformers in bf16, and real Qwen3-30B-A3B dimensions training (fp32 masters,
bf16 autocast, one GPU) with the grouped_mm and scattermoe expert backends, full and LoRA.

bf16 tolerance: our bf16 error against the fp32 transformers model may be at most twice transformers'
own bf16 error against it (plus 1e-3): the same rounding budget, whatever order the ops run in.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from runtime.models import from_pretrained
from tests.conftest import write_hf_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]

QWEN3_30B_A3B_2L = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 2,
                        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("backend", ["eager", "grouped_mm", "scattermoe"])
def test_bf16_parity_with_transformers(tmp_path, kind, backend):
    hf32 = write_hf_checkpoint(tmp_path, kind).cuda()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    ours = from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda", expert_backend=backend)
    ids = torch.randint(0, 320, (2, 256), device="cuda")
    ref = hf32(ids).logits
    hf_logits, our_logits = hf16(ids).logits, ours(ids)
    budget = 2 * _rel(hf_logits, ref) + 1e-3
    assert _rel(our_logits, ref) <= budget
    w = torch.randn_like(ref)
    for m, out in ((hf32, ref), (hf16, hf_logits), (ours, our_logits)):
        (out.float() * w).sum().backward()
    hf32_params, hf16_params = dict(hf32.named_parameters()), dict(hf16.named_parameters())
    for fqn, p in ours.named_parameters():
        name = fqn.replace("experts.gate_up", "experts.gate_up_proj").replace("experts.down", "experts.down_proj")
        g32, g16 = hf32_params[name].grad, hf16_params[name].grad
        assert _rel(p.grad, g32) <= 2 * _rel(g16, g32) + 1e-3, fqn


@pytest.mark.parametrize("backend,lora", [("grouped_mm", False), ("scattermoe", False), ("scattermoe", True)])
def test_real_dims_training_step(tmp_path, capsys, backend, lora):
    from runtime.config import config_from_dict
    from runtime.distributed.mesh import ParallelDims
    from runtime.distributed.process_group import DistEnv
    from runtime.train import train

    raw = yaml.safe_load((ROOT / "examples" / "tiny-qwen3-moe.yaml").read_text())
    raw["model"] = {"config": QWEN3_30B_A3B_2L, "dtype": "float32", "expert_backend": backend}
    if lora:
        raw["lora"] = {"enabled": True, "rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj", "experts"]}
    raw["data"].update(path=str(ROOT / "examples/tiny/data/train.jsonl"), tokenizer=str(ROOT / "examples/tiny/tokenizer"),
                       seq_len=4096)
    raw["train"].update(max_steps=3, micro_batch_size=1, output_dir=str(tmp_path))
    raw["optim"]["warmup_steps"] = 0
    raw["checkpoint"] = {"save_final": False}
    raw["logging"] = {"progress_bar": False}
    cfg = config_from_dict(raw)
    records = train(cfg, DistEnv(0, 1, 0, torch.device("cuda")), ParallelDims(1, 1, 1, 1, 1))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    with capsys.disabled():
        for r in records:
            print(f"\nreal-dims 2-layer {backend} lora={lora} step {r['step']}: loss {r['loss']:.4f} tok/s {r['tok_s']:.0f} "
                  f"mfu {r.get('mfu', 0):.3f} peak {r.get('peak_mem_gib', 0):.1f} GiB")
