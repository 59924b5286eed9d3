"""User mistakes found by trying the runtime as a new user (issue 41): each ends in one `error:` line that
names the file or key and the fix, through the same failure mapping runtime.launch uses (runtime.guard.failures)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from runtime.config import ConfigError, config_from_dict
from runtime.guard.failures import RunContext, describe
from tests.conftest import write_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"


def user_line(err: BaseException, context: RunContext | None = None) -> str:
    """The line a user sees for `err`; fails unless it is a user error (one line, no traceback)."""
    failure = describe(err, context or RunContext())
    assert failure.kind == "user", failure.line
    assert "\n" not in failure.line
    return failure.line


def test_truncated_safetensors_names_the_file_and_the_fix(tmp_path):
    from runtime.distributed.mesh import ParallelDims
    from runtime.distributed.process_group import DistEnv
    from runtime.models.factory import build_model

    write_hf_checkpoint(tmp_path / "hf", "moe", vocab_size=520)
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])  # an interrupted download
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["model"].pop("config")
    raw["model"]["path"] = str(tmp_path / "hf")
    cfg = config_from_dict(raw, {"train.output_dir": str(tmp_path / "run")}, base_dir=EXAMPLE.parent)
    with pytest.raises(Exception) as caught:
        build_model(cfg, DistEnv(0, 1, 0, torch.device("cpu")), ParallelDims(1, 1, 1, 1, 1))
    line = user_line(caught.value)
    assert str(weights) in line and "truncated" in line, line
    assert "download the checkpoint again or re-save it" in line, line


def test_set_with_an_empty_value_is_an_error_naming_the_key():
    from runtime.launch import prepare

    for value in ("", "null"):
        with pytest.raises(ConfigError) as caught:
            prepare([str(EXAMPLE), "--set", f"train.micro_batch_size={value}"])
        line = user_line(caught.value)
        assert "no value for train.micro_batch_size" in line, line


def test_verify_refuses_zero_steps():
    from runtime.cli import UsageError
    from runtime.verify import verify

    for steps in ("0", "-1"):
        with pytest.raises(UsageError) as caught:  # before any process group or model
            verify(["--steps", steps, str(EXAMPLE)])
        assert user_line(caught.value).startswith(f"error: --steps {steps}: verification needs at least one step")


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_preflight_checks_the_tracker_folder(tmp_path, tracker):
    """A file where a tracker writes its folder fails in preflight, before any model is built."""
    from runtime.guard.preflight import PreflightError, preflight

    out = tmp_path / "run"
    out.mkdir()
    (out / tracker).write_text("in the way")
    asked = ({"logging.tensorboard": True} if tracker == "tensorboard"
             else {"logging.wandb": {"project": "p", "mode": "offline"}})
    cfg = config_from_dict(yaml.safe_load(EXAMPLE.read_text()), {"train.output_dir": str(out), **asked},
                           base_dir=EXAMPLE.parent)
    with pytest.raises(PreflightError) as caught:
        preflight(cfg, rank=0)
    line = user_line(caught.value)
    assert line == (f"error: the logging.{tracker} folder under train.output_dir cannot be created ({out / tracker}: "
                    "a file is in the way); move that file away or set train.output_dir (or --output-dir) to a "
                    "folder this user can write"), line


def _lora_run(out: Path, steps: int = 2) -> None:
    """A LoRA run in one process with a checkpoint at every step."""
    from runtime.distributed.mesh import ParallelDims
    from runtime.distributed.process_group import DistEnv
    from runtime.train import train

    cfg = config_from_dict(yaml.safe_load(EXAMPLE.read_text()), {
        "data.seq_len": 64, "train.micro_batch_size": 2, "optim.warmup_steps": 0, "train.max_steps": steps,
        "train.output_dir": str(out), "logging.progress_bar": False, "lora.enabled": True, "lora.rank": 4,
        "checkpoint.every_n_steps": 1}, base_dir=EXAMPLE.parent)
    train(cfg, DistEnv(0, 1, 0, torch.device("cpu")), ParallelDims(1, 1, 1, 1, 1))


def test_export_of_a_torn_checkpoint_is_one_error_line(tmp_path):
    """`python -m runtime.export` reports through the failure mapping runtime.launch uses: a torn shard is one
    line naming the checkpoint and the older one to export, exit 1, no traceback. Its main in a process of its
    own, forked from this one (tests.conftest.Forked): the failure report ends the process."""
    from tests.conftest import Forked

    run = tmp_path / "run"
    _lora_run(run)
    shard = run / "checkpoints" / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])  # a copy cut short
    argv = [str(run), "--merged", str(tmp_path / "merged")]
    proc = Forked(f"import sys\nfrom runtime.export import main\nsys.exit(main({argv!r}))",
                  tmp_path / "stderr.txt")
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [(f"error: checkpoint {shard.parent} is unreadable (EOFError: the data ends early, a truncated "
                       "file); export the one before it with --step 1")], stderr
    assert not (tmp_path / "merged").exists()
