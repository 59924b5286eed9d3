"""torch.compile under context parallelism (gloo, bf16, the tiny example): the decoder blocks compile whole
with the cp exchanges inside (functional collectives), with no graph break and one graph for all steps;
training matches the eager cp run and, in loss and grad norm, the single-process run (runtime.verify's bf16
tolerances)."""

from __future__ import annotations

import pytest
import torch

from runtime.distributed.mesh import ParallelDims
from runtime.verify import TOLERANCES, compare, reference_run
from tests.dist.test_compile_ep import STEPS, _config, _eager_and_compiled

MESHES = {
    "cp2": (2, {"cp": 2}),
    "cp2_ulysses_ep2": (2, {"cp": 2, "ep": 2, "cp_attention": "ulysses"}),
}


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_compiled_cp_matches_eager(run_dist, tmp_path, mesh):
    world, parallelism = MESHES[mesh]
    results = run_dist(_eager_and_compiled, world, str(tmp_path / "dist"), parallelism, timeout_s=240)
    for _, _, graphs, breaks in results:
        assert not breaks, breaks
        assert len(set(graphs)) == 1, f"compiled graphs after each step: {graphs} (a recompile)"
    eager, compiled = results[0][:2]
    ok, lines = compare(compiled, eager, "bfloat16")
    assert ok, "compiled vs eager, same mesh:\n" + "\n".join(lines)
    cfg = _config(str(tmp_path / "ref"), False, parallelism)
    p = cfg.parallelism
    ref = reference_run(cfg, ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.cp, p.ep, world), STEPS,
                        torch.device("cpu"))
    tol = TOLERANCES["bfloat16"]
    for step, (c, r) in enumerate(zip(compiled, ref), 1):
        assert abs(c["loss"] - r["loss"]) <= tol["loss"] * abs(r["loss"]), (step, c["loss"], r["loss"])
        assert abs(c["grad_norm"] - r["grad_norm"]) <= tol["grad"] * r["grad_norm"], (step, c["grad_norm"],
                                                                                      r["grad_norm"])
