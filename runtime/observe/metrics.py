"""Step metrics: FLOP count -> MFU, tokens/s, peak memory; a rank-0 progress bar and a JSONL log.

`metrics.jsonl` is strict JSON (NaN and inf written as null); every record carries the run id; a
resumed run first drops the records of steps after its checkpoint (it trains them again), and a fresh
run moves an earlier run's file aside rather than appending to it.

MFU counts model FLOPs per trained token as 6 * active matmul parameters (forward + backward) plus
the causal attention score/value products, against the device's dense bf16 peak.

`recompiles` counts torch.compile recompiles (dynamo compiling a function again because a guard of each
graph it holds failed) since training started; past the first steps none should happen.
"""

from __future__ import annotations

import json
import logging
import math
import os
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


def _mixer_params_and_flops(cfg, layer: int, seq_len: int) -> tuple[int, float]:
    """(matmul parameters, extra training FLOPs per token) of one block's token mixer."""
    H = cfg.hidden_size
    if cfg.is_linear_attention(layer):
        g = cfg.gdn
        key, value = g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim
        params = H * (2 * key + 2 * value + 2 * g.num_v_heads) + value * H  # in_proj_* and out_proj
        # delta-rule state update and readout: ~2 [dk x dv] products per head and token, x3 fwd+bwd
        return params, 3 * 2 * 2 * g.num_v_heads * g.head_k_dim * g.head_v_dim
    D = cfg.head_dim
    q_out = cfg.num_heads * D * (2 if cfg.gated_attention else 1)
    params = H * (q_out + 2 * cfg.num_kv_heads * D) + cfg.num_heads * D * H
    # QK^T and AV: 2 matmuls x 2 FLOPs x heads x D x (S/2 average causal context), x3 for fwd+bwd
    return params, 3 * 2 * 2 * cfg.num_heads * D * seq_len / 2


