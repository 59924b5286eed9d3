"""Single-process training: the tiny example learns; errors end the run cleanly; NaN stops it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from runtime.config import OptimConfig
from runtime.launch import run
from runtime.optim import lr_factor
from runtime.train import TrainingDiverged

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"


def test_tiny_example_loss_falls(tmp_path):
    records = run([str(EXAMPLE), "--max-steps", "30", "--output-dir", str(tmp_path)])
    losses = [r["loss"] for r in records]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:3]) / 3, losses
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 31))
    assert {"loss", "lr", "grad_norm", "tok_s"} <= set(logged[0])
    assert (tmp_path / "checkpoints" / "step_00000030").is_dir()


def test_lr_schedule_warmup_then_cosine():
    o = OptimConfig(warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(s, o, 20) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))
    assert abs(lr_factor(20, o, 20) - 0.1) < 1e-9


def test_nan_loss_stops_with_step_and_checkpoint(tmp_path, monkeypatch):
    from runtime.models.qwen import QwenForCausalLM

    real = QwenForCausalLM.forward
    calls = {"n": 0}

    def poisoned(self, *args, **kwargs):  # the 4th step's loss turns NaN
        calls["n"] += 1
        return real(self, *args, **kwargs) * (float("nan") if calls["n"] == 4 else 1.0)

    monkeypatch.setattr(QwenForCausalLM, "forward", poisoned)
    with pytest.raises(TrainingDiverged, match=r"loss nan, grad norm nan at step 4: the update was not applied; last good checkpoint: .*step_00000002"):
        run([str(_config_with(tmp_path, "checkpoint:\n  every_n_steps: 2\n")), "--max-steps", "6",
             "--output-dir", str(tmp_path)])


def test_an_error_in_a_step_keeps_the_line_of_the_step_before(tmp_path, monkeypatch):
    """A step is read once the next one is queued: when queuing step 3 fails, step 2 (launched, not yet read)
    still gets its metrics line."""
    from runtime.models.qwen import QwenForCausalLM

    real = QwenForCausalLM.forward
    calls = {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the third forward fails")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(QwenForCausalLM, "forward", failing)
    with pytest.raises(RuntimeError, match="the third forward fails"):
        run([str(_config_with(tmp_path, "checkpoint:\n  every_n_steps: 0\n")), "--max-steps", "6",
             "--output-dir", str(tmp_path)])
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]


def _config_with(tmp_path: Path, extra_yaml: str) -> Path:
    text = EXAMPLE.read_text().replace("tiny/", str(ROOT / "examples" / "tiny") + "/")
    text = text.split("checkpoint:")[0] + extra_yaml + "logging:\n  progress_bar: false\n"
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_cli_error_is_one_clean_message(tmp_path, cli):
    """runtime.launch's main in this process (the config error class through the real command:
    tests/reliability/test_user_faults.py::test_config_error_through_the_command)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("lr: 3.0e-3", "lr: -1"))
    proc = cli([bad])
    assert proc.returncode != 0
    assert "optim.lr: Input should be greater than 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_grad_norm_over_mixed_dtypes_matches_the_concatenated_norm():
    from runtime.distributed.fsdp import total_grad_norm
    from runtime.step import clip_factor

    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3).bfloat16())
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 3
    before = [p.grad.clone() for p in model.parameters()]
    expected = torch.cat([g.float().flatten() for g in before]).norm().item()
    norm = total_grad_norm([p.grad for p in model.parameters()], world_size=1)
    assert norm.item() == pytest.approx(expected, rel=1e-6)
    assert clip_factor(norm, max_norm=1.0).item() == pytest.approx(1.0 / expected, rel=1e-5)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))  # the optimizer scales


def test_small_or_non_finite_gradients_are_not_clipped():
    from runtime.step import clip_factor

    assert clip_factor(torch.tensor(0.5), max_norm=1.0).item() == 1.0
    assert clip_factor(torch.tensor(float("nan")), max_norm=1.0).item() == 1.0
    assert clip_factor(torch.tensor(float("inf")), max_norm=1.0).item() == 1.0
    assert clip_factor(torch.tensor(4.0), max_norm=0.0).item() == 1.0  # optim.grad_clip: 0 is off



def test_profiled_step_writes_trace_and_summary(tmp_path, caplog):
    """profiling.steps: the chosen step's Chrome trace and top-ops table on disk, its summary line in the log;
    no other step is traced."""
    import gzip

    with caplog.at_level("INFO", logger="runtime"):
        run([str(EXAMPLE), "--max-steps", "3", "--output-dir", str(tmp_path), "--set", "optim.warmup_steps=1",
             "--set", "profiling.steps=[2]", "--set", "checkpoint.save_final=false"])
    folder = tmp_path / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["step2_rank0.json.gz", "step2_rank0.txt"]
    with gzip.open(folder / "step2_rank0.json.gz") as f:
        trace = json.loads(f.read())
    assert any(e.get("name", "").startswith("aten::mm") for e in trace["traceEvents"])
    summary = (folder / "step2_rank0.txt").read_text().splitlines()[0]
    assert summary.startswith("profile step 2: wall ") and "host syncs" in summary
    assert any(r.getMessage().startswith(summary) for r in caplog.records)


def test_profile_summary_counts_device_events_and_blocking_calls_once():
    """The summary's kernel time sums the device's own events (not again the CPU ops that launched them, nor GPU
    ranges); its host syncs are the blocking CUDA calls (not async copies, not `.item()` of CPU tensors)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from runtime.observe.profiling import summary_line

    def avg(key, device, count=1, cpu_us=0.0, device_us=0.0, annotation=False):
        return SimpleNamespace(key=key, count=count, cpu_time_total=cpu_us, self_device_time_total=device_us,
                               device_type=device, is_user_annotation=annotation)

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    averages = [avg("aten::mm", cpu, device_us=4000), avg("nvjet_gemm", cuda, device_us=4000),
                avg("record_param_comms", cpu, device_us=3000), avg("ncclDevKernel_SendRecv", cuda, device_us=3000),
                avg("nccl:all_to_all", cuda, device_us=3000, annotation=True),
                avg("cudaStreamSynchronize", cpu, count=8, cpu_us=2000), avg("cudaMemcpyAsync", cpu, count=150),
                avg("aten::_local_scalar_dense", cpu, count=300, cpu_us=900)]
    line = summary_line(averages, step=6, wall_ms=10.0, cuda=True)
    assert line == "profile step 6: wall 10.0 ms, device kernels 7.0 ms (70% of wall), host syncs 8 (2.0 ms CPU)"


def test_profiling_steps_outside_the_run_are_refused(tmp_path):
    with pytest.raises(Exception, match=r"profiling.steps \[5\] are not steps of this run"):
        run([str(EXAMPLE), "--max-steps", "3", "--output-dir", str(tmp_path), "--set", "optim.warmup_steps=1",
             "--set", "profiling.steps=[2, 5]"])
