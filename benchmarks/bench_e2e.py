"""Whole training steps on one GPU, ours vs transformers (+PEFT), measured side by side in one run.

    python -m benchmarks.bench_e2e [--preset qwen3-30b-a3b] [--mode lora|full] [--layers N] [--seq 8192]
        [--steps 5] [--warmup 2] [--attn auto] [--experts NAME] [--master-dtype fp32|bf16] [--loss-impl NAME]
        [--compile] [--set key=value ...] [--no-baseline] [--profile] [--tag NAME] [--out DIR]
    python -m benchmarks.bench_e2e --dry     # CPU smoke run: tiny model, fp32, both sides

Model: `--preset` at its real dimensions (qwen3-30b-a3b: 128 experts top-8; qwen3.5-35b-a3b: hybrid Gated
DeltaNet + gated attention 3:1, 256 experts + shared expert) with `--layers` decoder layers (default 12
for lora, 8 for full), random init. Data: one packed row of `--seq` random token ids (seed 0) forming one
document, labels = the next tokens, micro-batch 1; both sides get the same ids. No activation
checkpointing; on CUDA bf16 autocast.

Ours is built and stepped by the trainer's own functions (build_model, parallelize, build_optimizer,
train_step) from a Config whose knobs the flags set as dotted overrides (`--set` any
other). LoRA r=16 alpha=32 on q/k/v/o_proj + experts (fp32 factors, bf16 base); full: bf16 base, masters
per optim.master_dtype. The baseline (benchmarks/baselines/transformers_model.py): transformers'
model with SDPA and grouped_mm experts, bf16 parameters, PEFT LoRA with the same targets (fp32 adapters)
or every parameter trained; HF's own loss (labels passed; the same mean cross-entropy over the S-1
predicted tokens, on fp32 logits); grad-norm clipping at 1.0 as HF's Trainer; fused AdamW. Both: lr 1e-5,
betas (0.9, 0.95), no weight decay.

Each side runs in its own subprocess, one after the other (its peak memory is its own; an OOM ends only
that side); the parent prints the table and the ratios. Per side: ms/step (median of the steady steps,
each between CUDA events from an idle GPU, its loss read on the host), back-to-back ms/step (the mean of
`--steps` steps queued one after another with one sync at the end, as a training loop that reads its
numbers late runs them: the host prepares a step while the GPU computes the one before), tokens/s, MFU
(runtime.observe.metrics.flops_per_token of the same config for both sides, 6 x active parameters + attention,
against the device's dense bf16 peak), peak GiB (max allocated over the whole run, build and warmup included, as a user sees it), step-1 seconds
(build start to the end of step 1). `--profile` (ours): torch.profiler over 2 steady steps: the top 15
CUDA kernels, the GPU's busy share of a step, and a chrome trace OUT/<name>_trace.json.gz.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from attention.gdn import GatedDeltaNet
from benchmarks.harness import SHAPES, Column, Report, event_times_ms, steady_ms, wall_times_ms
from runtime.config import config_from_dict
from runtime.data.packing import Batch
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.parallelize import parallelize
from runtime.distributed.process_group import DistEnv
from runtime.models.factory import build_model
from runtime.models.hf import config_from_hf
from runtime.observe.metrics import device_peak_flops, flops_per_token
from runtime.optim import build_optimizer
from runtime.plan import plan
from runtime.train import train_step

ROOT = Path(__file__).resolve().parents[1]
# The tokenizer and data files only satisfy the Config schema: the bench feeds its own token ids.
TOKENIZER, DATA = ROOT / "examples/tiny/tokenizer", ROOT / "examples/tiny/data/train.jsonl"
LR, BETAS, SEED = 1e-5, (0.9, 0.95), 0
LORA = {"enabled": True, "rank": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]}
# Qwen3.5-35B-A3B's Gated DeltaNet dimensions; tiny ones for --dry.
GDN_DIMS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
TINY_GDN_DIMS = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                 "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}


# ----------------------------------------------------------------------------- model configs


def qwen3_moe_config(layers: int, tiny: bool = False) -> dict:
    """Qwen3-30B-A3B's HF config with `layers` decoder layers (tiny: harness' tiny shape)."""
    s = SHAPES["tiny" if tiny else "qwen3-30b-a3b"]
    return {"model_type": "qwen3_moe", "vocab_size": 1024 if tiny else 151936, "hidden_size": s.hidden,
            "num_hidden_layers": layers, "num_attention_heads": s.q_heads, "num_key_value_heads": s.kv_heads,
            "head_dim": s.head_dim, "intermediate_size": 4 * s.hidden if tiny else 6144,
            "moe_intermediate_size": s.intermediate, "num_experts": s.experts, "num_experts_per_tok": s.top_k,
            "norm_topk_prob": True, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def qwen3_5_moe_config(layers: int, tiny: bool = False) -> dict:
    """Qwen3.5-35B-A3B's text config with `layers` layers, every fourth one gated attention, the rest GDN."""
    s = SHAPES["tiny" if tiny else "qwen3.5-35b-a3b"]
    return {"model_type": "qwen3_5_moe_text", "vocab_size": 1024 if tiny else 248320, "hidden_size": s.hidden,
            "num_hidden_layers": layers,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
            "num_attention_heads": s.q_heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
            "moe_intermediate_size": s.intermediate, "shared_expert_intermediate_size": s.intermediate,
            "num_experts": s.experts, "num_experts_per_tok": s.top_k, **(TINY_GDN_DIMS if tiny else GDN_DIMS),
            "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}


PRESETS = {"qwen3-30b-a3b": qwen3_moe_config, "qwen3.5-35b-a3b": qwen3_5_moe_config}


def hf_config(args) -> dict:
    return PRESETS[args.preset](args.layers, tiny=args.dry)


def token_ids(vocab: int, seq: int) -> torch.Tensor:
    """[1, seq] random token ids, the same on both sides (a CPU generator from a fixed seed)."""
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(SEED))


