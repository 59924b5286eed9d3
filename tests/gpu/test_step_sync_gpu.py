"""GPU: a steady training step (runtime.step.train_step, as the trainer calls it) is queued without one host
sync: CUDA's sync debug mode set to "error" turns any synchronizing call (an .item(), a pageable copy, a
blocking event) into an exception whose traceback names the site. Default config of one GPU (compile auto),
LoRA and full fine-tunes, torch's fused AdamW and our stochastic-rounding AdamW. (A step skipped on the
device: tests/unit/test_step.py, CPU and CUDA.)"""

from __future__ import annotations

import math
import traceback

import pytest
import torch

from benchmarks.bench_e2e import build_ours, hf_config, parse_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = [("lora", "fp32"), ("full", "fp32"), ("full", "bf16")]
# eager (EP's default) with the balance loss on, as the benchmark configs train
EAGER = ("--set", "compile.enabled=false", "--set", "model.router_aux_loss_coef=0.001")


def _setup(mode: str, master: str, *extra: str):
    args = parse_args(["--dry", "--mode", mode, "--master-dtype", master, "--seq", "256", *extra])
    return build_ours(args, hf_config(args), torch.device("cuda"))


def _first_sync(fn) -> str | None:
    """The traceback of fn's first synchronizing CUDA call, None when it makes none."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as err:
        if "synchroniz" not in str(err):
            raise
        return traceback.format_exc()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


@pytest.mark.parametrize("eager", [False, True], ids=["default", "eager-aux-loss"])
@pytest.mark.parametrize(("mode", "master"), CASES)
def test_a_steady_step_is_queued_without_a_host_sync(mode, master, eager):
    setup = _setup(mode, master, *(EAGER if eager else ()))
    for _ in range(3):  # kernel choices, compiles, the optimizer's states
        setup.step()
    launched = []
    sync = _first_sync(lambda: launched.append(setup.launch()))
    assert sync is None, sync
    assert math.isfinite(setup.read(launched[0]))
