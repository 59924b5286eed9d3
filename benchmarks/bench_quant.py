"""FP4 expert weights: quantization error and storage per format, on a real checkpoint's experts or on the
random init at a real model's expert shape.

    python -m benchmarks.bench_quant [--checkpoint HF_DIR --layers 0 1] [--shape qwen3-30b-a3b] [--experts 16]
                                     [--device cpu|cuda] [--out DIR]

Per format and projection (gate_up, down): the norm-relative error ||dq(q(w)) - w|| / ||w|| (Frobenius,
fp32), the largest error relative to max |w|, bits per weight held (codes + block scales + tensor scales)
and the time to quantize (the load-time cost; meaningful on the device it ran on). Without --checkpoint,
the weights are drawn as the seeded init draws them (normal, std 0.02), --experts of them.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import SHAPES, Column, Report
from quant import FORMATS, FP4Weight

COLUMNS = [Column("source", "source", width=18), Column("proj", "proj", width=7), Column("fmt", "fmt", width=6),
           Column("rel_err", "rel err", ".4f"), Column("max_err", "max err / max|w|", ".4f"),
           Column("bits", "bits/weight", ".3f"), Column("quant_s", "quantize s", ".3f")]


def random_experts(shape: str, experts: int, device: str) -> dict[str, torch.Tensor]:
    s = SHAPES[shape]
    gen = torch.Generator(device).manual_seed(0)
    def draw(*dims):
        return torch.empty(*dims, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
    return {"gate_up": draw(experts, 2 * s.intermediate, s.hidden), "down": draw(experts, s.hidden, s.intermediate)}


def checkpoint_experts(path: str, layer: int, device: str) -> dict[str, torch.Tensor]:
    from runtime.models.hf import SafetensorsCheckpoint
    with SafetensorsCheckpoint(path) as ckpt:
        prefix = f"model.layers.{layer}.mlp.experts"
        fused = f"{prefix}.gate_up_proj"
        if fused in ckpt:
            t = ckpt.read({fused: None, f"{prefix}.down_proj": None})
            return {"gate_up": t[fused].to(device), "down": t[f"{prefix}.down_proj"].to(device)}
        stored = ckpt.keys()
        keys = sorted({k.split(".")[5] for k in stored if k.startswith(prefix + ".")}, key=int)
        def stack(*parts):
            names = [f"{prefix}.{e}.{p}.weight" for e in keys for p in parts]
            t = ckpt.read(dict.fromkeys(names))
            return torch.stack([torch.cat([t[f"{prefix}.{e}.{p}.weight"] for p in parts]) for e in keys]).to(device)
        return {"gate_up": stack("gate_proj", "up_proj"), "down": stack("down_proj")}


def measure(source: str, weights: dict[str, torch.Tensor], report: Report) -> None:
    for proj, w in weights.items():
        for fmt in FORMATS:
            if w.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            packed = FP4Weight.from_dense(w, fmt)
            if w.is_cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            err = packed.dequantize(torch.float32) - w.float()
            report.add({"source": source, "proj": proj, "fmt": fmt,
                        "rel_err": float(err.norm() / w.float().norm()),
                        "max_err": float(err.abs().max() / w.float().abs().max()),
                        "bits": packed.packed_bytes() * 8 / w.numel(), "quant_s": seconds})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a HF checkpoint folder: its experts instead of the random init")
    parser.add_argument("--layers", type=int, nargs="+", default=[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--experts", type=int, default=16, help="random init: experts drawn")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = Report("quant", COLUMNS, args.out)
    report.header("FP4 quantization error")
    if args.checkpoint:
        for layer in args.layers:
            measure(f"layer {layer}", checkpoint_experts(args.checkpoint, layer, args.device), report)
    else:
        measure(f"init {args.shape} x{args.experts}", random_experts(args.shape, args.experts, args.device), report)


if __name__ == "__main__":
    main()