# ----------------------------------------------------------------------------- timing one side


@dataclass
class Setup:
    """A built side: `launch()` queues one optimizer step and returns its loss unread; `read` reads it."""

    launch: Callable[[], object]
    read: Callable[[object], float]
    note: str
    model: torch.nn.Module | None = None  # ours: the model the steps train

    def step(self) -> float:
        """One step, its loss read (waits for the step's end)."""
        return self.read(self.launch())


def measure(build, args, device: torch.device, flops_tok: float) -> dict:
    """Builds a side, runs warmup + steps, and returns its numbers (step 1 counts as warmup)."""
    start = time.perf_counter()
    setup = build()
    build_gib = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None
    first_loss = setup.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_step_s = time.perf_counter() - start
    losses = []
    timer = event_times_ms if device.type == "cuda" else wall_times_ms  # --dry runs on the CPU beside a GPU too
    times = timer(lambda: losses.append(setup.step()), args.steps, max(args.warmup - 1, 0))
    ms = statistics.median(times)
    b2b_ms = steady_ms(setup.launch, args.steps, warmup=1)
    peak = device_peak_flops(device)
    result = {"ms": ms, "b2b_ms": b2b_ms, "tok_s": args.seq / ms * 1e3,
              "mfu": flops_tok * args.seq / ms * 1e3 / peak if peak else None,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
              "build_gib": build_gib, "first_step_s": first_step_s, "loss1": first_loss, "loss": losses[-1],
              "times_ms": times, "note": setup.note}
    if args.profile and args.side == "ours":
        result["note"] += "; " + profile(setup.step, args, ms, device.type == "cuda")
    return result


def profile(step, args, step_ms: float, cuda: bool, steps: int = 2, top: int = 15) -> str:
    """Prints the top kernels of `steps` profiled steps (CPU ops by self time on the CPU), writes the chrome
    trace under --out, and returns the GPU's busy share of a step (kernel intervals merged)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    profiled_ms = (time.perf_counter() - start) * 1e3 / steps
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    # GPU-side user annotations (e.g. "Optimizer.step#...") span kernels that are counted on their own
    events = [e for e in prof.events() if e.device_type == kind and not e.is_user_annotation]
    # A kernel's own time; on the CPU an op's time less its children's, so nested ops are not counted twice.
    us = [e.time_range.elapsed_us() if cuda else e.self_cpu_time_total for e in events]
    totals = defaultdict(float)
    for e, t in zip(events, us, strict=True):
        totals[e.name] += t
    print(f"== top {top} {'CUDA kernels' if cuda else 'CPU ops'} of {steps} profiled steps ({profiled_ms:.1f} ms "
          f"each under the profiler); ms per step, % of the {step_ms:.1f} ms median step")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        per_step = t / 1e3 / steps
        print(f"  {per_step:9.2f} ms  {100 * per_step / step_ms:5.1f}%  {name[:100]}")
    if args.out:
        trace = Path(args.out) / f"{report_name(args)}_trace.json.gz"
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        print(f"== chrome trace: {trace}")
    if not cuda:
        return "profiled (CPU)"
    busy = _merged_us(events) / 1e3 / steps
    print(f"== GPU busy {busy:.1f} ms of the {step_ms:.1f} ms step ({100 * busy / step_ms:.0f}%); the rest is the "
          "GPU waiting on the host (launches, syncs)")
    return f"GPU busy {100 * busy / step_ms:.0f}% of a step"


def _merged_us(events) -> float:
    """Time covered by at least one of the events (overlapping kernels on several streams count once)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.time_range.start):
        start, stop = e.time_range.start, e.time_range.end
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


