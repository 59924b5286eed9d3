"""torch.compile of the decoder blocks: zero graph breaks (with and without activation checkpointing)
and the compiled loss equals eager, whole blocks and blocks compiled around an exchange that cannot
be traced (no recompile when the routing changes); compile.inductor_options are validated and applied."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from moe.dispatch import Dispatcher, Routed
from runtime.config import ConfigError, config_from_dict
from runtime.distributed.activation_checkpoint import apply_activation_checkpointing
from runtime.distributed.compile import apply_compile, apply_inductor_options
from runtime.models import from_pretrained
from runtime.models.qwen import label_loss_sum
from tests.conftest import write_hf_checkpoint


def _loss_and_grads(model, ids, pos, labels):
    loss = label_loss_sum(model(ids, position_ids=pos), labels) / labels.numel()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_compiled_hybrid_blocks_have_no_graph_breaks(tmp_path, ac):
    # aot_eager traces exactly what inductor would (dynamo + AOT autograd) without C++ codegen on CPU;
    # the GPU test compiles with inductor.
    write_hf_checkpoint(tmp_path, "qwen3_5_moe")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 320, (2, 24), generator=g)
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)  # two documents per row
    labels = torch.randint(0, 320, (2, 24), generator=g)
    results = []
    for compiled in (False, True):
        # bf16: torch._grouped_mm's compile-time (fake) rule accepts only bf16, whatever the device
        model = from_pretrained(tmp_path, dtype=torch.bfloat16, expert_backend="grouped_mm", norm_rope_impl="torch",
                                router_aux_loss_coef=0.01)
        apply_activation_checkpointing(model, ac)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            apply_compile(model, {}, backend="aot_eager")
        results.append(_loss_and_grads(model, ids, pos, labels))
    assert not counters["graph_break"], dict(counters["graph_break"])
    # whole blocks (the local dispatcher traces): one graph per kind, a GDN block and an attention block
    assert counters["stats"]["unique_graphs"] == 2
    (eager_loss, eager_grads), (comp_loss, comp_grads) = results
    assert torch.allclose(eager_loss.float(), comp_loss.float(), rtol=1e-2)
    for name, grad in eager_grads.items():
        err = (grad.float() - comp_grads[name].float()).norm() / grad.float().norm().clamp_min(1e-12)
        assert err <= 2e-2, f"{name}: {err:.2e}"


@dataclass
class _HalvesRouted(Routed):
    token_M: torch.Tensor  # source token of each row
    num_tokens: int


class _HalvesDispatcher(Dispatcher):
    """A one-process stand-in for the all_to_all exchange over two ranks that own half the experts
    each: a token becomes one row per half holding one of its experts (-1 in its other slots), so the
    row count M follows the routing and is read on the host, as all_to_all's split sizes are."""

    def __init__(self, num_experts: int):
        self.half = num_experts // 2
        self.rows: list[int] = []  # M of every dispatch

    def dispatch(self, x_TH, topk_ids_Tk, topk_w_Tk):
        owner_Tk = topk_ids_Tk // self.half
        needs_T2 = torch.zeros(x_TH.shape[0], 2, dtype=torch.bool).scatter_(1, owner_Tk, True)
        token_M, half_M = needs_T2.nonzero(as_tuple=True)  # host sync: a fullgraph trace cannot take it
        ids_Mk = torch.where(owner_Tk[token_M] == half_M.unsqueeze(1), topk_ids_Tk[token_M], -1)
        self.rows.append(token_M.numel())
        return _HalvesRouted(x_TH[token_M], ids_Mk, topk_w_Tk[token_M], token_M, x_TH.shape[0])

    def combine(self, y_MH, routed):
        return y_MH.new_zeros(routed.num_tokens, y_MH.shape[1]).index_add(0, routed.token_M, y_MH)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 320, (2, 24), generator=g)
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    return ids, pos, torch.randint(0, 320, (2, 24), generator=g)


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_blocks_compile_around_an_untraceable_exchange(tmp_path, ac):
    """With a dispatcher that is not traceable each block compiles in fullgraph regions around the
    exchange (a whole-block trace would fail on its host sync): compiled equals eager over two steps of
    different routing, one graph per region kind, and the second step compiles nothing new although
    every layer and step dispatches a different number of rows."""
    write_hf_checkpoint(tmp_path, "qwen3_5_moe")
    batches = [_batch(0), _batch(1)]
    results, graphs = [], []
    for compiled in (False, True):
        model = from_pretrained(tmp_path, dtype=torch.bfloat16, expert_backend="grouped_mm", norm_rope_impl="torch",
                                router_aux_loss_coef=0.01)
        dispatcher = _HalvesDispatcher(model.config.num_experts)
        for block in model.moe_blocks():
            block.wire(dispatcher, balance_group=None, aux_grad_scale=1.0)
        apply_activation_checkpointing(model, ac)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            apply_compile(model, {}, backend="aot_eager")
        steps = []
        for ids, pos, labels in batches:
            model.zero_grad(set_to_none=True)
            steps.append(_loss_and_grads(model, ids, pos, labels))
            graphs.append(counters["stats"]["unique_graphs"])
        results.append(steps)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # mix (a GDN and an attention kind), router, experts, shared expert + sum; nothing new in step 2
    assert graphs[2:] == [5, 5], graphs[2:]
    assert len(set(dispatcher.rows)) > 1, dispatcher.rows
    for (eager_loss, eager_grads), (comp_loss, comp_grads) in zip(*results):
        assert torch.allclose(eager_loss.float(), comp_loss.float(), rtol=1e-2)
        for name, grad in eager_grads.items():
            err = (grad.float() - comp_grads[name].float()).norm() / grad.float().norm().clamp_min(1e-12)
            assert err <= 2e-2, f"{name}: {err:.2e}"


