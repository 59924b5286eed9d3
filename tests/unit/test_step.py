"""runtime.step: a step whose loss is not finite is skipped on the device (reported, no parameter or
optimizer state moved), and a global batch without label tokens is skipped as such; the launched step's
numbers equal what the host-side reference computes from the same gradients; a step's seconds are the device's
between step ends."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks.bench_e2e import build_ours, hf_config, parse_args
from runtime.observe.metrics import StepTimer
from runtime.step import LaunchedStep

CASES = [("cpu", "lora", "fp32"), ("cpu", "full", "fp32")] + [
    pytest.param("cuda", mode, master, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])
    for mode, master in (("lora", "fp32"), ("full", "fp32"), ("full", "bf16"))]


def _setup(device: str, mode: str, master: str, *overrides: str):
    args = parse_args(["--dry", "--mode", mode, "--master-dtype", master, "--seq", "64",
                       *(arg for item in overrides for arg in ("--set", item))])
    return build_ours(args, hf_config(args), torch.device(device))


def _trained(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize(("device", "mode", "master"), CASES)
def test_a_non_finite_step_moves_nothing(device, mode, master, monkeypatch):
    from runtime.models.qwen import QwenForCausalLM

    setup = _setup(device, mode, master)
    setup.step()
    before = _trained(setup.model)
    real = QwenForCausalLM.forward
    monkeypatch.setattr(QwenForCausalLM, "forward", lambda self, *a, **k: real(self, *a, **k) * float("nan"))
    result = setup.launch().result()
    assert result.skipped == "non_finite" and math.isnan(result.loss)
    assert all(torch.equal(a, b) for a, b in zip(_trained(setup.model), before))
    monkeypatch.undo()
    assert setup.launch().result().skipped is None  # the next finite step is applied
    assert not all(torch.equal(a, b) for a, b in zip(_trained(setup.model), before))


def test_a_step_without_labels_is_skipped_as_such(monkeypatch):
    from benchmarks import bench_e2e

    real = bench_e2e.one_document_batch

    def unlabelled(ids):
        batch = real(ids)
        batch.labels.fill_(-100)
        batch.num_label_tokens = 0
        return batch

    monkeypatch.setattr(bench_e2e, "one_document_batch", unlabelled)
    setup = _setup("cpu", "lora", "fp32")
    before = _trained(setup.model)
    result = setup.launch().result()
    assert result.skipped == "no_labels" and math.isnan(result.loss) and math.isnan(result.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(_trained(setup.model), before))


def test_the_launched_numbers_are_the_hosts(monkeypatch):
    """Loss and grad norm of a launched step equal the forward's mean loss and the norm of the gradients the
    optimizer received, computed on the host by the test (clipping off, so the gradients are left as made)."""
    seen = {}
    real_step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        grads = [p.grad.double().flatten() for group in self.param_groups for p in group["params"]
                 if p.grad is not None]
        seen["norm"] = torch.cat(grads).norm().item()
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    setup = _setup("cpu", "full", "fp32", "optim.grad_clip=0")
    result = setup.launch().result()
    assert result.grad_norm == pytest.approx(seen["norm"], rel=1e-5)
    assert math.isfinite(result.loss) and result.skipped is None and result.num_tokens == 64


def test_a_step_is_timed_between_the_ends_of_steps():
    """On the CPU a step's work is done when it is queued: the loop's last step, read right after the one before
    it, is timed from that step's end to its own, not by the reads."""
    timer = StepTimer()
    first = SimpleNamespace(done=None, launched_at=time.perf_counter())
    time.sleep(0.05)
    second = SimpleNamespace(done=None, launched_at=time.perf_counter())
    time.sleep(0.2)  # both read later, one right after the other
    timer.lap(first)
    assert 0.05 <= timer.lap(second) < 0.24  # the two reads, one right after the other, would time ~0


def test_host_work_a_step_ends_with_is_not_the_next_steps():
    """The collection after the first step (its compile's leftovers) is that step's: ends_now() moves its end."""
    timer = StepTimer()
    first = LaunchedStep(64, torch.zeros(6, dtype=torch.float64), None, None)
    time.sleep(0.2)  # the collection after it
    first.ends_now()
    second = LaunchedStep(64, torch.zeros(6, dtype=torch.float64), None, None)
    timer.lap(first)
    assert timer.lap(second) < 0.1  # without ends_now() it would read the collection's 0.2 s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_is_timed_between_the_device_ends_of_steps():
    """The loop's last step is read right after the one before it, when its work may be done already: the
    host's lap would read ~0, the device's events time its work."""

    def kernel_then_end(cycles: int) -> SimpleNamespace:
        torch.cuda._sleep(cycles)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return SimpleNamespace(done=end, launched_at=time.perf_counter())

    cycles = 100_000_000
    torch.cuda.synchronize()
    started = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    kernel_s = time.perf_counter() - started  # the reference: one such kernel, timed by the host
    timer = StepTimer()
    first, second = kernel_then_end(cycles), kernel_then_end(cycles)
    torch.cuda.synchronize()  # both steps are done before either is read
    timer.lap(first)
    assert 0.5 * kernel_s < timer.lap(second) < 1.5 * kernel_s
    timer.reset()
    assert timer.lap(kernel_then_end(0)) < 0.5 * kernel_s  # after a reset: from then to the step's queuing
