"""Reads a compiled training run's metrics.jsonl beside the batches its config packs: per step the seconds, the
documents of the step's rows (cu_seqlens entries - 1, padding included) and their longest document, and the
recompile count; then PASS when the run recompiled at most MAX_RECOMPILES times in all (benchmarks/gpu_e2e.sh
recompiles), and the mean step after the first against the median. Runs anywhere: the batches are rebuilt on the
CPU from the config's data.

    python -m benchmarks.recompiles CONFIG.yaml RUN/metrics.jsonl [--dp-world N]   # N: the run's data ranks
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from runtime.config import load_config
from runtime.data.chat import load_tokenizer
from runtime.data.loader import build_dataloader

MAX_RECOMPILES = 2


def packing_per_step(config: str, steps: int, dp_world: int = 1) -> list[tuple[int, int]]:
    """(documents, longest document) of each step's batches, as data rank 0 of `dp_world` draws them."""
    cfg = load_config(config)
    loader = build_dataloader(cfg.data, load_tokenizer(cfg.data.tokenizer or cfg.model.path),
                              cfg.train.micro_batch_size, dp_rank=0, dp_world=dp_world)
    out = []
    for _ in range(steps):
        batches = [next(loader) for _ in range(cfg.train.grad_accum_steps)]
        out.append((sum(b.cu_seqlens.numel() - 1 for b in batches), max(b.max_seqlen for b in batches)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("metrics")
    p.add_argument("--dp-world", type=int, default=1, help="the run's data ranks (its rows: rank 0's)")
    args = p.parse_args(argv)
    path = Path(args.metrics)
    records = [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r] if path.is_file() else []
    if not records:
        print(f"recompiles: {path} holds no training step (did the run fail? see its log)")
        return 1
    packing = packing_per_step(args.config, len(records), args.dp_world)
    print(f"{'step':>4} {'step_s':>8} {'docs':>5} {'longest':>7} {'recompiles':>10}")
    for r, (docs, longest) in zip(records, packing):
        print(f"{r['step']:>4} {r['step_s']:>8.3f} {docs:>5} {longest:>7} {r['recompiles']:>10}")
    after = [r["step_s"] for r in records[1:]]
    if after:  # issue 43: over a long run the recompiles' cost shows as the mean pulling away from the median
        mean, median = statistics.fmean(after), statistics.median(after)
        print(f"steps 2-{records[-1]['step']}: mean {mean:.3f} s, median {median:.3f} s, mean/median {mean / median:.3f}")
    total = records[-1]["recompiles"]
    after_first = total - records[0]["recompiles"]
    verdict = "PASS" if total <= MAX_RECOMPILES else "FAIL"
    print(f"recompiles: {total} in all, {after_first} after step 1 (at most {MAX_RECOMPILES}): {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
