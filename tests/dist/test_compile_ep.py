"""torch.compile under expert parallelism (gloo, bf16, the tiny example): the blocks compile around the
all_to_all exchange (runtime.distributed.compile); training with compile + ep=2 (+ FSDP, activation
checkpointing) matches eager training within the bf16 parity tolerances of runtime.verify, every step,
with no graph break and no recompile after the first step although the routing (so the rows each EP
rank computes) changes every step."""

from __future__ import annotations

import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from runtime.distributed import parallelize
from runtime.distributed.compile import apply_compile
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.process_group import DistEnv
from runtime.train import train
from runtime.verify import TOLERANCES, compare, full_grads, reference_run
from tests.dist.test_parity import tiny_config

STEPS = 4
# The tiny example's data, tokenized once (tests.conftest.tokenize_once): the reference runs first, the ranks
# fork with it.
pytestmark = pytest.mark.usefixtures("tokenize_once")
# One graph per region kind (mix, router, experts, shared expert + sum), shared by the two layers.
REGIONS = 4


def _config(tmp: str, compiled: bool, parallelism: dict, model: dict | None = None):
    """The parity config compiled or not, in bf16; `model`'s keys on cfg.model ("config": on model.config)."""
    parallelism, model = dict(parallelism), dict(model or {})
    cfg = tiny_config(parallelism.pop("lora", False), tmp, **parallelism)
    if "config" in model:
        model["config"] = {**cfg.model.config, **model["config"]}
    return cfg.model_copy(update={
        "lora": cfg.lora.model_copy(update={"rank": LORA_RANK}),
        # torch._grouped_mm traces in bf16 only
        "model": cfg.model.model_copy(update={"dtype": "bfloat16", **model}),
        "train": cfg.train.model_copy(update={"max_steps": STEPS}),
        "compile": cfg.compile.model_copy(update={"enabled": compiled})})