def test_inductor_options_are_applied():
    import torch._inductor.config as inductor_config

    before = (inductor_config.coordinate_descent_tuning, inductor_config.triton.cudagraphs)
    try:
        apply_inductor_options({"coordinate_descent_tuning": True, "triton.cudagraphs": True})
        assert inductor_config.coordinate_descent_tuning is True and inductor_config.triton.cudagraphs is True
    finally:
        inductor_config.coordinate_descent_tuning, inductor_config.triton.cudagraphs = before


def _raw(**compile_section):
    return {"model": {"path": "/x"}, "data": {"path": "d"}, "compile": compile_section}


def test_inductor_options_validation():
    with pytest.raises(ConfigError, match=r"compile.inductor_options has unknown keys \['max_autotune_gem'\]"):
        config_from_dict(_raw(enabled=True, inductor_options={"max_autotune_gem": True}))
    with pytest.raises(ConfigError, match="set compile.enabled: true"):
        config_from_dict(_raw(inductor_options={"epilogue_fusion": True}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config_from_dict(_raw(enabled=True, inductor_options={"triton.cudagraphs": True}))
    assert any("cudagraphs" in str(w.message) for w in caught)
    cfg = config_from_dict(_raw(enabled=True, inductor_options={"max_autotune_gemm": True, "shape_padding": True}))
    assert cfg.compile.inductor_options == {"max_autotune_gemm": True, "shape_padding": True}


def test_compiled_grouped_mm_skips_sentinels_without_sync():
    """Under compile grouped_mm keeps all M*k slots with the -1 tail masked: same result and gradients
    as the eager reference, with -1 slots and an expert that gets nothing."""
    from moe.backends import expert_backend
    from moe.experts import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 64, 32, dtype=torch.bfloat16)
    ids = torch.randint(0, 3, (12, 2))
    ids[0] = -1
    ids[5, 1] = -1
    x = torch.randn(12, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(12, 2, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(expert_backend("grouped_mm"), backend="aot_eager", fullgraph=True)
    outs = []
    for fn in (expert_backend("eager"), compiled):
        y = fn(x, ids, w, experts)
        outs.append((y, torch.autograd.grad(y.float().square().sum(), [x, w, experts.gate_up, experts.down])))
    assert not counters["graph_break"]
    (y_ref, g_ref), (y, g) = outs
    assert (y.float() - y_ref.float()).norm() / y_ref.float().norm() <= 1e-2
    for a, b in zip(g, g_ref):
        assert torch.isfinite(a).all() and (a.float() - b.float()).norm() / b.float().norm() <= 2e-2


@pytest.mark.parametrize("backend", ["grouped_mm", "auto"])  # auto is grouped_mm on the CPU
def test_fp32_grouped_mm_compile_on_cpu_is_refused_clearly(tiny_moe_ckpt, backend):
    model = from_pretrained(tiny_moe_ckpt, expert_backend=backend)
    with pytest.raises(ValueError, match="needs model.dtype: bfloat16"):
        apply_compile(model, {})


_FIRST_LOOKUP_COMPILED = """
import torch
from moe.backends import expert_backend

@torch.compile(backend="eager", fullgraph=True)
def step(x):
    backends = [expert_backend(name) for name in ("eager", "grouped_mm", "scattermoe")]
    return x * len(backends), backends

y, backends = step(torch.ones(3))
assert torch.equal(y, torch.full((3,), 3.0))
assert [b.__name__ for b in backends] == ["eager_backend", "grouped_mm_backend", "scattermoe_backend"], backends
"""


def test_first_expert_backend_lookup_inside_fullgraph_compile():
    """The registry's first lookup happens inside torch.compile(fullgraph=True), in a fresh process
    (nothing imported a backend before): no graph break (fullgraph raises on one), and the lookups
    return the registered backends."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _FIRST_LOOKUP_COMPILED], cwd=repo, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
