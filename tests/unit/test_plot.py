"""runtime.plot on hand-written metrics.jsonl files: panels and lines (train and eval, nulls, two runs
overlaid, a resumed run), the PNG written where it belongs, and the errors for folders that are not runs."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from runtime.observe.plot import PlotError, figure, labels, main, read_run

TITLES = ["loss", "learning rate", "grad norm", "tokens/s", "peak memory (GiB)"]


def _train(step: int, loss: float = 1.0, memory: bool = False, run_id: str = "r") -> dict:
    record = {"run_id": run_id, "step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tok_s": 1000.0,
              "step_s": 0.1}
    return record | ({"peak_mem_gib": 10.0 + step} if memory else {})


def _eval(step: int, loss: float = 2.0) -> dict:
    return {"run_id": "r", "step": step, "eval_loss": loss, "eval_tokens": 100}


def _write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _axes(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def _xs(line) -> list:
    return [int(x) for x in line.get_xdata()]


def test_train_and_eval_loss_nulls_as_gaps_and_no_memory_on_cpu(tmp_path):
    records = [_train(s, loss=6.0 / s) for s in range(1, 7)]
    records[1]["grad_norm"] = None  # non-finite when logged
    run = _write(tmp_path / "a", records[:3] + [_eval(3)] + records[3:] + [_eval(6)])
    axes = _axes(figure({"a": read_run(run)}))
    assert list(axes) == TITLES
    train, evals = axes["loss"].get_lines()
    assert _xs(train) == [1, 2, 3, 4, 5, 6] and _xs(evals) == [3, 6]
    assert evals.get_linestyle() == "--" and evals.get_marker() == "o"
    grad_norm = axes["grad norm"].get_lines()[0].get_ydata()
    assert math.isnan(grad_norm[1]) and not any(math.isnan(v) for v in grad_norm[[0, 2, 3, 4, 5]])
    memory = axes["peak memory (GiB)"]
    assert not memory.get_lines() and [t.get_text() for t in memory.texts] == ["not recorded (CPU run)"]


def test_two_runs_overlaid_into_one_png(tmp_path, monkeypatch):
    a = _write(tmp_path / "a", [_train(s, memory=True) for s in range(1, 5)])
    b = _write(tmp_path / "b", [_train(s, memory=True) for s in range(1, 6)] + [_eval(5)])
    axes = _axes(figure({"a": read_run(a), "b": read_run(b)}))
    assert {title: len(ax.get_lines()) for title, ax in axes.items()} == {
        "loss": 3, "learning rate": 2, "grad norm": 2, "tokens/s": 2, "peak memory (GiB)": 2}
    assert [t.get_text() for t in axes["loss"].get_legend().get_texts()] == ["a train", "b train", "b eval"]
    assert [line.get_color() for line in axes["tokens/s"].get_lines()] == ["C0", "C1"]  # a run's colour everywhere

    monkeypatch.chdir(tmp_path)
    assert main([str(a), str(b)]) == 0  # several runs: ./runs.png
    png = (tmp_path / "runs.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (1000, 700)  # figsize (10, 7) at 100 dpi
    assert main([str(a)]) == 0 and (a / "metrics.png").is_file()  # one run: next to its metrics.jsonl


def test_resumed_run_has_each_step_once_and_older_files_are_not_read(tmp_path):
    # The first run logged steps 1-3, the run resumed from step 2's checkpoint steps 3 and 4; the first
    # run's step 3 (runtime.observe.metrics drops it now, an older runtime kept it) loses to the resumed run's.
    records = [_train(s, run_id="first") for s in (1, 2, 3)] + [_train(s, loss=0.5, run_id="resumed") for s in (3, 4)]
    run = _write(tmp_path / "a", records)
    (run / "metrics.20260101-000000.jsonl").write_text(json.dumps(_train(99)) + "\n")  # an earlier run's file
    train, evals = read_run(run)
    assert [r["step"] for r in train] == [1, 2, 3, 4] and evals == []
    assert [r["run_id"] for r in train] == ["first", "first", "resumed", "resumed"]
    assert _xs(_axes(figure({"a": (train, evals)}))["loss"].get_lines()[0]) == [1, 2, 3, 4]


def test_runs_sharing_a_folder_name_are_labelled_by_path(tmp_path):
    assert labels([tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "z"]) == [
        str(tmp_path / "x" / "run"), str(tmp_path / "y" / "run"), "z"]


def test_folders_that_are_not_runs_are_named(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nothing'} has no metrics.jsonl: not a run folder" in err and "logging.jsonl: false" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("\n")
    with pytest.raises(PlotError, match="metrics.jsonl is empty"):
        read_run(empty)
    broken = _write(tmp_path / "broken", [_train(1)])
    with (broken / "metrics.jsonl").open("a") as f:
        f.write('{"run_id": "r", "step": 2, "lo')  # a run killed mid-line
    with pytest.raises(PlotError, match=r"metrics.jsonl:2 is not a JSON record"):
        read_run(broken)