# ----------------------------------------------------------------------------- the two sides


def overrides(args) -> dict:
    """The flags as dotted Config keys; None leaves the Config's default (config_from_dict skips it)."""
    out = {"model.attn_backend": args.attn, "model.expert_backend": args.experts,
           "optim.master_dtype": args.master_dtype, "model.loss_impl": args.loss_impl,
           "compile.enabled": True if args.compile else None}
    for item in args.set:
        key, _, value = item.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def our_config(args, hf: dict):
    """The Config a user would write for this run: random init from `hf`, no AC, micro-batch 1."""
    raw = {"model": {"config": hf, "dtype": "float32" if args.dry else "bfloat16"},
           "data": {"path": str(DATA), "tokenizer": str(TOKENIZER), "seq_len": args.seq},
           "lora": LORA if args.mode == "lora" else {"enabled": False},
           "parallelism": {"activation_checkpoint": "none"},
           "optim": {"lr": LR, "betas": list(BETAS), "weight_decay": 0.0, "warmup_steps": 0},
           "train": {"max_steps": args.warmup + args.steps, "micro_batch_size": 1, "seed": SEED},
           "checkpoint": {"save_final": False}, "logging": {"progress_bar": False, "jsonl": False}}
    return config_from_dict(raw, overrides(args), source="bench_e2e")


def one_document_batch(ids: torch.Tensor):
    """The collator's Batch of one row holding one document: positions 0..S-1, cu_seqlens [0, S]."""
    S = ids.shape[1]
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    return Batch(input_ids=ids, labels=labels, position_ids=torch.arange(S).unsqueeze(0),
                 cu_seqlens=torch.tensor([0, S], dtype=torch.int32), max_seqlen=S, num_label_tokens=S - 1)


def build_ours(args, hf: dict, device: torch.device) -> Setup:
    cfg = plan(our_config(args, hf), 1, device).config  # every auto resolved as a launch would (compile.enabled)
    env, dims = DistEnv(0, 1, 0, device), ParallelDims(1, 1, 1, 1, 1)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, env, dims)
    parallelize(model, dims, None, cfg)
    optimizer, scheduler = build_optimizer(model, cfg, device)
    batch = one_document_batch(token_ids(hf["vocab_size"], args.seq))

    def launch():
        launched = train_step(model, [batch], optimizer, cfg, env)
        scheduler.step()
        return launched

    return Setup(launch, lambda launched: launched.result().loss,
                 f"{trainable(model)}, {implementations(cfg, model, device)}", model)


def implementations(cfg, model: torch.nn.Module, device: torch.device) -> str:
    """What our side runs: the model's implementation names (runtime.plan resolved "auto" before the build)."""
    m = model.config
    gdn = next((f", gdn {layer.op_set}" for layer in model.modules() if isinstance(layer, GatedDeltaNet)), "")
    packed = f" on {cfg.quant.base_weights}" if cfg.quant.base_weights != "none" else ""
    return (f"experts {m.expert_backend}{packed}, attn {m.attn_backend}{gdn}, loss {m.loss_impl}"
            + (f", fp8 training {cfg.quant.train_fp8}" if cfg.quant.train_fp8 != "none" else "")
            + (", compiled" if cfg.compile.enabled else ""))


def build_baseline(args, hf: dict, device: torch.device) -> Setup:
    from benchmarks.baselines.transformers_model import transformers_model  # here: ours never imports peft

    torch.manual_seed(SEED)
    cuda = device.type == "cuda"
    model, note = transformers_model(hf, device, args.mode, torch.bfloat16 if cuda else torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=0.0, fused=cuda)
    ids = token_ids(hf["vocab_size"], args.seq)

    def launch() -> torch.Tensor:
        batch = ids.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Setup(launch, lambda loss: loss.item(), f"{trainable(model)}, {note}")


def trainable(model: torch.nn.Module) -> str:
    """What trains, as it ended up (not as configured): parameter count and dtypes."""
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))
    return f"trains {sum(p.numel() for p in params) / 1e6:.1f}M {dtypes}"


