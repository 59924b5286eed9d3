"""runtime.plot: panels and lines from hand-written metrics.jsonl files (train and eval records, nulls, two
runs overlaid), the PNG written, and the errors for folders that are not runs."""

from __future__ import annotations

import json

import pytest

from runtime.plot import PlotError, figure, main, read_run


def _write_run(folder, steps: int, eval_every: int = 0, memory: bool = False, loss0: float = 6.0):
    folder.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"run_id": "r", "step": step, "loss": loss0 / step, "lr": 1e-3, "grad_norm": None if step == 2 else 1.0,
                  "tok_s": 1000.0 + step, "step_s": 0.1}
        if memory:
            record["peak_mem_gib"] = 10.0 + step
        lines.append(record)
        if eval_every and step % eval_every == 0:
            lines.append({"run_id": "r", "step": step, "eval_loss": loss0 / step + 0.1, "eval_tokens": 100})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "metrics.20260101-000000.jsonl").write_text('{"step": 99, "loss": 1.0}\n')  # an older run's file
    return folder


def _axes(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def test_one_run_with_eval_draws_train_and_eval_loss(tmp_path):
    run = _write_run(tmp_path / "a", steps=6, eval_every=3)
    axes = _axes(figure({"a": read_run(run)}))
    assert list(axes) == ["loss", "learning rate", "grad norm", "tokens/s"]  # no memory on a CPU run
    train, evals = axes["loss"].get_lines()
    assert list(train.get_xdata()) == [1, 2, 3, 4, 5, 6] and list(evals.get_xdata()) == [3, 6]
    assert list(axes["grad norm"].get_lines()[0].get_xdata()) == [1, 3, 4, 5, 6]  # the null is left out


def test_two_runs_overlay_and_the_png_is_written(tmp_path):
    a = _write_run(tmp_path / "a", steps=4, memory=True)
    b = _write_run(tmp_path / "b", steps=5, memory=True, loss0=5.0)
    out = tmp_path / "runs.png"
    assert main([str(a), str(b), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = _axes(figure({"a": read_run(a), "b": read_run(b)}))
    assert "peak memory (GiB)" in axes
    assert [len(ax.get_lines()) for ax in axes.values()] == [2] * 5
    assert main([str(a)]) == 0 and (a / "metrics.png").is_file()  # one run: next to its metrics


def test_folders_that_are_not_runs_are_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match="is empty"):
        read_run(tmp_path / "empty")
    assert main([str(tmp_path / "nothing")]) == 1
    assert f"{tmp_path / 'nothing'} has no metrics.jsonl" in capsys.readouterr().err
