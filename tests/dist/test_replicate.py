"""runtime/distributed/replicate.py on gloo: each gradient becomes the sum of every rank's, per dtype, and a
parameter that got no gradient on one rank takes part with zeros (else the ranks' buffers would differ in size)."""

from __future__ import annotations

import torch
from torch import nn

from runtime.distributed.replicate import ReplicatedGrads


def _sums(rank, world_size):
    params = [nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(5, dtype=torch.float64)),
              nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.full((3, 2), float(rank + 1))
    params[1].grad = torch.arange(5, dtype=torch.float64) * (rank + 1)
    if rank == 0:  # rank 1 computed no gradient for the last one
        params[2].grad = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ReplicatedGrads(params).all_reduce()
    return [p.grad for p in params]


def test_gradients_become_their_sum_over_the_ranks(run_dist):
    for grads in run_dist(_sums, 2):
        assert torch.equal(grads[0], torch.full((3, 2), 3.0))
        assert grads[1].dtype == torch.float64 and torch.equal(grads[1], torch.arange(5, dtype=torch.float64) * 3)
        assert torch.equal(grads[2], torch.tensor([1.0, 2.0, 3.0, 4.0]))


def _fused_mixed_step(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from runtime.optim import optimizer_step, split_by_kind

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    values = [torch.randn(4, 3), torch.randn(5), torch.randn(2, 2)]
    grads = [torch.randn_like(v) for v in values]
    params = [nn.Parameter(values[0].clone()),  # plain, as the replicated trainables
              nn.Parameter(DTensor.from_local(values[1].clone(), mesh, [Shard(0)], run_check=False)),  # an expert's
              nn.Parameter(values[2].clone())]
    reference = [nn.Parameter(v.clone()) for v in values]
    for p, r, g in zip(params, reference, grads):
        p.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False) if isinstance(p, DTensor) else g.clone()
        r.grad = g * 0.5  # optimizer_step's grad_scale below
    fused = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=True)
    fused.groups_by_kind = split_by_kind(fused)
    optimizer_step(fused, torch.tensor(0.5), torch.tensor(0.0))
    torch.optim.AdamW(reference, lr=0.1, weight_decay=0.01, foreach=False).step()
    got = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return [len(fused.param_groups)] + [torch.allclose(g.detach(), r.detach(), atol=1e-6) for g, r in zip(got, reference)]


def test_fused_adamw_steps_a_group_of_dtensors_and_plain_tensors(run_dist):
    """torch's fused AdamW refuses a group holding both kinds (ep = world under LoRA); optimizer_step runs it per
    kind, with the groups left as they were, and every parameter moves as a plain AdamW moves it."""
    groups, *close = run_dist(_fused_mixed_step, 1)[0]
    assert groups == 1 and all(close), close
