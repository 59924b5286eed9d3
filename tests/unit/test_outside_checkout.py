"""Tests never write into, or read run state from, the checkout (issue 41: after the README's demo left
checkpoints in outputs/tiny-qwen3-moe, a test training into the example's default train.output_dir failed)."""

from __future__ import annotations

from pathlib import Path

from runtime.config import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"


def test_relative_paths_resolve_outside_the_checkout():
    default = Path(load_config(EXAMPLE).train.output_dir)
    assert not default.is_absolute()  # what the demo writes relative to where it runs
    assert not default.resolve().is_relative_to(ROOT), f"tests run in {Path.cwd()}, inside the checkout"
