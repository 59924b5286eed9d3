"""benchmarks/bench_graph_step.py on the CPU: the queued side trains (the trainer's step on one fixed batch, so
its loss falls), and off CUDA there is no graph side."""

from __future__ import annotations

import json

from benchmarks.bench_graph_step import main
from tests.conftest import small_chat_data


def _row(capsys, steps: int) -> dict:
    main(["--dry", "--set", "optim.lr=1e-2", "--set", f"data.path={small_chat_data()}", "--steps", str(steps),
          "--warmup", "1"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cpu_run_prints_the_queued_side_only(capsys):
    short, longer = _row(capsys, 1), _row(capsys, 6)
    assert short["world"] == 1 and short["lora"] and short["tokens_per_rank"] == 64 and short["queued_ms"] > 0
    assert longer["queued_loss"] < short["queued_loss"]  # the same batch, stepped on: it is being fitted
    assert "graph_ms" not in short and "graph_error" not in short