def _train(cfg, world_size, rank):
    """cfg.train.max_steps steps: per step loss, grad norm and full gradients, and the compiled graphs so far."""
    p = cfg.parallelism
    dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.cp, p.ep, world_size)
    meshes = dims.build_meshes("cpu")
    grads, graphs, biases = [], [], []

    def on_grads(model):
        grads.append(full_grads(model, meshes))
        graphs.append(counters["stats"]["unique_graphs"])
        biases.append([b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")])

    records = train(cfg, DistEnv(rank, world_size, 0, torch.device("cpu")), dims, meshes, on_grads=on_grads)
    ep_keys = ("ep_imbalance", "ep_host_skew_s", "ep_slowest_host")
    return [{"loss": r["loss"], "grad_norm": r["grad_norm"], "grads": g, "ep_load": tuple(r.get(k) for k in ep_keys),
             "bias": b} for r, g, b in zip(records, grads, biases)], graphs


def _eager_and_compiled(rank, world_size, tmp, parallelism, model=None):
    eager, _ = _train(_config(f"{tmp}/eager", False, parallelism, model), world_size, rank)
    # aot_eager traces what inductor would (dynamo + AOT autograd) without C++ codegen on the CPU.
    parallelize.apply_compile = functools.partial(apply_compile, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    compiled, graphs = _train(_config(f"{tmp}/compiled", True, parallelism, model), world_size, rank)
    return eager, compiled, graphs, dict(counters["graph_break"])


# Full checkpointing under compile is tests/unit/test_compile.py's (the blocks); under EP, eager, test_parity's.
MESHES = {
    "ep2": (2, {"ep": 2}),
    # efsdp=1: the experts' FSDP unit records one more profiler op in the recompute than in forward,
    # which selective checkpointing must not count (runtime.distributed.activation_checkpoint). With the
    # router bias on: the same checkpointed, compiled blocks plus the slot counts, and every assertion of the
    # case without it (CI time: that case was one more eager + compiled run)
    "ep2_selective_ac_bias": (2, {"ep": 2, "activation_checkpoint": "selective"}),
    # LoRA: frozen dense weights replicated (plain tensors in the graphs), the factors in the root FSDP unit
    "ep2_lora": (2, {"ep": 2, "lora": True}),
}
# model keys of a case: aux-loss-free balancing (the routers' slot counts go to a buffer outside their
# graphs); LoRA: 4 experts, 2 per rank (CI time: the example's 8 trace at ~1.6x the cost)
MODEL = {"ep2_selective_ac_bias": {"router_bias_update_rate": 1e-2},
         "ep2_lora": {"config": {"num_experts": 4}}}
# 16-byte bf16 rows: torch._grouped_mm itself. Rank 4's 8-byte rows take grouped_mm's per-expert loop, whose trace
# over host-read row counts made the LoRA case 3x as long (CI time); that loop compiled with -1 slots, forward and
# backward, is tests/unit/test_compile.py's test_compiled_grouped_mm_per_expert_fallback_traces_first.
LORA_RANK = 8


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_compiled_ep_matches_eager(run_dist, tmp_path, mesh):
    """Per-tensor gradients against the eager run of the same mesh (the same bf16 rounding), and per-step
    loss and grad norm against the single-process eager run (runtime.verify's bf16 tolerances: its
    per-tensor ones do not hold for the eager EP run either, once bf16 updates moved near-tie routings)."""
    world, parallelism = MESHES[mesh]
    model = MODEL.get(mesh, {})
    ref = reference(tmp_path, world, parallelism, model)
    results = run_dist(_eager_and_compiled, world, str(tmp_path / "dist"), parallelism, model, timeout_s=240)
    for _, _, graphs, breaks in results:
        assert not breaks, breaks
        # LoRA: the first block's mix region, whose input needs no gradient, is a graph of its own
        regions = REGIONS + (1 if parallelism.get("lora") else 0)
        assert graphs == [regions] * STEPS, f"compiled graphs after each step: {graphs}"
    # every step's EP load record: one collective result (the same on both ranks), imbalance >= 1 and skew
    # >= 0 by definition, the slowest host an EP rank (their values: tests/dist/test_dispatch.py's)
    for run in (0, 1):
        per_rank = [[step["ep_load"] for step in result[run]] for result in results]
        assert per_rank[0] == per_rank[1], per_rank
        assert all(imbalance >= 1.0 and skew >= 0.0 and slowest in (0, 1)
                   for imbalance, skew, slowest in per_rank[0]), per_rank
    if model.get("router_bias_update_rate"):  # the biases (as each step starts) moved, alike everywhere
        biases = [[step["bias"] for step in run] for result in results for run in result[:2]]
        assert all(b.abs().max() > 0 for b in biases[0][-1])
        assert all(all(map(torch.equal, a, b)) for other in biases[1:] for a, b in zip(biases[0], other)), biases
    check_against_eager_and_reference(results, ref)


def reference(tmp_path, world: int, parallelism: dict, model: dict | None = None) -> list[dict]:
    """The single-process eager run of the same global batch."""
    cfg = _config(str(tmp_path / "ref"), False, parallelism, model)
    p = cfg.parallelism
    return reference_run(cfg, ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.cp, p.ep, world), STEPS,
                         torch.device("cpu"))


def check_against_eager_and_reference(results, ref: list[dict]) -> None:
    """Per-tensor gradients of the compiled run against the eager run of the same mesh, and per-step loss
    and grad norm against the single-process eager run `ref` (runtime.verify's bf16 tolerances)."""
    eager, compiled = results[0][:2]
    ok, lines = compare(compiled, eager, "bfloat16")
    assert ok, "compiled vs eager, same mesh:\n" + "\n".join(lines)
    tol = TOLERANCES["bfloat16"]
    for step, (c, r) in enumerate(zip(compiled, ref), 1):
        assert abs(c["loss"] - r["loss"]) <= tol["loss"] * abs(r["loss"]), (step, c["loss"], r["loss"])
        assert abs(c["grad_norm"] - r["grad_norm"]) <= tol["grad"] * r["grad_norm"], (step, c["grad_norm"],
                                                                                      r["grad_norm"])
