"""Pictures of runs: loss (train and eval), learning rate, grad norm, tokens/s and peak memory against the
step, from each run folder's metrics.jsonl, several runs overlaid (labelled by folder name), in one PNG.

    python -m runtime.plot RUN_DIR [RUN_DIR ...] [-o OUT.png]    # default RUN_DIR/metrics.png, or ./runs.png

`figure(runs)` returns the matplotlib Figure (one axis per panel, titled; one line per run and series) for
tests and notebooks. Records are runtime.observe.metrics': training records carry "loss", eval records "eval_loss";
a null (non-finite) value is a gap in its line; a step logged twice keeps its last record; the
metrics.<stamp>.jsonl files of earlier runs in a folder are not read. The memory panel says "not recorded"
when no run logged peak_mem_gib (CPU runs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from PIL import Image  # a dependency of matplotlib
except ImportError as err:
    raise ImportError("runtime.plot needs matplotlib: pip install 'moe-runtime[plot]'") from err

# Panel layout: the loss across the top, the rest two by two. Titles name the panels (tests find them so).
LAYOUT = [["loss", "loss"], ["lr", "grad_norm"], ["tok_s", "peak_mem_gib"]]
TITLES = {"loss": "loss", "lr": "learning rate", "grad_norm": "grad norm", "tok_s": "tokens/s",
          "peak_mem_gib": "peak memory (GiB)"}
FROM_ZERO = ("tok_s", "peak_mem_gib")  # throughput and memory read as amounts: their jitter is not the story
DPI = 100


class PlotError(ValueError):
    """A folder that cannot be plotted; the message names it and why."""


def read_run(folder: Path) -> tuple[list[dict], list[dict]]:
    """(training records, eval records) of one run folder, each in step order, one record per step."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{folder} has no metrics.jsonl: not a run folder (train.output_dir), or the run had "
                        "logging.jsonl: false")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise PlotError(f"{path}:{number} is not a JSON record ({err.msg})") from None
    if not records:
        raise PlotError(f"{path} is empty: the run logged no step yet")
    return _by_step(records, "loss"), _by_step(records, "eval_loss")


def _by_step(records: list[dict], key: str) -> list[dict]:
    # A resumed run's file holds each step once (runtime.observe.metrics drops the retrained ones); should a step
    # still appear twice, the later record is the one the run went on from.
    return sorted({r["step"]: r for r in records if key in r}.values(), key=lambda r: r["step"])


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of one metric; null (non-finite when logged) becomes NaN, a gap in the line."""
    points = [(r["step"], math.nan if r[key] is None else r[key]) for r in records if key in r]
    return [s for s, _ in points], [v for _, v in points]


def figure(runs: dict[str, tuple[list[dict], list[dict]]]) -> Figure:
    """The panels of LAYOUT, every run in each; train loss solid, eval loss dashed with markers."""
    fig = Figure(figsize=(10, 7), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # raster output without pyplot: no global figure registry, no display backend
    axes = fig.subplot_mosaic(LAYOUT, sharex=True)
    for key, ax in axes.items():
        ax.set_title(TITLES[key], fontsize=10)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        for i, (name, (train, evals)) in enumerate(runs.items()):
            steps, values = _series(train, key)
            if steps:
                ax.plot(steps, values, color=f"C{i}", linewidth=1.2,
                        label=f"{name} train" if key == "loss" else name)
            if key == "loss" and evals:
                ax.plot(*_series(evals, "eval_loss"), color=f"C{i}", linestyle="--", marker="o", markersize=3,
                        linewidth=1.2, label=f"{name} eval")
        if not ax.lines:
            ax.text(0.5, 0.5, "not recorded (CPU run)" if key == "peak_mem_gib" else "not recorded",
                    transform=ax.transAxes, ha="center", va="center", color="0.5")
            ax.tick_params(left=False, labelleft=False)
            ax.grid(False)
        elif key in FROM_ZERO:
            ax.set_ylim(bottom=0)
    axes["loss"].legend(fontsize=8)  # colours are per run in every panel: one legend says which is which
    for key in LAYOUT[-1]:
        axes[key].set_xlabel("step", fontsize=9)
    return fig


def labels(folders: list[Path]) -> list[str]:
    """Folder names; the path as given where two runs share a name (out-a/run, out-b/run)."""
    names = [folder.resolve().name for folder in folders]  # resolve: "." has no name
    return [name if names.count(name) == 1 else str(folder) for name, folder in zip(names, folders)]


def plot(folders: list[Path], out: Path) -> Path:
    fig = figure({label: read_run(folder) for label, folder in zip(labels(folders), folders)})
    fig.savefig(out)
    if out.suffix.lower() == ".png":
        # Lines and text on white use few colours: a palette PNG is a third of the bytes, the same picture.
        with Image.open(out) as image:
            small = image.convert("RGB").quantize(256)
        small.save(out, optimize=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (train.output_dir)")
    parser.add_argument("-o", "--out", type=Path, help="the PNG (default RUN_DIR/metrics.png, or ./runs.png)")
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
