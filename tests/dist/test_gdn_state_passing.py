"""GDN context parallelism by state passing (parallelism.cp_gdn: state; attention/gdn.py) against the same layer on
whole rows in one process (fp32, gloo, op set torch): output, input gradient and every parameter gradient
(summed over the cp ranks, as FSDP reduces them), norm-relative <= 1e-5.

Rows: row 0 packs documents that cross zigzag pieces, start exactly at a piece boundary, are shorter than the
conv window (one of them across a boundary, so a conv tail holds document starts); row 1 is one document. The
layer has 2 key heads, so cp=4 is a case head-parallel refuses. The op's initial / final state is checked
against one run over the concatenation, across chunk boundaries; the pieces' document tables (piece_documents)
against the whole rows' starts; cp size 1 (both pieces on one rank, no process group: the single-GPU fla tests
in tests/gpu/test_cp_gdn_gpu.py) against whole rows.
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

    shard = CPShard(dist.group.WORLD, rank, world_size, meta, position_ids, gdn_mode="state", gdn_conv_tail=3)
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
    from runtime.models.hf import config_from_hf
    from runtime.plan import check_context_parallel
    from tests.conftest import TINY_HYBRID
    from tests.dist.test_parity import EXAMPLE

    hf = {**TINY_HYBRID, "model_type": "qwen3_5_moe_text", "layer_types": ["linear_attention", "full_attention"]}
    check_context_parallel(load_config(EXAMPLE, overrides), config_from_hf(hf))


def test_state_passing_runs_where_head_parallel_cannot():
    from runtime.config import ConfigError

    with pytest.raises(ConfigError, match="linear_num_key_heads=2; or set parallelism.cp_gdn: state"):
        _hybrid_check(**{"parallelism.cp": 4})
    _hybrid_check(**{"parallelism.cp": 4, "parallelism.cp_gdn": "state"})


def test_state_passing_refuses_pieces_shorter_than_the_conv_tail():
    from runtime.config import ConfigError

    with pytest.raises(ConfigError, match=r"pieces hold data.seq_len/\(2\*cp\) = 1"):
        _hybrid_check(**{"parallelism.cp": 4, "parallelism.cp_gdn": "state", "data.seq_len": 8})


def test_state_passing_accepts_auto_resolved_to_fla(monkeypatch):
    """model.gdn_op_set auto on a CUDA machine with fla installed: state passing runs on either op set."""
    _hybrid_check(**{"parallelism.cp": 2, "parallelism.cp_gdn": "state", "model.gdn_op_set": "fla"})


def test_one_rank_runs_both_pieces():
    """cp size 1 without a process group (what the single-GPU fla tests run): both pieces of every row on one
    rank, gather_pieces the identity; equal to the whole rows, forward and gradients, op set torch."""
    layer = _layer("qwen3_5")
    position_ids, meta = _rows(32)
    torch.manual_seed(1)
    x = torch.randn(2, 32, 32, requires_grad=True)
    shard = CPShard(None, 0, 1, meta, position_ids, gdn_mode="state", gdn_conv_tail=3)
    y_ref, y = layer(x, meta), layer(x, AttnMeta(cp=shard))
    dy = torch.randn_like(y)
    grads_ref, grads = (torch.autograd.grad(out, [x, *layer.parameters()], dy) for out in (y_ref, y))
    assert rel_err(y, y_ref) <= TOL
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert rel_err(g, g_ref) <= TOL


def test_state_path_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) of the state path (cp size 1, op set torch; aot_eager: no C++ compiler needed):
    the pieces' document tables are tensors of the CPShard, nothing data-dependent is traced."""
    from torch._dynamo.utils import counters

    layer = _layer("qwen3_5")
    position_ids, meta = _rows(32)
    shard = CPShard(None, 0, 1, meta, position_ids, gdn_mode="state", gdn_conv_tail=3)
    x = torch.randn(2, 32, 32)
    torch._dynamo.reset()
    counters.clear()
    y = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, AttnMeta(cp=shard))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert rel_err(y, layer(x, AttnMeta(cp=shard))) <= TOL


def test_layer_refuses_a_shard_built_for_another_conv_window():
    """Before any collective (the shard has no process group)."""
    layer = _layer("qwen3_5")
    position_ids, meta = _rows(32)
    shard = CPShard(None, 0, 2, meta, position_ids, gdn_mode="state", gdn_conv_tail=2)
    with pytest.raises(ValueError, match="build the CPShard with gdn_conv_tail=3"):
        layer(torch.randn(2, 16, 32), AttnMeta(cp=shard))


@pytest.mark.parametrize("S,cp,back", [(32, 2, 0), (32, 2, 3), (32, 4, 3), (48, 3, 3)])
def test_piece_documents_match_the_whole_rows(S, cp, back):
    """piece_documents against the whole rows' document starts column by column: a boundary wherever a
    document starts inside an extended piece or the extended piece begins; continues where a piece's first
    token is no document start."""
    from attention.context_parallel import piece_documents

    position_ids, meta = _rows(S)
    B, P = position_ids.shape[0], S // (2 * cp)
    starts_BS = (position_ids == 0).tolist()
    bounds = sorted(set(meta.cu_seqlens.tolist()) | set(range(0, B * S + 1, S)))
    for rank in range(cp):
        pieces = (rank, 2 * cp - 1 - rank)
        cu, continues = piece_documents(bounds, B, S, 2 * cp, pieces, back)
        expected_cu, expected_continues = [], []
        for i, (b, p) in enumerate(itertools.product(range(B), pieces)):
            cols = range(p * P - back, (p + 1) * P)
            expected_cu += [i * (P + back) + j for j, c in enumerate(cols)
                            if j == 0 or (c >= 0 and starts_BS[b][c])]
            expected_continues.append(not starts_BS[b][p * P])
        assert cu == [*expected_cu, len(expected_continues) * (P + back)]
        assert continues == expected_continues


def test_state_composition_stays_fp32_under_autocast():
    """o = o0 + o_I S_in and the chain of state maps are fp32 products also inside the training step's bf16
    autocast (which would otherwise round every product to bf16, compounding over the pieces)."""
    from attention.gdn import incoming_states, with_incoming_state

    g = torch.Generator().manual_seed(0)
    maps = torch.randn(4, 1, 2, 8, 6 + 8, generator=g) * 0.3
    o = torch.randn(2, 5, 2, 6 + 8, generator=g)
    exact_states = incoming_states(maps, 6, (1, 3))
    exact_o = with_incoming_state(o, exact_states[:, 0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        states = incoming_states(maps, 6, (1, 3))
        out = with_incoming_state(o, states[:, 0])
    assert states.dtype == out.dtype == torch.float32
    assert torch.equal(states, exact_states) and torch.equal(out, exact_o)
