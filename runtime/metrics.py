"""Step metrics: FLOP count -> MFU, tokens/s, peak memory; a rank-0 progress bar and a JSONL log.

MFU counts model FLOPs per trained token as 6 * active matmul parameters (forward + backward) plus
the causal attention score/value products, against the device's dense bf16 peak.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("runtime")

# Dense bf16 tensor-core peaks (TFLOP/s) by device-name fragment.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H20": 148.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, tflops in BF16_PEAK_TFLOPS.items():
        if fragment in name:
            return tflops * 1e12
    return None


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token of a QwenConfig: 6 x active matmul params + causal attention."""
    H, D = cfg.hidden_size, cfg.head_dim
    attn_params = H * D * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    dense_mlp = 3 * H * cfg.intermediate_size
    moe_mlp = 3 * H * cfg.moe_intermediate_size * cfg.num_experts_per_tok + H * cfg.num_experts
    mlp = sum(moe_mlp if cfg.is_moe_layer(i) else dense_mlp for i in range(cfg.num_layers))
    params = cfg.num_layers * attn_params + mlp + H * cfg.vocab_size
    # QK^T and AV: 2 matmuls x 2 FLOPs x heads x D x (S/2 average causal context), x3 for fwd+bwd.
    attention = cfg.num_layers * 3 * 2 * 2 * cfg.num_heads * D * seq_len / 2
    return 6 * params + attention


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


class StepTimer:
    def __init__(self):
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed


class MetricsLogger:
    """Rank-0 sink for per-step metrics: JSONL file, progress bar, periodic log lines."""

    def __init__(self, output_dir: str, total_steps: int, enabled: bool, progress_bar: bool, jsonl: bool,
                 every_n_steps: int = 1, start_step: int = 0):
        self.enabled = enabled
        self.every = every_n_steps
        self.file = None
        self.progress = None
        if not enabled:
            return
        if jsonl:
            path = Path(output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("a")
        if progress_bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[status]}"), transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        status = " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k in ("loss", "lr", "grad_norm", "tok_s", "mfu"))
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], status=status)
        if record["step"] % self.every == 0:
            log.info("step %d %s", record["step"], status)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.file is not None:
            self.file.close()


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
