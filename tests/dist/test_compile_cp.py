"""torch.compile under context parallelism (gloo, bf16, the tiny example): the decoder blocks compile whole
with the cp exchanges inside (functional collectives), with no graph break and one graph for all steps;
training matches the eager cp run and, in loss and grad norm, the single-process run (runtime.verify's bf16
tolerances)."""

from __future__ import annotations

import pytest

from tests.dist.test_compile_ep import _eager_and_compiled, check_against_eager_and_reference, reference

pytestmark = pytest.mark.usefixtures("tokenize_once")  # the reference runs first, the ranks fork with it

MESHES = {
    "cp2": (2, {"cp": 2}),
    "cp2_ulysses_ep2": (2, {"cp": 2, "ep": 2, "cp_attention": "ulysses"}),
}


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_compiled_cp_matches_eager(run_dist, tmp_path, mesh):
    world, parallelism = MESHES[mesh]
    ref = reference(tmp_path, world, parallelism)
    results = run_dist(_eager_and_compiled, world, str(tmp_path / "dist"), parallelism, timeout_s=240)
    for _, _, graphs, breaks in results:
        assert not breaks, breaks
        assert len(set(graphs)) == 1, f"compiled graphs after each step: {graphs} (a recompile)"
    check_against_eager_and_reference(results, ref)