def _mlp_params(cfg, layer: int) -> int:
    """Matmul parameters one token passes through in a block's MLP (routed experts: only its top-k)."""
    H = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return 3 * H * cfg.intermediate_size
    shared = 3 * H * cfg.shared_expert_intermediate_size + (H if cfg.shared_expert_intermediate_size else 0)
    return 3 * H * cfg.moe_intermediate_size * cfg.num_experts_per_tok + H * cfg.num_experts + shared


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token of a QwenConfig: 6 x active matmul parameters, plus the attention
    score/value products of full-attention blocks and the state updates of Gated DeltaNet blocks."""
    params, extra = cfg.hidden_size * cfg.vocab_size, 0.0
    for layer in range(cfg.num_layers):
        mixer_params, mixer_flops = _mixer_params_and_flops(cfg, layer, seq_len)
        params += mixer_params + _mlp_params(cfg, layer)
        extra += mixer_flops
    return 6 * params + extra


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


class StepTimer:
    """Seconds per step, between the ends of consecutive steps. The loop reads step N while N+1 is queued, so
    the time between reads is a launch's, and the last step's read would time only its tail. A step's end: its
    timing event on the device where both steps have one, else when its work was queued (on the CPU, done).
    The first step after the start or a reset() (work that is no step's) counts from then to its queuing."""

    def __init__(self):
        self.reset()

    def lap(self, step) -> float:
        """`step`: a runtime.step.LaunchedStep (its `done` event or None, its `launched_at`)."""
        if self.last is None:
            elapsed = step.launched_at - self.start
        elif step.done is not None and self.last.done is not None:
            elapsed = self.last.done.elapsed_time(step.done) / 1e3
        else:
            elapsed = step.launched_at - self.last.launched_at
        self.last = step
        return elapsed

    def reset(self) -> None:
        self.start, self.last = time.perf_counter(), None


class RecompileCounter:
    """Counts dynamo recompiles from construction to close(): a compile-start callback sees every compile,
    and a frame's compile number above 0 is a recompile. Reading the count costs nothing.
    `after_step` warns when a step past the first WARMUP_STEPS recompiled, with dynamo's reason."""

    WARMUP_STEPS = 3  # the first step compiles, the next ones may meet a second branch (e.g. more documents)

    def __init__(self):
        from torch._dynamo.callback import callback_handler  # imported here: torch._dynamo is slow to import

        self.count = 0
        self._seen = 0
        self._handler = callback_handler
        callback_handler.register_start_callback(self._on_compile_start)

    def _on_compile_start(self, args) -> None:
        from torch._dynamo.callback import CallbackTrigger
        from torch._guards import CompileId

        if args.callback_trigger != CallbackTrigger.DYNAMO:
            return
        compile_id = CompileId.from_string(args.compile_id)
        if compile_id is not None and compile_id.frame_compile_id:
            self.count += 1

    def after_step(self, step: int, warn: bool = True) -> int:
        """The count so far; a warning naming the last recompile's reason when `step` is past the warm-up
        and recompiled."""
        if warn and self.count > self._seen and step > self.WARMUP_STEPS:
            log.warning("step %d recompiled torch.compile'd code %d time(s) (%d since the start): %s. Each "
                        "recompile stalls a step, and past torch._dynamo.config.recompile_limit (%d) a fullgraph "
                        "region fails; TORCH_LOGS=recompiles prints every reason", step, self.count - self._seen,
                        self.count, last_recompile_reason(), torch._dynamo.config.recompile_limit)
        self._seen = self.count
        return self.count

    def close(self) -> None:
        if self._on_compile_start in self._handler.start_callbacks:  # torch._dynamo.reset() drops them
            self._handler.remove_start_callback(self._on_compile_start)


def last_recompile_reason() -> str:
    """The function and the failed guard of the latest recompile dynamo recorded (the guard's first line, without
    the source comment and stack dynamo appends), or a note that it has none."""
    for m in reversed(torch._dynamo.utils.get_compilation_metrics()):
        if m.recompile_reason:
            guard = m.recompile_reason.strip().splitlines()[0].split("  #")[0].strip()
            return f"{m.co_name} ({m.co_filename}:{m.co_firstlineno}) failed guard {guard}"
    return "no reason recorded"


# The record's keys the console line shows, in record order.
STATUS_KEYS = ("loss", "lr", "grad_norm", "tok_s", "mfu", "ep_imbalance")


class MetricsLogger:
    """Rank-0 sink for per-step metrics: JSONL file, progress bar, periodic log lines."""

    def __init__(self, output_dir: str, total_steps: int, enabled: bool, progress_bar: bool, jsonl: bool,
                 every_n_steps: int = 1, start_step: int = 0, run_id: str = "", trackers=None):
        self.enabled = enabled
        self.every = every_n_steps
        self.run_id = run_id
        self.trackers = trackers  # runtime.observe.trackers.Trackers: TensorBoard / W&B, or None
        self.file = None
        self.progress = None
        if not enabled:
            return
        if jsonl:
            path = Path(output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            _prepare_jsonl(path, start_step)
            self.file = path.open("a")
        if progress_bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[status]}"), transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()

    def log(self, record: dict) -> None:
        """A training step's record, or an eval record ({"step", "eval_loss", "eval_tokens"})."""
        if not self.enabled:
            return
        if self.file is not None:
            self.file.write(json_line({"run_id": self.run_id, **record}))
            self.file.flush()
        if self.trackers is not None:
            self.trackers.log(record)
        if "eval_loss" in record:
            log.info("step %d eval loss %.4g over %d label tokens", record["step"], record["eval_loss"],
                     record["eval_tokens"])
            return
        status = " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k in STATUS_KEYS)
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], status=status)
        if record["step"] % self.every == 0:
            log.info("step %d %s", record["step"], status)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.file is not None:
            self.file.close()
        if self.trackers is not None:
            self.trackers.close()


def json_line(record: dict) -> str:
    """One strict-JSON line: non-finite floats become null (json.dumps would write NaN)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def _prepare_jsonl(path: Path, start_step: int) -> None:
    """Resume (start_step > 0): keep only the records up to start_step, so no step appears twice.
    Fresh run: an earlier run's file is renamed aside (metrics.<mtime>.jsonl), never appended to."""
    if not path.is_file():
        return
    if start_step == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        os.replace(path, path.with_name(f"metrics.{stamp}.jsonl"))
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", 0) <= start_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