def run_side(args) -> None:
    """Child process: one side, its numbers (or its error) written as JSON to args.result."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry else "cpu")
    if args.dry:  # tiny matmuls gain nothing from threads, and on a busy CPU their barriers cost seconds
        torch.set_num_threads(1)
    hf = hf_config(args)
    flops_tok = flops_per_token(config_from_hf(hf), args.seq)
    build = {"ours": build_ours, "baseline": build_baseline}[args.side]
    try:
        result = measure(lambda: build(args, hf, device), args, device, flops_tok)
    except Exception as exc:  # noqa: BLE001 - an OOM or a failing build becomes the row's note, not a lost table
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        result = {"error": f"{type(exc).__name__}: {exc}"[:300], "peak_gib": peak}
        print(f"{args.side} failed: {result['error']}", file=sys.stderr)
    Path(args.result).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- parent: both sides, the table


COLUMNS = [Column("side", "side", width=8), Column("mode", "mode", width=4), Column("ms", "ms/step", ".1f", 9),
           Column("b2b_ms", "b2b ms", ".1f", 8),
           Column("tok_s", "tokens/s", ".0f", 9), Column("mfu", "MFU", ".3f"), Column("peak_gib", "peak GiB", ".2f"),
           Column("build_gib", "model GiB", ".2f"), Column("first_step_s", "step-1 s", ".1f"),
           Column("loss1", "loss1", ".3f")]


def report_name(args) -> str:
    return "bench_e2e" + (f"_{args.tag}" if args.tag else "")


def spawn(side: str, argv: list[str]) -> dict:
    """Runs this bench with the same flags for one side in a fresh process; returns its result."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.bench_e2e", *argv, "--side", side, "--result", str(result)]
        rc = subprocess.run(cmd, check=False, cwd=ROOT).returncode
        if result.is_file():
            return json.loads(result.read_text())
        return {"error": f"process ended with exit code {rc} before writing its result (killed? see its log)"}


def compare(args) -> None:
    sides = ["ours"] + ([] if args.no_baseline else ["baseline"])
    results = {side: spawn(side, args.argv) for side in sides}
    # The report (device facts) only now: querying the device earlier would hold a CUDA context in this
    # process, in the memory the sides measure.
    report = Report(report_name(args), COLUMNS, args.out)
    report.meta.update(preset=args.preset, layers=args.layers, seq=args.seq, steps=args.steps, warmup=args.warmup,
                       overrides={k: v for k, v in overrides(args).items() if v is not None})
    report.header(f"{args.preset}, {args.layers} layers, {args.mode}, one row of {args.seq} tokens, "
                  f"{args.warmup} warmup + {args.steps} steps")
    for side, r in results.items():
        report.add({"side": side, "mode": args.mode, **r, "note": r.get("error") or r.get("note")})
    ours, base = results["ours"], results.get("baseline")
    if base is not None:
        print(ratio_line(ours, base))


def ratio_line(ours: dict, base: dict) -> str:
    if "error" in ours or "error" in base:
        return "ratio ours/baseline: n/a (a side failed)"

    def gib(r):
        return "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"

    return (f"ratio ours/baseline tokens/s = {ours['tok_s'] / base['tok_s']:.2f}x "
            f"(back to back {base['b2b_ms'] / ours['b2b_ms']:.2f}x); memory {gib(ours)} GiB vs {gib(base)} GiB")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    ap.add_argument("--mode", choices=["lora", "full"], default="lora")
    ap.add_argument("--layers", type=int, help="decoder layers (default 12 for lora, 8 for full)")
    ap.add_argument("--seq", type=int, default=8192, help="tokens of the one packed row")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (step 1 is one of them)")
    ap.add_argument("--attn", default="auto", help="model.attn_backend")
    ap.add_argument("--experts", help="model.expert_backend (default: the Config's)")
    ap.add_argument("--master-dtype", choices=["fp32", "bf16"], help="optim.master_dtype (default: the Config's)")
    ap.add_argument("--loss-impl", help="model.loss_impl (passed only when given)")
    ap.add_argument("--compile", action="store_true", help="compile.enabled: true (default auto: compiled for LoRA)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other Config key, dotted (value read as YAML); repeatable")
    ap.add_argument("--no-baseline", action="store_true", help="ours only")
    ap.add_argument("--profile", action="store_true", help="ours: top kernels of 2 steady steps + chrome trace")
    ap.add_argument("--tag", default="", help="names the output: OUT/bench_e2e_<tag>.json")
    ap.add_argument("--dry", action="store_true", help="CPU smoke run: tiny model, 64 tokens, fp32, 2 steps")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--side", choices=["ours", "baseline"], help=argparse.SUPPRESS)  # set by the parent
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the children get the same flags
    if args.dry:
        args.seq, args.steps, args.warmup = 64, 2, 1
    if args.layers is None:
        # --dry: 4 layers, so a hybrid stack holds one gated-attention layer
        args.layers = 4 if args.dry else (12 if args.mode == "lora" else 8)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1 (step 1 compiles and autotunes: it is never timed)")
    return args


def main() -> None:
    args = parse_args()
    if args.side:
        run_side(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
