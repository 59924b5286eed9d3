"""GDN context parallelism by state passing (parallelism.cp_gdn: state; attention/gdn.py) against the same layer on
whole rows in one process (fp32, gloo, op set torch): output, input gradient and every parameter gradient
(summed over the cp ranks, as FSDP reduces them), norm-relative <= 1e-5.

Rows: row 0 packs documents that cross zigzag pieces, start exactly at a piece boundary, are shorter than the
conv window (one of them across a boundary, so a conv tail holds document starts); row 1 is one document. The
layer has 2 key heads, so cp=4 is a case head-parallel refuses. The op's initial / final state is checked
against one run over the concatenation, across chunk boundaries.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from attention.attention import AttnMeta, build_attn_meta
from attention.context_parallel import CPShard
from attention.gdn import GatedDeltaNet
from attention.gdn_ops_torch import chunk_gated_delta_rule, prepare_docs

TOL = 1e-5
# Document lengths of row 0, per row length; row 1 is one document. Boundaries 0 5 8 10 11 15 17 24 32: 8 and
# 24 are piece boundaries at cp=2 and cp=4, 15..16 is a 2-token document across one.
DOCS = {32: [5, 3, 2, 1, 4, 2, 7, 8],
        48: [5, 3, 2, 1, 4, 2, 7, 8, 1, 15],   # cp=3: pieces of 8
        384: [70, 26, 2, 1, 100, 185]}         # cp=2: pieces of 96 tokens, two delta-rule chunks each


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach().double() - expected.detach().double()).norm() / expected.detach().double().norm().clamp_min(1e-30))


def _rows(S: int, B: int = 2):
    """(position_ids_BS, whole rows' AttnMeta): row 0 packed per DOCS[S], row 1 one document."""
    row0 = torch.cat([torch.arange(n) for n in DOCS[S]])
    position_ids = torch.stack([row0, torch.arange(S)] + [row0] * (B - 2))
    starts = [b * S + p for b in range(B) for p in range(S) if position_ids[b, p] == 0]
    cu = torch.tensor([*starts, B * S], dtype=torch.int32)
    return position_ids, build_attn_meta(position_ids, cu, S, "sdpa")


def _layer(layout: str) -> GatedDeltaNet:
    """2 key heads, 4 value heads, conv window 4; decays weak enough (A <= 0.3, not HF's up to 16) that a
    piece's state map P carries the incoming state across whole pieces rather than rounding to 0."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 8, 4, 1e-6, layout=layout, op_set="torch")
    with torch.no_grad():
        layer.A_log.copy_(torch.linspace(0.02, 0.3, 4).log())
    return layer


def _state_passing_rank(rank, world_size, layout, S):
    layer = _layer(layout)
    position_ids, meta = _rows(S)
    torch.manual_seed(1)
    x = torch.randn(2, S, 32, requires_grad=True)
    y_ref = layer(x, meta)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    grads_ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    shard = CPShard(dist.group.WORLD, rank, world_size, meta, position_ids, gdn_mode="state")
    x_local = shard.take(x.detach()).requires_grad_()
    y = layer(x_local, AttnMeta(cp=shard))
    y.backward(shard.take(dy))
    errors = {"y": rel_err(y, shard.take(y_ref)), "dx": rel_err(x_local.grad, shard.take(x.grad))}
    for name, p in layer.named_parameters():
        dist.all_reduce(p.grad)
        errors[name] = rel_err(p.grad, grads_ref[name])
    return errors


CASES = [(layout, cp, S) for layout, (cp, S) in itertools.product(("qwen3_5", "qwen3_next"), ((2, 32), (4, 32)))]
CASES += [("qwen3_5", 3, 48), ("qwen3_next", 2, 384)]


@pytest.mark.parametrize("layout,cp,S", CASES, ids=[f"{lay}-cp{cp}-S{S}" for lay, cp, S in CASES])
def test_state_passing_equals_whole_rows(run_dist, layout, cp, S):
    for errors in run_dist(_state_passing_rank, cp, layout, S):
        assert max(errors.values()) <= TOL, errors


def test_initial_and_final_state_continue_a_row():
    """The delta rule over a row equals its run over a prefix, then over the rest from the prefix's final
    state (the rest's first token continues the prefix's document), outputs and gradients; 250 tokens split
    at 100, so both parts span chunk boundaries."""
    gen = torch.Generator().manual_seed(0)
    B, S, split, H, HV, K, V = 2, 250, 100, 2, 4, 16, 8
    inputs = [torch.randn(B, S, H, K, generator=gen), torch.randn(B, S, H, K, generator=gen),
              torch.randn(B, S, HV, V, generator=gen), -torch.rand(B, S, HV, generator=gen) * 0.1,
              torch.rand(B, S, HV, generator=gen)]
    inputs = [t.requires_grad_() for t in inputs]
    starts_BS = prepare_docs(torch.tensor([0, 30, 90, 250, 400, 500]), B, S, "cpu")
    whole = chunk_gated_delta_rule(*inputs, starts_BS)
    head, state = chunk_gated_delta_rule(*(t[:, :split] for t in inputs), starts_BS[:, :split],
                                         output_final_state=True)
    tail = chunk_gated_delta_rule(*(t[:, split:] for t in inputs), starts_BS[:, split:], initial_state=state)
    dy = torch.randn(whole.shape, generator=gen)
    grads_whole = torch.autograd.grad(whole, inputs, dy)
    grads_split = torch.autograd.grad(torch.cat([head, tail], dim=1), inputs, dy)
    assert rel_err(torch.cat([head, tail], dim=1), whole) <= TOL
    for g_split, g_whole in zip(grads_split, grads_whole, strict=True):
        assert rel_err(g_split, g_whole) <= TOL


def _hybrid_check(**overrides):
    """check_context_parallel on the tiny Qwen3.5-MoE hybrid (2 key heads, conv window 4)."""
    from runtime.config import load_config
    from runtime.distributed.context_parallel import check_context_parallel
    from runtime.models.hf import config_from_hf
    from tests.conftest import TINY_HYBRID
    from tests.dist.test_parity import EXAMPLE

    hf = {**TINY_HYBRID, "model_type": "qwen3_5_moe_text", "layer_types": ["linear_attention", "full_attention"]}
    check_context_parallel(load_config(EXAMPLE, overrides), config_from_hf(hf))


def test_state_passing_runs_where_head_parallel_cannot():
    from runtime.config import ConfigError

    with pytest.raises(ConfigError, match="linear_num_key_heads=2; or set parallelism.cp_gdn: state"):
        _hybrid_check(**{"parallelism.cp": 4})
    _hybrid_check(**{"parallelism.cp": 4, "parallelism.cp_gdn": "state"})


@pytest.mark.parametrize("overrides,match", [
    ({"model.gdn_op_set": "fla"}, "set model.gdn_op_set: torch or parallelism.cp_gdn: heads"),
    ({"data.seq_len": 8}, r"pieces hold data.seq_len/\(2\*cp\) = 1"),
], ids=["fla op set", "pieces shorter than the conv tail"])
def test_state_passing_refuses_what_it_cannot_run(overrides, match):
    from runtime.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        _hybrid_check(**{"parallelism.cp": 4, "parallelism.cp_gdn": "state", **overrides})


def test_state_passing_refuses_auto_resolved_to_fla(monkeypatch):
    """model.gdn_op_set auto on a CUDA machine with fla installed: refused by the cp checks, before any collective."""
    from attention.gdn import GDN_OP_SETS
    from runtime.config import ConfigError

    monkeypatch.setattr(GDN_OP_SETS, "resolve", lambda name: "fla")
    with pytest.raises(ConfigError, match="GDN op set 'fla' does not offer"):
        _hybrid_check(**{"parallelism.cp": 2, "parallelism.cp_gdn": "state"})


def test_layer_refuses_state_passing_without_the_torch_op_set():
    """Before any collective (the shard has no process group)."""
    layer = _layer("qwen3_5")
    layer.op_set = "fla"
    position_ids, meta = _rows(32)
    shard = CPShard(None, 0, 2, meta, position_ids, gdn_mode="state")
    with pytest.raises(ValueError, match="set model.gdn_op_set: torch or parallelism.cp_gdn: heads"):
        layer(torch.randn(2, 16, 32), AttnMeta(cp=shard))
