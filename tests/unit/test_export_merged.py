"""Merged export (runtime/export.py): transformers' logits on the merged HF checkpoint equal ours with the
adapter (fp32, CPU), for LoRA on attention + experts, on GDN projections, and on FP4-packed experts; the CLI
merges a trained run's checkpoint, checked against PEFT on the run's exported adapter."""

from __future__ import annotations

import pytest
import torch
import transformers
import yaml

from runtime.config import LoraConfig, config_from_dict
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.export import export_cli, merged_state_dict
from runtime.guard.run_dir import RunDirError
from runtime.lora import apply_lora
from runtime.models import build, from_pretrained, save_pretrained
from runtime.train import train
from tests.conftest import write_hf_checkpoint
from tests.dist.test_parity import EXAMPLE


def _randomize_b_(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)


def _assert_transformers_matches(model, folder, vocab: int = 320) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


CASES = {"moe": ("moe", ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]),
         "hybrid_gdn": ("qwen3_5_moe", ["in_proj_qkv", "out_proj", "q_proj", "experts"])}


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_on_the_merged_checkpoint_equals_ours_with_the_adapter(tmp_path, case):
    kind, targets = CASES[case]
    write_hf_checkpoint(tmp_path / "base", kind)
    ours = from_pretrained(tmp_path / "base", expert_backend="eager", norm_rope_impl="torch")
    apply_lora(ours, LoraConfig(enabled=True, rank=4, alpha=8, target_modules=targets))
    _randomize_b_(ours)
    save_pretrained(ours, tmp_path / "merged", state=merged_state_dict(ours))
    _assert_transformers_matches(ours, tmp_path / "merged")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8"])
def test_merged_quantized_experts_are_dequantized_base_plus_adapter(tmp_path, fmt):
    write_hf_checkpoint(tmp_path / "base", "moe")
    dense = from_pretrained(tmp_path / "base", expert_backend="eager")
    ours = build(dense.config, torch.float32, "cpu", path=tmp_path / "base", quant=fmt)
    apply_lora(ours, LoraConfig(enabled=True, rank=4, alpha=8, target_modules=["q_proj", "experts"]))
    _randomize_b_(ours)
    state = merged_state_dict(ours)
    experts = ours.moe_blocks()[0].experts
    lora_A, lora_B = experts.lora("down")
    expected = experts.dense_weight("down") + experts.lora_scaling * torch.bmm(lora_B, lora_A)
    assert torch.allclose(state["model.layers.0.mlp.experts.down"], expected, atol=1e-6)
    save_pretrained(ours, tmp_path / "merged", state=state)
    _assert_transformers_matches(ours, tmp_path / "merged")


def test_cli_merges_a_trained_run(tmp_path):
    """A LoRA run on a HF base (3 steps, checkpoint at the end, PEFT adapter exported), then
    `python -m runtime.export RUN --merged OUT`: transformers on OUT equals PEFT on base + the run's adapter."""
    from peft import PeftModel

    hf_base = write_hf_checkpoint(tmp_path / "base", "moe", vocab_size=520)
    run = tmp_path / "run"
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["model"] = {"path": str(tmp_path / "base"), "expert_backend": "grouped_mm"}
    cfg = config_from_dict(raw, {"data.seq_len": 64, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
                                 "train.max_steps": 3, "optim.lr": 1e-2, "train.output_dir": str(run),
                                 "logging.progress_bar": False, "lora.enabled": True, "lora.rank": 4,
                                 "checkpoint.export_hf": True}, base_dir=EXAMPLE.parent)
    train(cfg, DistEnv(0, 1, 0, torch.device("cpu")), ParallelDims(1, 1, 1, 1, 1))
    assert export_cli([str(run), "--merged", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(0, 520, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = hf_base(ids).logits  # before PEFT wraps (and changes) the base model in place
        peft_logits = PeftModel.from_pretrained(hf_base, run / "adapter").eval()(ids).logits
        assert (merged(ids).logits - peft_logits).abs().max().item() <= 1e-4
        assert (merged(ids).logits - base_logits).abs().max().item() > 1e-3  # training changed it


def test_cli_names_what_is_wrong(tmp_path):
    # main() reports through runtime.guard.failure_report (tests/unit/test_user_errors.py runs it as a user would)
    with pytest.raises(RunDirError, match="config.yaml"):
        export_cli([str(tmp_path), "--merged", str(tmp_path / "out")])
