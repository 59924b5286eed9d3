"""Issue 43's peer baseline: benchmarks/peers_table.py reads bench_e2e's JSON (written by its own Report, and by a
real --dry run: test_bench_e2e's, through check_table_of_a_real_dry_run) and unsloth_train.py's JSON lines, and computes the steps/s ratios and the targets right; the
Unsloth scripts run the same work as bench_e2e (dims, token ids)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from benchmarks.harness import Report, device_info
from benchmarks.peers_table import main, table
from tests.conftest import Forked

ROOT = Path(__file__).resolve().parents[2]
UNSLOTH_DIR = ROOT / "benchmarks/peers/unsloth"
DEVICE = device_info()["device"]  # what Report records as the card
NOTE = "trains 110.3M float32, experts grouped_mm, attn sdpa, loss chunked"


def write_e2e(out: Path, ours: tuple, base: tuple | None, layers: int = 8, seq: int = 8192, warmup: int = 3,
              steps: int = 9, ours_error: str | None = None, preset: str = "qwen3-30b-a3b") -> Path:
    """A bench_e2e JSON through the Report bench_e2e writes with, rows composed as its compare() does;
    ours/base: (ms, GiB)."""
    report = Report(f"bench_e2e_L{layers}", [], str(out), printing=False)  # columns only print
    report.meta.update(preset=preset, layers=layers, seq=seq, steps=steps, warmup=warmup)
    sides = {"ours": ours} if base is None else {"ours": ours, "baseline": base}
    for side, (ms, gib) in sides.items():
        r = {"ms": ms, "tok_s": seq / ms * 1e3, "peak_gib": gib, "note": NOTE}
        if side == "ours" and ours_error:
            r = {"error": ours_error, "peak_gib": gib}
        report.add({"side": side, "mode": "lora", **r, "note": r.get("error") or r.get("note")})
    return report.path


def unsloth_line(ms: float, gib: float | None, layers: int = 8, seq: int = 8192, who: str = "unsloth-lora",
                 gpu: str = DEVICE, warmup: int = 3, steps: int = 9, trainable: int = 170_000_000,
                 model_type: str | None = None) -> str:
    """One line as unsloth_train.py prints it (the fields the table reads, and a few it does not); without
    model_type, as it printed before the hybrid rows."""
    return json.dumps({"who": who, **({"model_type": model_type} if model_type else {}), "layers": layers,
                       "seq": seq, "warmup": warmup, "steps": steps,
                       "step_ms_median": ms, "tok_s": round(seq / ms * 1e3), "trainable": trainable, "peak_gib": gib,
                       "loss": 11.9, "first_step_s": 49.0, "gpu": gpu, "unsloth": "2026.10.9",
                       "moe_backend": "grouped_mm", "attn": "sdpa", "lora_dtype": ["bfloat16"]})


def write_unsloth(out: Path, *lines: str) -> Path:
    """run_unsloth.sh's output: progress lines around the JSON lines."""
    path = out / "unsloth_peers.txt"
    path.write_text("\n".join(["NVIDIA H200, 1980 MHz, 120 W", "[wheels installed 4 s]", *lines,
                               "[experts rc=0 118 s]", "[unsloth_train   12.0s] step 1: 49012 ms, loss 11.9"]) + "\n")
    return path


