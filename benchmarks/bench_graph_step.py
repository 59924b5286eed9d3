"""How much of a training step is host work: the trainer's step queued back to back, against the same step
captured whole in one CUDA graph and replayed, on the same ranks in one run (issue 42's probe).

    torchrun --standalone --nproc_per_node N -m benchmarks.bench_graph_step CONFIG [--ep N] [--set k=v ...]
        [--steps 10] [--warmup 3]
    python -m benchmarks.bench_graph_step --dry     # CPU smoke run: the tiny example, LoRA, rows of 64; queued only

CONFIG and the flags are runtime.launch's. Data: one row of data.seq_len random token ids per rank (one document,
every next token a label), or with `--data config` the first packed row of the config's data (its documents,
its label mask), the same every step. Queued: runtime.step.train_step, `--steps` steps issued back to
back with one sync at the end (the trainer's loop reads each step while the next computes). Graphed: the same
step's device work (runtime.step.forward_backward, then apply_update) captured once, after `--warmup` calls on a
side stream, and replayed `--steps` times. The graph holds what a trainer step would need to hold static to be
captured (this batch, its label count, the learning rate), so it bounds what such a step gains; where capture
fails (FSDP's hooks, a host sync), the line says why. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.bench_e2e import one_document_batch
from benchmarks.harness import capture_graph
from moe.backends import kernel_warm_up
from runtime.data.chat import load_tokenizer
from runtime.data.loader import build_dataloader
from runtime.distributed.parallelize import parallelize
from runtime.distributed.process_group import init_distributed
from runtime.launch import prepare
from runtime.models.factory import build_model
from runtime.optim import build_optimizer
from runtime.step import (
    apply_update,
    compute_context,
    forward_backward,
    global_label_count,
    settle,
    train_step,
)

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3-moe.yaml"
DRY_ARGV = [str(TINY), "--set", "lora.enabled=true", "--set", "data.seq_len=64"]


class GraphError(RuntimeError):
    """The step could not be captured on some rank; the message says why (this rank's first line)."""


def random_batch(vocab: int, seq: int, rank: int):
    """One row of `seq` random token ids (seeded by the rank: each data rank its own), one document."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(rank))
    return one_document_batch(ids)


def queued_ms(model, batch, optimizer, cfg, env, steps: int) -> tuple[float, float]:
    """(ms per step of `steps` train_steps issued back to back, the last loss)."""
    if env.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    launched = None
    for _ in range(steps):
        launched = train_step(model, [batch], optimizer, cfg, env, previous=launched)
    settle(launched, model, optimizer, cfg, env)
    loss = launched.result().loss
    return (time.perf_counter() - start) * 1e3 / steps, loss


def device_step(model, batch, optimizer, cfg, env, numbers: list):
    """The step's device work as one call, the one the graph captures: forward, backward and the update of
    the fixed `batch`; each call leaves its numbers (loss first) in `numbers`."""
    labels = global_label_count([batch], model, env)  # this batch's, for every replay
    # the trainer's autocast, entered and left inside the capture (its cast cache lives in the graph's pool), and
    # the global state the compiled regions were traced under: no recompile in the capture's warm-up
    compute = compute_context(env, autocast=True)

    def step():
        loss = forward_backward(model, [batch], env, compute, labels)
        numbers[:] = [apply_update(model, optimizer, cfg, env, loss, labels)[0]]

    return step


def graphed_ms(model, batch, optimizer, cfg, env, steps: int, warmup: int) -> tuple[float, float]:
    """(ms per replay of the step captured whole, the last replay's loss)."""
    numbers = []
    step = device_step(model, batch, optimizer, cfg, env, numbers)
    for group in optimizer.param_groups:
        group["capturable"] = True  # the step count stays on the device (fused AdamW's already does)
    torch.cuda.empty_cache()  # the eager steps' cached blocks: the graph takes its own pool
    error = None
    try:
        # thread_local: NCCL's watchdog thread queries events while this thread captures
        graph = capture_graph(step, warmup, mode="thread_local")
    except (RuntimeError, AssertionError) as err:  # what stopped the capture: its line, its stack in the log
        error = str(err).strip().splitlines()[0][:300]
        traceback.print_exc()
    if env.world_size > 1:  # every rank replays, or none: a lone replay would wait for its peers forever
        captured = torch.tensor(error is None, dtype=torch.int32, device=env.device)
        dist.all_reduce(captured, op=dist.ReduceOp.MIN)
        error = error or (None if captured.item() else "another rank's capture failed")
    if error:
        raise GraphError(error)
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps, float(numbers[0][0])


def build(launch_argv: list[str], data: str = "random"):
    """runtime.launch's arguments -> (config, env, dims, the parallelized model, its optimizer, this rank's batch:
    `data` "random" one random document, "config" the first packed row of the config's data)."""
    _, _, dims, run_plan = prepare(launch_argv)
    cfg = run_plan.config
    env = init_distributed(timeout_s=cfg.parallelism.collective_timeout_s)
    meshes = dims.build_meshes(env.device.type) if env.world_size > 1 else None
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, env, dims)
    parallelize(model, dims, meshes, cfg)
    optimizer, _ = build_optimizer(model, cfg, env.device)
    if data == "config":
        loader = build_dataloader(cfg.data, load_tokenizer(cfg.data.tokenizer or cfg.model.path), 1,
                                  dp_rank=dims.dp_rank(env.rank), dp_world=dims.dp_world)
        batch = next(iter(loader))
    else:
        batch = random_batch(model.config.vocab_size, cfg.data.seq_len, env.rank)
    return cfg, env, dims, model, optimizer, batch.to(env.device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data", choices=("random", "config"), default="random",
                        help="random: one document of random ids per row; config: the config's first packed row")
    parser.add_argument("--dry", action="store_true", help="the tiny example with LoRA, rows of 64 tokens")
    own, launch_argv = parser.parse_known_args(argv)
    if own.dry:
        launch_argv = [*DRY_ARGV, *launch_argv]
    cfg, env, dims, model, optimizer, batch = build(launch_argv, own.data)
    with kernel_warm_up(dist.group.WORLD if env.world_size > 1 else None):
        queued_ms(model, batch, optimizer, cfg, env, own.warmup)  # compiles, tunes
    row = {"world": env.world_size, "ep": dims.ep, "lora": cfg.lora.enabled, "compile": cfg.compile.enabled,
           "dispatcher": cfg.parallelism.dispatcher, "layers": model.config.num_layers,
           "tokens_per_rank": cfg.data.seq_len, "data": own.data, "documents": len(batch.cu_seqlens) - 1}
    row["queued_ms"], row["queued_loss"] = queued_ms(model, batch, optimizer, cfg, env, own.steps)
    if env.device.type == "cuda":
        try:
            row["graph_ms"], row["graph_loss"] = graphed_ms(model, batch, optimizer, cfg, env, own.steps, own.warmup)
            row["graph_speedup"] = row["queued_ms"] / row["graph_ms"]
        except GraphError as err:
            row["graph_error"] = str(err)
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for side in ("queued", "graph"):
        if f"{side}_ms" in row:
            row[f"{side}_tok_s_gpu"] = cfg.data.seq_len / row[f"{side}_ms"] * 1e3
    if env.rank == 0:
        print(json.dumps(row), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
