"""benchmarks/bench_graph_step.py on the CPU: the queued side trains (the trainer's step on one fixed batch, so
its loss falls), and off CUDA there is no graph side."""

from __future__ import annotations

import json

from benchmarks.bench_graph_step import DRY_ARGV, build, device_step, main
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


def test_the_captured_body_trains_when_called_uncaptured():
    """What the graph captures on CUDA (forward, backward, apply_update of one fixed batch), called directly."""
    cfg, env, _, model, optimizer, batch = build([*DRY_ARGV, "--set", "optim.lr=1e-2",
                                                  "--set", f"data.path={small_chat_data()}"])
    numbers = []
    step = device_step(model, batch, optimizer, cfg, env, numbers)
    losses = []
    for _ in range(4):
        step()
        losses.append(float(numbers[0][0]))
    assert losses[-1] < losses[0]


def test_config_data_gives_the_packed_row_of_the_config(capsys):
    main(["--dry", "--data", "config", "--set", f"data.path={small_chat_data()}", "--steps", "1", "--warmup", "1"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["data"] == "config" and row["documents"] > 1  # short chat records packed into one row of 64
