"""benchmarks/bench_e2e.py: the --dry run works end to end (both sides, each in its own process), and both
sides are built as the bench says: the baseline's PEFT targets and dtypes, our Config from the flags."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from benchmarks.baselines.transformers_model import TARGET_MODULES, transformers_model
from benchmarks.bench_e2e import PRESETS, our_config, parse_args, qwen3_5_moe_config, qwen3_moe_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.models.factory import build_model
from tests.conftest import Ahead, lane_environ
from tests.unit.test_peers import check_table_of_a_real_dry_run

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(tmp: Path):
    """`python -m benchmarks.bench_e2e --dry` as a user runs it: (its run, its output folder)."""
    env = lane_environ()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_e2e", "--dry", "--tag", "t", "--out", str(tmp)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300, check=False)
    return done, tmp


# CI time: the bench (its parent and each side a fresh Python) runs beside the in-process tests.
DRY_RUN = Ahead(_dry_run)


@pytest.mark.slow
@pytest.mark.ahead(DRY_RUN)
def test_dry_run_end_to_end(tmp_path):
    """The bench's command (`python -m benchmarks.bench_e2e --dry`), each side in a fresh process, as the bench
    starts it."""
    done, out = DRY_RUN.result()
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 0, stderr[-3000:]
    assert "ratio ours/baseline tokens/s = " in stdout
    rows = json.loads((out / "bench_e2e_t.json").read_text())["rows"]
    assert [r["side"] for r in rows] == ["ours", "baseline"]
    for r in rows:
        assert "error" not in r, r["error"]
        assert r["tok_s"] > 0 and len(r["times_ms"]) == 2
        assert abs(r["loss1"] - math.log(1024)) < 0.2  # random init on random ids: ~ln(vocab)
    # The same ids and the same mean next-token cross-entropy on both sides (the inits differ).
    assert abs(rows[0]["loss1"] - rows[1]["loss1"]) < 0.1
    assert "sdpa grouped_mm" in rows[1]["note"] and "peft" in rows[1]["note"]
    check_table_of_a_real_dry_run(out / "bench_e2e_t.json", tmp_path)  # issue 43's peers table, on this run


def _trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_baseline_lora_targets_and_dtypes(preset):
    hf = PRESETS[preset](4, tiny=True)
    model, note = transformers_model(hf, "cpu", "lora", torch.bfloat16)
    assert "peft" in note and ("gdn" in note) == (preset == "qwen3.5-35b-a3b")
    trained = _trainable(model)
    assert trained and all(p.dtype == torch.float32 and "lora_" in n for n, p in trained.items())
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "lora_" not in n)
    for layer, kind in enumerate(hf.get("layer_types", ["full_attention"] * 4)):
        names = [n for n in trained if f".layers.{layer}." in n]
        # PEFT nests the two expert ParamWrappers: gate_up's factors sit one base_layer deeper.
        assert any(".mlp.experts.base_layer.lora_A" in n for n in names)
        assert any(".mlp.experts.lora_A" in n for n in names)
        assert all(any(f".self_attn.{t}.lora_A" in n for n in names) for t in TARGET_MODULES) == (kind == "full_attention")
    # The same adapters as ours: same count of trained parameters.
    cfg = our_config(parse_args(["--dry", "--preset", preset]), hf)
    ours = build_model(cfg, DistEnv(0, 1, 0, torch.device("cpu")), ParallelDims(1, 1, 1, 1, 1))
    assert sum(p.numel() for p in _trainable(ours).values()) == sum(p.numel() for p in trained.values())


def test_baseline_full_trains_everything_in_bf16():
    model, note = transformers_model(qwen3_moe_config(2, tiny=True), "cpu", "full", torch.bfloat16)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and "peft" not in note
    assert all(p.requires_grad and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.config._attn_implementation == "sdpa" and model.config._experts_implementation == "grouped_mm"
    assert model.config.use_cache is False and model.training


def test_presets_follow_the_published_configs():
    q3 = qwen3_moe_config(12)
    assert (q3["hidden_size"], q3["num_experts"], q3["moe_intermediate_size"], q3["num_experts_per_tok"]) == \
        (2048, 128, 768, 8)
    assert (q3["num_attention_heads"], q3["num_key_value_heads"], q3["head_dim"], q3["vocab_size"]) == \
        (32, 4, 128, 151936)
    assert q3["rope_parameters"]["rope_theta"] == 1e6 and q3["rms_norm_eps"] == 1e-6
    q35 = qwen3_5_moe_config(8)
    assert q35["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"]
    assert (q35["num_experts"], q35["moe_intermediate_size"], q35["shared_expert_intermediate_size"]) == (256, 512, 512)


def test_flags_become_config_overrides():
    args = parse_args(["--dry", "--mode", "full", "--master-dtype", "bf16", "--attn", "sdpa", "--compile",
                       "--set", "optim.grad_clip=0.5", "--set", "parallelism.activation_checkpoint=full"])
    cfg = our_config(args, qwen3_moe_config(args.layers, tiny=True))
    assert cfg.optim.master_dtype == "bf16" and cfg.model.attn_backend == "sdpa" and cfg.compile.enabled
    assert cfg.optim.grad_clip == 0.5 and cfg.parallelism.activation_checkpoint == "full"
    assert not cfg.lora.enabled and cfg.data.seq_len == 64 and cfg.optim.lr == 1e-5
    # Unset flags leave the Config's defaults (model.loss_impl is passed only when given).
    default = our_config(parse_args(["--dry"]), qwen3_moe_config(4, tiny=True))
    assert default.model.expert_backend == type(default.model).model_fields["expert_backend"].default
    assert default.optim.master_dtype == "fp32"
    assert default.lora.enabled and default.parallelism.activation_checkpoint == "none"
    assert parse_args([]).layers == 12 and parse_args(["--mode", "full"]).layers == 8
