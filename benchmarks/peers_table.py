"""Issue 43's one-GPU LoRA table from one call of `bash benchmarks/gpu_e2e.sh peers`: ours (default config)
against Unsloth and transformers+PEFT on the same work, card and call.

    python -m benchmarks.peers_table --e2e OUT/bench_e2e_peers.json --unsloth OUT/unsloth_peers.txt

--e2e: bench_e2e JSONs (rows `ours` and `baseline`, mode lora). --unsloth: text files holding the JSON lines of
benchmarks/peers/unsloth/unsloth_train.py (`{"who": "unsloth-lora", ...}`; every other line is ignored, so its
log or run_unsloth.sh's output will do). Sides are matched by layer count, and each layer count must have the
same model (bench_e2e's preset), seq and card on every side. Prints one markdown table: per side ms/step (median
of steps each from an idle GPU), back-to-back ms/step (steps queued one after another, as training loops run them), peak GiB, tokens/s and
trained parameters; steps/s ratios (same seq on every side, so the inverse ratio of ms/step: back to back where
both sides have it, else the medians); and for ours the issue's targets: >= 1.25x Unsloth's steps/s at <= its
peak memory, and >= 2.4x transformers+PEFT.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

OVER_UNSLOTH, OVER_PEFT = 1.25, 2.4  # issue 43's targets, steps/s ratios
OURS, UNSLOTH, PEFT = "ours", "Unsloth", "transformers+PEFT"
# The checkpoint's model_type that unsloth_train.py reports -> bench_e2e's preset of that model.
PRESET_OF_MODEL_TYPE = {"qwen3_moe": "qwen3-30b-a3b", "qwen3_5_moe_text": "qwen3.5-35b-a3b"}
_TRAINS = re.compile(r"trains ([0-9.]+)M")


@dataclass(frozen=True)
class Side:
    """One side's numbers for one layer count; ms None when the side failed (note says why)."""

    name: str
    model: str  # bench_e2e's preset
    layers: int
    seq: int
    device: str
    ms: float | None
    b2b_ms: float | None  # back to back; None where the harness did not measure it
    peak_gib: float | None
    tok_s: float | None
    trains_m: float | None  # trained parameters, millions
    timed: str  # the steps whose median ms is, e.g. "4-12"
    note: str
    source: str


def _timed(record: dict) -> str:
    """The timed steps, counting step 1 among the warmup ones (both harnesses' rule)."""
    return f"{record['warmup'] + 1}-{record['warmup'] + record['steps']}"


def read_e2e(path: Path) -> list[Side]:
    """Ours and transformers+PEFT from a bench_e2e JSON (benchmarks.harness.Report's record)."""
    if not path.is_file():
        raise SystemExit(f"peers_table: {path} missing: bench_e2e did not finish (see e2e_<tag>.log beside it)")
    record = json.loads(path.read_text())
    sides = []
    for row in record["rows"]:
        if row.get("mode") != "lora":
            raise SystemExit(f"peers_table: {path} holds a {row.get('mode')} run; run bench_e2e with --mode lora")
        trains = _TRAINS.search(row.get("note") or "")
        sides.append(Side(name={"ours": OURS, "baseline": PEFT}[row["side"]], model=record["preset"],
                          layers=record["layers"],
                          seq=record["seq"], device=record["device"], ms=None if "error" in row else row["ms"],
                          b2b_ms=row.get("b2b_ms"),
                          peak_gib=row.get("peak_gib"), tok_s=row.get("tok_s"),
                          trains_m=float(trains[1]) if trains else None, timed=_timed(record),
                          note=row.get("error") or row.get("note") or "", source=str(path)))
    return sides


def read_unsloth(path: Path) -> list[Side]:
    """Unsloth's runs of LoRA on attention + experts: the `{"who": "unsloth-lora", ...}` lines of a text file."""
    if not path.is_file():
        raise SystemExit(f"peers_table: {path} missing: run benchmarks/peers/unsloth/run_unsloth.sh first")
    sides = []
    for line in path.read_text().splitlines():
        if not line.startswith('{"who"'):
            continue
        r = json.loads(line)
        if r["who"] != "unsloth-lora":  # the attention-only variant is other work
            continue
        note = (f"unsloth {r.get('unsloth')}, moe {r.get('moe_backend')}, attn {r.get('attn')}, "
                f"lora {'/'.join(r.get('lora_dtype') or [])}, step 1 {r.get('first_step_s')} s")
        # lines from before the hybrid rows name no model: they were all Qwen3-30B-A3B's
        model = PRESET_OF_MODEL_TYPE.get(r.get("model_type", "qwen3_moe"), r.get("model_type"))
        sides.append(Side(name=UNSLOTH, model=model, layers=r["layers"], seq=r["seq"], device=r["gpu"],
                          ms=r["step_ms_median"], b2b_ms=r.get("step_ms_b2b"),
                          peak_gib=r.get("peak_gib"), tok_s=r["tok_s"], trains_m=r["trainable"] / 1e6,
                          timed=_timed(r), note=note, source=str(path)))
    return sides


