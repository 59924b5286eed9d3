"""The all_gather dispatcher against one process with every expert (test_dispatch's cases and reference), and
in training: ep=2 eager (full fine-tune with selective checkpointing), compiled whole-block, and scattermoe
under a bound too small for the routing (the steps computed again, grown; at once under runtime.verify, by the
next step in the trainer) against the single-process run.

Each rank's T differs in most cases, so every rank pads to the largest T (tokens_per_rank) and the padding rows
must route nowhere."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe.dispatch import AllGatherDispatcher, LocalDispatcher, build_dispatcher
from tests.dist.test_dispatch import CASES, E, H, check_against_single_process, make_batch

# Training trains on the tiny example's data, tokenized once (tests.conftest.tokenize_once): the references run
# first, the ranks fork with it.
pytestmark = pytest.mark.usefixtures("tokenize_once")


def check_case(case, rank: int, ep: int, seed: int) -> float:
    """Outputs and gradients of one case on this rank against the single process; returns the load reading."""
    batch = make_batch(case, ep, seed)
    mine = slice(batch.starts[rank], batch.starts[rank + 1])
    bound = max(case.tokens_per_rank(ep))
    dispatcher = build_dispatcher("all_gather", dist.group.WORLD, E, tokens_per_rank=bound)
    assert isinstance(dispatcher, AllGatherDispatcher)
    with torch.no_grad():
        routed = dispatcher.dispatch(batch.x_NH[mine], batch.topk_ids_Nk[mine], batch.topk_w_Nk[mine])
    # every rank's padded rows, in rank order; this rank's experts as local ids, -1 elsewhere and on padding
    assert routed.x_MH.shape == (ep * bound, H) and routed.valid_slots is None
    E_local = E // ep
    owned_Mk = routed.expert_ids_Mk >= 0
    assert int(owned_Mk.sum()) == int((batch.topk_ids_Nk // E_local == rank).sum())
    for src in range(ep):
        rows = slice(src * bound, src * bound + batch.starts[src + 1] - batch.starts[src])
        theirs = slice(batch.starts[src], batch.starts[src + 1])
        assert torch.equal(routed.x_MH[rows], batch.x_NH[theirs])
        expected = batch.topk_ids_Nk[theirs] - rank * E_local
        expected = torch.where((expected >= 0) & (expected < E_local), expected, -1)
        assert torch.equal(routed.expert_ids_Mk[rows], expected)
        assert (routed.expert_ids_Mk[rows.stop:(src + 1) * bound] == -1).all()  # padding routes nowhere
    check_against_single_process(dispatcher, case, batch, rank, ep, seed)  # 3 training dispatches
    reading = dispatcher.load_reading(torch.device("cpu"))
    slots_R = [int((batch.topk_ids_Nk // E_local == r).sum()) for r in range(ep)]
    expected = max(slots_R) * ep / sum(slots_R) if sum(slots_R) else 1.0
    assert reading.imbalance == pytest.approx(expected, rel=1e-12)  # the logged dispatches, all the same
    assert reading.host_skew_s is None and reading.slowest_host is None  # nothing waits on the host
    assert dispatcher.load_reading(torch.device("cpu")) is None  # a read empties the log
    return reading.imbalance


def check_all(rank: int, ep: int) -> list[float]:
    dispatcher = build_dispatcher("all_gather", dist.group.WORLD, E, tokens_per_rank=4)
    with pytest.raises(ValueError, match="5 tokens on this rank, more than the 4.*micro_batch_size"):
        dispatcher.dispatch(torch.randn(5, H), torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2))
    return [check_case(case, rank, ep, seed) for seed, case in enumerate(CASES)]


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [4])  # 4: uneven T over more ranks; 2 is the training tests'
def test_all_gather_matches_single_process(run_dist, world_size):
    readings = run_dist(check_all, world_size)
    assert all(r == readings[0] for r in readings)  # every rank reads the same imbalance without a collective


def test_all_gather_needs_its_bound_and_is_the_identity_at_ep1():
    assert isinstance(build_dispatcher("all_gather", None, E), LocalDispatcher)


@pytest.mark.dist
def test_training_matches_single_process(run_dist, tmp_path):
    """A full fine-tune under selective checkpointing (CI time: its forward is the plain one, and the policy must
    keep the gathered rows and the reduce-scattered sums rather than exchange again in backward). LoRA with it:
    runtime.verify on NCCL (docs/validation.md)."""
    from tests.dist.test_parity import check_parity

    check_parity(run_dist, tmp_path, 2, False, {"ep": 2, "activation_checkpoint": "selective",
                                                "dispatcher": "all_gather"})


@pytest.mark.dist
@pytest.mark.slow
def test_compiled_blocks_trace_whole_through_the_exchange(run_dist, tmp_path):
    """The dispatcher traces, so every MoE block compiles as one fullgraph region with its exchange inside: one
    graph for the blocks (not test_compile_ep's four regions around an exchange), no graph break, no recompile
    after the first step, and the compiled run matches eager and the single process (bf16 tolerances)."""
    from tests.dist.test_compile_ep import _eager_and_compiled, check_against_eager_and_reference, reference

    parallelism = {"ep": 2, "dispatcher": "all_gather"}
    ref = reference(tmp_path, 2, parallelism)  # first: the forked ranks reuse its tokenized data
    results = run_dist(_eager_and_compiled, 2, str(tmp_path / "dist"), parallelism, timeout_s=240)
    for _, compiled, graphs, breaks in results:
        assert not breaks, breaks
        assert graphs == [1] * len(graphs), f"compiled graphs after each step: {graphs}"
        imbalances = [step["ep_load"][0] for step in compiled]
        assert all(i >= 1.0 for i in imbalances), imbalances  # logged from inside the compiled blocks
    check_against_eager_and_reference(results, ref)


# One step of 32 tokens per rank through scattermoe (the Triton interpreter: CI time), buffers for half a rank's
# balanced slots
BOUNDED = {"expert_backend": "scattermoe", "steps": 1, "seq_len": 32, "ep": 2, "dispatcher": "all_gather",
           "gather_capacity": 0.5}
DEFERRED_STEPS = 2


def _bounded_training(rank: int, world_size: int, tmp: str) -> tuple[list[dict], list[dict], list[str]] | None:
    """Trains the bounded config on this rank twice: one step through runtime.verify's recorder (every step reads
    its dropped count at once, for the gradient hook), then DEFERRED_STEPS steps as the trainer runs them (a
    step's count read by the next). Returns rank 0's steps of each and the runtime's warnings."""
    import logging

    from runtime.distributed.mesh import ParallelDims
    from runtime.distributed.process_group import DistEnv
    from runtime.train import train
    from runtime.verify import record_run
    from tests.dist.test_parity import tiny_config

    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("runtime").addHandler(handler)
    dims = ParallelDims.resolve(1, -1, 1, 2, world_size)
    env = DistEnv(rank, world_size, 0, torch.device("cpu"))
    steps = record_run(tiny_config(False, f"{tmp}/recorded", **BOUNDED), env, dims, dims.build_meshes("cpu"))
    cfg = tiny_config(False, f"{tmp}/deferred", **{**BOUNDED, "steps": DEFERRED_STEPS})
    records = train(cfg, env, dims, dims.build_meshes("cpu"))
    return (steps, records, warned) if rank == 0 else None


@pytest.mark.dist
def test_a_bound_too_small_grows_and_the_step_is_computed_again(run_dist, tmp_path):
    """scattermoe behind all_gather with parallelism.gather_capacity 0.5 (buffers for half a rank's balanced
    slots): the step drops slots on the first tries, the bound grows by 1.5x until they fit, and the step's loss
    and gradients equal the single process's (grouped_mm there; fp32 bounds), as if nothing had been dropped."""
    from runtime.distributed.mesh import ParallelDims
    from runtime.verify import compare
    from tests.dist.test_parity import shared_reference, tiny_config

    cfg = tiny_config(False, str(tmp_path / "ref"), **{**BOUNDED, "expert_backend": "grouped_mm",
                                                        "steps": DEFERRED_STEPS})
    ref = shared_reference(cfg, ParallelDims.resolve(1, -1, 1, 2, 2), DEFERRED_STEPS)  # one process, another backend
    steps, records, warned = run_dist(_bounded_training, 2, str(tmp_path / "dist"), timeout_s=180)[0]
    grown = [w for w in warned if w.startswith("parallelism.gather_capacity")]
    assert len(grown) >= 2 and "computing the step again at capacity" in grown[0], warned  # in both runs
    ok, lines = compare(steps, ref[:1], "float32")
    assert ok, "\n".join(lines)
    # The trainer's run: step 1 dropped, was skipped, and step 2 computed it again before its own update.
    assert [r.get("skipped") for r in records] == [None] * DEFERRED_STEPS
    for record, expected in zip(records, ref, strict=True):
        assert record["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert record["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
