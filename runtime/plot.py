"""Pictures of runs: loss (train and eval), learning rate, grad norm, tokens/s and peak memory against the
step, from each run folder's metrics.jsonl, several runs overlaid, in one PNG.

    python -m runtime.plot RUN_DIR [RUN_DIR ...] [-o OUT.png]    # default RUN_DIR/metrics.png, or runs.png

`figure(runs)` returns the matplotlib Figure (one axis per panel, one line per run and series) for tests and
notebooks. Records are runtime.metrics' (training records carry "loss", eval records "eval_loss"; null for a
non-finite value); metrics.<stamp>.jsonl files of earlier runs in the folder are not read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display is needed or wanted
import matplotlib.pyplot as plt

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "grad norm"), ("tok_s", "tokens/s"),
          ("peak_mem_gib", "peak memory (GiB)"))


class PlotError(ValueError):
    """A folder that cannot be plotted; the message names it and why."""


def read_run(folder: Path) -> tuple[list[dict], list[dict]]:
    """(training records, eval records) of one run folder, in step order."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{folder} has no metrics.jsonl: not a run folder (train.output_dir), or the run had "
                        "logging.jsonl: false")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise PlotError(f"{path} is empty: the run logged no step yet")
    train = sorted((r for r in records if "loss" in r), key=lambda r: r["step"])
    evals = sorted((r for r in records if "eval_loss" in r), key=lambda r: r["step"])
    return train, evals


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def figure(runs: dict[str, tuple[list[dict], list[dict]]]):
    """One panel per metric any run recorded; train loss solid, eval loss dashed with markers."""
    panels = [(key, title) for key, title in PANELS
              if any(_series(train, key)[0] for train, _ in runs.values())]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True, squeeze=False)
    for ax, (key, title) in zip(axes[:, 0], panels):
        for i, (name, (train, evals)) in enumerate(runs.items()):
            color = f"C{i}"
            ax.plot(*_series(train, key), color=color, label=f"{name} train" if key == "loss" else name)
            if key == "loss" and evals:
                ax.plot(*_series(evals, "eval_loss"), color=color, linestyle="--", marker="o", markersize=3,
                        label=f"{name} eval")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if key == "loss" or len(runs) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    return fig


def plot(folders: list[Path], out: Path) -> Path:
    fig = figure({folder.name: read_run(folder) for folder in folders})
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (train.output_dir)")
    parser.add_argument("-o", "--out", type=Path, help="the PNG (default RUN_DIR/metrics.png, or runs.png)")
    args = parser.parse_args(argv)
    out = args.out or (args.runs[0] / "metrics.png" if len(args.runs) == 1 else Path("runs.png"))
    try:
        print(plot(args.runs, out))
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
