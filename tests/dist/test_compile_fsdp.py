"""Compiled decoder blocks under FSDP2 (gloo, 2 ranks, bf16): zero graph breaks and the same loss and
gradients as the uncompiled FSDP run."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from runtime.distributed.compile import apply_compile
from runtime.distributed.fsdp import apply_fsdp
from runtime.distributed.mesh import ParallelDims
from runtime.models import from_pretrained
from runtime.verify import full_grads
from tests.conftest import label_loss_sum, write_hf_checkpoint


def _run(rank, world_size, ckpt):
    dims = ParallelDims(1, world_size, 1, 1, world_size)
    meshes = dims.build_meshes("cpu")
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 320, (1, 32), generator=g)
    labels = torch.randint(0, 320, (1, 32), generator=g)
    out = []
    for compiled in (False, True):
        model = from_pretrained(ckpt, dtype=torch.bfloat16, expert_backend="grouped_mm", norm_rope_impl="torch")
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            apply_compile(model, {}, backend="aot_eager")
        apply_fsdp(model, meshes, "cpu")
        loss = label_loss_sum(model(ids), labels) / labels.numel()
        loss.backward()
        out.append((loss.detach().float(), full_grads(model, meshes)))
    return out, dict(counters["graph_break"])


def test_compiled_blocks_under_fsdp(run_dist, tmp_path):
    write_hf_checkpoint(tmp_path, "qwen3_5_moe")
    results = run_dist(_run, 2, str(tmp_path), timeout_s=240)
    for (eager, compiled), breaks in results:
        assert not breaks, breaks
        assert torch.allclose(eager[0], compiled[0], rtol=1e-2)
        for name, grad in eager[1].items():
            err = (grad - compiled[1][name]).norm() / grad.norm().clamp_min(1e-12)
            assert err <= 2e-2, f"{name}: {err:.2e}"
