"""optim.master_dtype: loss curves of the tiny example under each way of keeping the trained weights.

    python -m benchmarks.bench_master_dtype [--steps 300] [--lr 3e-3 1e-4] [--out DIR]

One process on the CPU, runtime.train.train on examples/tiny-qwen3-moe.yaml (full fine-tune from its
seeded random init, same data order and seed in every mode). The CPU has no autocast, so a mode is the
dtype the parameters live and compute in, and the optimizer:

    fp32        model.dtype float32, master_dtype fp32: fp32 weights, grads, compute; torch AdamW
    bf16+sr     model.dtype bfloat16, master_dtype bf16: bf16 everything; torchao AdamW, stochastic rounding
    bf16+plain  model.dtype bfloat16, master_dtype fp32: bf16 everything; torch AdamW, round to nearest

bf16+sr and bf16+plain compute alike and differ only in how the update is written back, which is what
the comparison is for; fp32 is the reference (on CUDA fp32 masters compute in bf16 under autocast, so
there it sits between the two). Per mode and lr: final loss, mean loss of the last 50 steps, and the
largest |loss - fp32 loss| over the steps.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import Column, Report
from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.train import train

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3-moe.yaml"
MODES = {"fp32": ("float32", "fp32"), "bf16+sr": ("bfloat16", "bf16"), "bf16+plain": ("bfloat16", "fp32")}
COLUMNS = [Column("mode", "mode", width=10), Column("lr", "lr", ".0e", width=5), Column("final", "final loss", ".4f"),
           Column("last50", "mean last 50", ".4f"), Column("max_delta", "max |d| vs fp32", ".4f")]


def losses(mode: str, lr: float, steps: int) -> list[float]:
    model_dtype, master_dtype = MODES[mode]
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(EXAMPLE, {"model.dtype": model_dtype, "optim.master_dtype": master_dtype, "optim.lr": lr,
                                    "train.max_steps": steps, "train.output_dir": out, "checkpoint.every_n_steps": 0,
                                    "checkpoint.save_final": False, "logging.progress_bar": False,
                                    "logging.jsonl": False})
        records = train(cfg, DistEnv(0, 1, 0, torch.device("cpu")), ParallelDims(1, 1, 1, 1, 1))
    return [r["loss"] for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, nargs="+", default=[3e-3, 1e-4])
    parser.add_argument("--out", default=None, help="folder for bench_master_dtype.json")
    args = parser.parse_args()
    logging.getLogger("runtime").setLevel(logging.WARNING)
    report = Report("bench_master_dtype", COLUMNS, args.out)
    report.meta = {"steps": args.steps, "config": str(EXAMPLE.relative_to(EXAMPLE.parents[1]))}
    report.header(f"master dtype, tiny example, {args.steps} steps")
    for lr in args.lr:
        reference = None
        for mode in MODES:
            curve = losses(mode, lr, args.steps)
            reference = reference or curve
            tail = curve[-50:]
            report.add({"mode": mode, "lr": lr, "final": curve[-1], "last50": sum(tail) / len(tail),
                        "max_delta": max(abs(a - b) for a, b in zip(curve, reference, strict=True))})


if __name__ == "__main__":
    main()