def ratio(faster: Side | None, slower: Side | None) -> float | None:
    """Steps/s of `faster` over `slower` (same seq: slower's ms over faster's), back to back where both have it;
    None when either has no time."""
    if faster is None or slower is None or faster.ms is None or slower.ms is None:
        return None
    if faster.b2b_ms and slower.b2b_ms:
        return slower.b2b_ms / faster.b2b_ms
    return slower.ms / faster.ms


def target_unsloth(ours: Side, unsloth: Side | None) -> str:
    """PASS when ours reaches OVER_UNSLOTH x Unsloth's steps/s at no more than Unsloth's peak memory."""
    r = ratio(ours, unsloth)
    if r is None:
        return "n/a"
    if ours.peak_gib is None or unsloth.peak_gib is None:
        return f"n/a ({r:.2f}x, no peak)"
    fails = ([f"{r:.2f}x"] if r < OVER_UNSLOTH else []) + \
        ([f"peak {ours.peak_gib:.1f} > {unsloth.peak_gib:.1f} GiB"] if ours.peak_gib > unsloth.peak_gib else [])
    return f"FAIL ({', '.join(fails)})" if fails else "PASS"


def target_peft(ours: Side, peft: Side | None) -> str:
    r = ratio(ours, peft)
    if r is None:
        return "n/a"
    return "PASS" if r >= OVER_PEFT else f"FAIL ({r:.2f}x)"


def _one(sides: list[Side], name: str, layers: int) -> Side | None:
    found = [s for s in sides if s.name == name and s.layers == layers]
    if len(found) > 1:
        raise SystemExit(f"peers_table: {len(found)} {name} results for {layers} layers "
                         f"({', '.join(sorted({s.source for s in found}))}): pass one file per layer count")
    return found[0] if found else None


def _check_same_work(layers: int, sides: list[Side]) -> None:
    for key in ("model", "seq", "device", "timed"):
        values = {f"{s.name} {getattr(s, key)}" for s in sides}
        if len({getattr(s, key) for s in sides}) > 1:
            raise SystemExit(f"peers_table: {layers} layers: not the same {key} on every side "
                             f"({', '.join(sorted(values))}); measure all three in one call (gpu_e2e.sh peers)")


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(e2e: list[Path], unsloth: list[Path]) -> str:
    """The markdown table of every layer count the bench_e2e files hold."""
    sides = [s for p in e2e for s in read_e2e(p)] + [s for p in unsloth for s in read_unsloth(p)]
    header = ["layers", "run", "ms/step", "b2b ms", "peak GiB", "tokens/s", "trains M", "vs Unsloth",
              "vs transformers+PEFT",
              f">= {OVER_UNSLOTH}x Unsloth at <= its peak", f">= {OVER_PEFT}x transformers+PEFT", "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---:"] + ["---"] + ["---:"] * 7 + ["---"] * 3) + "|"]
    captions = set()
    for layers in sorted({s.layers for s in sides if s.name == OURS}):
        ours, uns, peft = (_one(sides, n, layers) for n in (OURS, UNSLOTH, PEFT))
        _check_same_work(layers, [s for s in (ours, uns, peft) if s is not None])
        captions.add(f"{ours.model} on {ours.device}, {ours.seq} tokens, median of steps {ours.timed}")
        for name, s in ((PEFT, peft), (UNSLOTH, uns), (OURS, ours)):
            if s is None:
                where = unsloth if name == UNSLOTH else e2e
                lines.append(f"| {layers} | {name} |" + " - |" * 9 + f" no result in {', '.join(map(str, where))} |")
                continue
            targets = [target_unsloth(s, uns), target_peft(s, peft)] if s is ours else ["-", "-"]
            cells = [str(layers), s.name, _cell(s.ms, ".1f"), _cell(s.b2b_ms, ".1f"), _cell(s.peak_gib, ".2f"),
                     _cell(s.tok_s, ".0f"),
                     _cell(s.trains_m, ".1f"), "-" if s is uns else _x(ratio(s, uns)), _x(ratio(s, peft)), *targets,
                     s.note.replace("|", "/")]
            lines.append("| " + " | ".join(cells) + " |")
    if not captions:
        raise SystemExit(f"peers_table: no `ours` row in {', '.join(map(str, e2e))}")
    return ("\n".join(lines) + f"\n\n{'; '.join(sorted(captions))}; ratios are steps/s (the row's over the "
            "column's), back to back where both have it.")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e", nargs="+", type=Path, required=True, help="bench_e2e JSON(s), --mode lora")
    ap.add_argument("--unsloth", nargs="+", type=Path, required=True, help="files holding unsloth_train.py's lines")
    args = ap.parse_args(argv)
    print(table(args.e2e, args.unsloth))


if __name__ == "__main__":
    sys.exit(main())