def parse(markdown: str) -> dict[tuple[str, str], dict[str, str]]:
    """(layers, run) -> {column header: cell} of the printed markdown table."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "").replace("-", "").replace(":", "")) == set()  # the alignment row
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[(cells["layers"], cells["run"])] = cells
    return rows


def test_ratios_are_back_to_back_where_both_sides_have_it(tmp_path):
    e2e = write_e2e(tmp_path, ours=(100.0, 19.0), base=(250.0, 46.4))
    line = json.loads(unsloth_line(130.0, 19.5))
    rows = parse(table([e2e], [write_unsloth(tmp_path, json.dumps({**line, "step_ms_b2b": 120.0}))]))
    assert rows["8", "Unsloth"]["b2b ms"] == "120.0" and rows["8", "ours"]["b2b ms"] == "-"
    assert rows["8", "ours"]["vs Unsloth"] == "1.30x"  # ours has no back-to-back time: the medians
    record = json.loads(e2e.read_text())
    for row, b2b in zip(record["rows"], (90.0, 240.0)):
        row["b2b_ms"] = b2b
    e2e.write_text(json.dumps(record))
    rows = parse(table([e2e], [write_unsloth(tmp_path, json.dumps({**line, "step_ms_b2b": 120.0}))]))
    assert (rows["8", "ours"]["vs Unsloth"], rows["8", "ours"]["vs transformers+PEFT"]) == ("1.33x", "2.67x")


def test_ratios_and_targets_pass(tmp_path):
    e2e = write_e2e(tmp_path, ours=(100.0, 19.0), base=(250.0, 46.4))
    rows = parse(table([e2e], [write_unsloth(tmp_path, unsloth_line(130.0, 19.5))]))
    assert list(rows) == [("8", "transformers+PEFT"), ("8", "Unsloth"), ("8", "ours")]
    ours, uns, peft = rows["8", "ours"], rows["8", "Unsloth"], rows["8", "transformers+PEFT"]
    assert (ours["ms/step"], ours["peak GiB"], ours["tokens/s"], ours["trains M"]) == ("100.0", "19.00", "81920", "110.3")
    assert (ours["vs Unsloth"], ours["vs transformers+PEFT"]) == ("1.30x", "2.50x")
    assert (uns["vs Unsloth"], uns["vs transformers+PEFT"], uns["trains M"]) == ("-", "1.92x", "170.0")
    assert (peft["vs Unsloth"], peft["vs transformers+PEFT"]) == ("0.52x", "1.00x")
    assert ours[">= 1.25x Unsloth at <= its peak"] == "PASS" and ours[">= 2.4x transformers+PEFT"] == "PASS"
    assert uns[">= 1.25x Unsloth at <= its peak"] == "-" and "moe grouped_mm" in uns["note"]


@pytest.mark.parametrize(("uns_ms", "uns_gib", "peft_ms", "want_uns", "want_peft"), [
    (125.0, 19.0, 240.0, "PASS", "PASS"),  # both exactly on the target, the same peak
    (124.0, 19.5, 239.0, "FAIL (1.24x)", "FAIL (2.39x)"),
    (130.0, 18.9, 300.0, "FAIL (peak 19.0 > 18.9 GiB)", "PASS"),  # fast enough, over Unsloth's memory
    (110.0, 18.0, 200.0, "FAIL (1.10x, peak 19.0 > 18.0 GiB)", "FAIL (2.00x)"),
])
def test_target_edges(tmp_path, uns_ms, uns_gib, peft_ms, want_uns, want_peft):
    e2e = write_e2e(tmp_path, ours=(100.0, 19.0), base=(peft_ms, 46.4))
    ours = parse(table([e2e], [write_unsloth(tmp_path, unsloth_line(uns_ms, uns_gib))]))["8", "ours"]
    assert ours[">= 1.25x Unsloth at <= its peak"] == want_uns
    assert ours[">= 2.4x transformers+PEFT"] == want_peft


def test_a_failed_or_missing_side_is_a_row_not_a_crash(tmp_path):
    e2e = write_e2e(tmp_path, ours=(100.0, 79.1), base=(250.0, 46.4), ours_error="OutOfMemoryError: CUDA out of memory")
    # Unsloth ended without its JSON line (run_unsloth.sh printed the log's tail); its attention-only line is other work.
    log = write_unsloth(tmp_path, "--- last lines of /tmp/out/unsloth_experts.log:", "RuntimeError: boom",
                        unsloth_line(90.0, 12.0, who="unsloth-lora-attn"))
    rows = parse(table([e2e], [log]))
    ours, uns = rows["8", "ours"], rows["8", "Unsloth"]
    assert ours["ms/step"] == "-" and ours["peak GiB"] == "79.10" and "OutOfMemoryError" in ours["note"]
    assert ours["vs transformers+PEFT"] == "-" and ours[">= 2.4x transformers+PEFT"] == "n/a"
    assert uns["ms/step"] == "-" and f"no result in {log}" in uns["note"]


def test_no_baseline_row_and_cpu_peaks(tmp_path):
    e2e = write_e2e(tmp_path, ours=(100.0, None), base=None)
    rows = parse(table([e2e], [write_unsloth(tmp_path, unsloth_line(140.0, None))]))
    assert rows["8", "transformers+PEFT"]["ms/step"] == "-"
    ours = rows["8", "ours"]
    assert ours[">= 1.25x Unsloth at <= its peak"] == "n/a (1.40x, no peak)" and ours[">= 2.4x transformers+PEFT"] == "n/a"


def test_several_layer_counts_in_one_table(tmp_path):
    e2e = [write_e2e(tmp_path, ours=(170.0, 28.0), base=(316.0, 60.0), layers=12),
           write_e2e(tmp_path, ours=(100.0, 19.0), base=(250.0, 46.4), layers=8)]
    lines = write_unsloth(tmp_path, unsloth_line(160.0, 27.0, layers=12), unsloth_line(130.0, 19.5))
    rows = parse(table(e2e, [lines]))
    assert [k for k in rows] == [(str(n), run) for n in (8, 12) for run in ("transformers+PEFT", "Unsloth", "ours")]
    assert rows["12", "ours"]["vs Unsloth"] == "0.94x" and rows["8", "ours"]["vs Unsloth"] == "1.30x"
    assert rows["12", "ours"][">= 1.25x Unsloth at <= its peak"] == "FAIL (0.94x, peak 28.0 > 27.0 GiB)"


@pytest.mark.parametrize(("line", "message"), [
    (unsloth_line(130.0, 19.5, seq=4096), "not the same seq"),
    (unsloth_line(130.0, 19.5, gpu="NVIDIA H200 (another)"), "not the same device"),
    (unsloth_line(130.0, 19.5, warmup=1, steps=11), "not the same timed"),
    (unsloth_line(130.0, 19.5, model_type="qwen3_5_moe_text"), "not the same model"),
])
def test_other_work_is_refused(tmp_path, line, message):
    e2e = write_e2e(tmp_path, ours=(100.0, 19.0), base=(250.0, 46.4))
    with pytest.raises(SystemExit, match=message):
        table([e2e], [write_unsloth(tmp_path, line)])


def test_the_hybrid_rows_match_by_model(tmp_path):
    """Unsloth's line names its checkpoint's model_type; the hybrid's matches bench_e2e's qwen3.5 preset, and the
    caption names the model."""
    e2e = write_e2e(tmp_path, ours=(100.0, 30.0), base=(170.0, 63.0), preset="qwen3.5-35b-a3b")
    out = table([e2e], [write_unsloth(tmp_path, unsloth_line(120.0, 31.0, model_type="qwen3_5_moe_text"))])
    assert parse(out)["8", "ours"]["vs Unsloth"] == "1.20x"
    assert f"qwen3.5-35b-a3b on {DEVICE}, 8192 tokens" in out
    with pytest.raises(SystemExit, match="not the same model"):
        table([e2e], [write_unsloth(tmp_path, unsloth_line(120.0, 31.0, model_type="qwen3_moe"))])


def test_two_results_for_one_layer_count_are_refused(tmp_path):
    e2e = write_e2e(tmp_path, ours=(100.0, 19.0), base=(250.0, 46.4))
    with pytest.raises(SystemExit, match="2 Unsloth results for 8 layers"):
        table([e2e], [write_unsloth(tmp_path, unsloth_line(130.0, 19.5), unsloth_line(131.0, 19.5))])
    with pytest.raises(SystemExit, match="bench_e2e did not finish"):
        table([tmp_path / "bench_e2e_peers.json"], [write_unsloth(tmp_path, unsloth_line(130.0, 19.5))])


def test_cli_prints_the_table(tmp_path, capsys):
    e2e = write_e2e(tmp_path, ours=(100.0, 19.0), base=(250.0, 46.4))
    main(["--e2e", str(e2e), "--unsloth", str(write_unsloth(tmp_path, unsloth_line(130.0, 19.5)))])
    out = capsys.readouterr().out
    assert parse(out)["8", "ours"]["vs Unsloth"] == "1.30x"
    assert out.rstrip().endswith(f"{DEVICE}, 8192 tokens, median of steps 4-12; ratios are steps/s (the row's over "
                                 "the column's), back to back where both have it.")


def check_table_of_a_real_dry_run(e2e: Path, out: Path) -> None:
    """peers_table over a real bench_e2e --dry JSON (test_bench_e2e's run) and an Unsloth line 1.3x slower."""
    record = json.loads(e2e.read_text())
    ours, base = (next(r for r in record["rows"] if r["side"] == side) for side in ("ours", "baseline"))
    line = unsloth_line(ours["ms"] * 1.3, None, layers=record["layers"], seq=record["seq"], gpu=record["device"],
                        warmup=record["warmup"], steps=record["steps"])
    rows = parse(table([e2e], [write_unsloth(out, line)]))
    layers = str(record["layers"])
    assert rows[layers, "ours"]["ms/step"] == f"{ours['ms']:.1f}"
    assert rows[layers, "ours"]["vs Unsloth"] == "1.30x"
    assert rows[layers, "ours"]["b2b ms"] == f"{ours['b2b_ms']:.1f}"
    assert rows[layers, "ours"]["vs transformers+PEFT"] == f"{base['b2b_ms'] / ours['b2b_ms']:.2f}x"  # both have it
    assert rows[layers, "Unsloth"]["vs transformers+PEFT"] == f"{base['ms'] / (ours['ms'] * 1.3):.2f}x"
    assert rows[layers, "ours"]["trains M"] == rows[layers, "transformers+PEFT"]["trains M"] == "0.1"


def _bench_e2e():
    from benchmarks import bench_e2e

    return bench_e2e


def _dims():
    spec = importlib.util.spec_from_file_location("peers_unsloth_dims", UNSLOTH_DIR / "dims.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
def test_unsloth_runs_the_work_of_bench_e2e(preset):
    dims, bench = _dims(), _bench_e2e()
    ours = bench.PRESETS[preset](8)
    assert {k: v for k, v in dims.hf_config(preset, 8).items() if k in ours} == ours
    assert set(dims.PRESETS) == set(bench.PRESETS)
    from benchmarks.peers_table import PRESET_OF_MODEL_TYPE

    assert PRESET_OF_MODEL_TYPE[ours["model_type"]] == preset
    assert torch.equal(dims.token_ids(151936, 8192), bench.token_ids(151936, 8192))


@pytest.mark.parametrize(("preset", "model_type"), [("qwen3-30b-a3b", "qwen3_moe"),
                                                    ("qwen3.5-35b-a3b", "qwen3_5_moe_text")])
def test_make_ckpt_writes_a_checkpoint_with_bench_e2e_ids(tmp_path, preset, model_type):
    """`python3 make_ckpt.py ...` as run_unsloth.sh runs it, in a child forked from this process
    (tests.conftest.Forked: no Python start; the script puts its own folder on sys.path for dims, as there)."""
    token_ids = _bench_e2e().token_ids
    out, script = tmp_path / "ckpt", str(UNSLOTH_DIR / "make_ckpt.py")
    layers = 4 if preset == "qwen3.5-35b-a3b" else 2  # the hybrid's fourth layer is its attention
    argv = [script, "--model", preset, "--tiny", "--device", "cpu", "--layers", str(layers), "--seq", "64",
            "--out", str(out)]
    proc = Forked(f"import runpy, sys\nsys.argv = {argv!r}\nrunpy.run_path({script!r}, run_name='__main__')",
                  tmp_path / "stderr.txt", stdout_path=tmp_path / "stdout.txt")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["layers"] == layers
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == (model_type, layers, 1024)
    want = _bench_e2e().PRESETS[preset](layers)
    if "layer_types" in want:
        assert config["layer_types"] == want["layer_types"] and "full_attention" in want["layer_types"]
    assert torch.equal(torch.load(out / "ids_64.pt"), token_ids(1024, 64))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert next(model.parameters()).dtype == torch.bfloat16 and len(model.model.layers) == layers
