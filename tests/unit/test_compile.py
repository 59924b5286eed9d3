"""torch.compile of the decoder blocks: zero graph breaks (with and without activation checkpointing)
and the compiled loss equals eager, whole blocks and blocks compiled around an exchange that cannot
be traced (no recompile when the routing changes); compile.inductor_options are validated and applied."""

from __future__ import annotations

import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

import attention.attention as attention_module
from moe.dispatch import Dispatcher, Routed
from runtime.config import ConfigError, LoraConfig, config_from_dict
from runtime.distributed.activation_checkpoint import apply_activation_checkpointing
from runtime.distributed.compile import apply_compile, apply_inductor_options
from runtime.lora import apply_lora
from runtime.models import from_pretrained
from tests.conftest import Ahead, label_loss_sum, lane_environ, write_hf_checkpoint


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    """One tiny Qwen3.5-MoE checkpoint for the module: each test builds its own models from it."""
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    write_hf_checkpoint(path, "qwen3_5_moe")
    return path


def _loss_and_grads(model, ids, pos, labels):
    loss = label_loss_sum(model(ids, position_ids=pos), labels) / labels.numel()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# bias: aux-loss-free balancing on (model.router_bias_update_rate): the routers add their slot counts to a
# buffer. Each checkpointing mode runs with the bias (its recompute counts the slots again): the same
# checkpointed blocks as without it, plus the count, and every assertion of a case without it; "none" without
# the bias is the plain compile (CI time: full and selective without the bias were two more compiles each).
COMPILE_CASES = [("none", False), ("full", True), ("selective", True)]


def _counts(model) -> list[torch.Tensor]:
    return [block.gate.take_counts() for block in model.moe_blocks() if block.gate.bias_update_rate > 0]


@pytest.mark.slow
@pytest.mark.parametrize("ac,bias", COMPILE_CASES, ids=[f"{ac}{'-bias' if b else ''}" for ac, b in COMPILE_CASES])
def test_compiled_hybrid_blocks_have_no_graph_breaks(hybrid_ckpt, ac, bias):
    # aot_eager traces exactly what inductor would (dynamo + AOT autograd) without C++ codegen on CPU;
    # the GPU test compiles with inductor.
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 320, (2, 24), generator=g)
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)  # two documents per row
    labels = torch.randint(0, 320, (2, 24), generator=g)
    results, counts = [], []
    for compiled in (False, True):
        # bf16: torch._grouped_mm's compile-time (fake) rule accepts only bf16, whatever the device
        model = from_pretrained(hybrid_ckpt, dtype=torch.bfloat16, expert_backend="grouped_mm",
                                norm_rope_impl="torch", router_aux_loss_coef=0.01,
                                router_bias_update_rate=0.01 if bias else 0.0)
        apply_activation_checkpointing(model, ac)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            apply_compile(model, {}, backend="aot_eager")
        results.append(_loss_and_grads(model, ids, pos, labels))
        counts.append(_counts(model))
    assert not counters["graph_break"], dict(counters["graph_break"])
    if bias:  # the compiled forward counts the slots as eager does (a recompute counts them again)
        assert counts[0] and all(c.sum() > 0 for c in counts[0]) and all(map(torch.equal, *counts)), counts
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
@pytest.mark.parametrize("ac,bias", COMPILE_CASES, ids=[f"{ac}{'-bias' if b else ''}" for ac, b in COMPILE_CASES])
def test_blocks_compile_around_an_untraceable_exchange(hybrid_ckpt, ac, bias):
    """With a dispatcher that is not traceable each block compiles in fullgraph regions around the
    exchange (a whole-block trace would fail on its host sync): compiled equals eager over two steps of
    different routing, one graph per region kind, and the second step compiles nothing new although
    every layer and step dispatches a different number of rows."""
    batches = [_batch(0), _batch(1)]
    results, graphs, counts = [], [], []
    for compiled in (False, True):
        model = from_pretrained(hybrid_ckpt, dtype=torch.bfloat16, expert_backend="grouped_mm",
                                norm_rope_impl="torch", router_aux_loss_coef=0.01,
                                router_bias_update_rate=0.01 if bias else 0.0)
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
            counts.append(_counts(model))
        results.append(steps)
    assert not counters["graph_break"], dict(counters["graph_break"])
    if bias:  # per step, compiled (steps 3, 4) counts as eager (steps 1, 2)
        assert counts[0] and all(c.sum() > 0 for c in counts[0]), counts
        assert all(map(torch.equal, counts[0], counts[2])), counts
        assert all(map(torch.equal, counts[1], counts[3])), counts
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
        config_from_dict(_raw(enabled=False, inductor_options={"epilogue_fusion": True}))
    assert config_from_dict(_raw(inductor_options={"epilogue_fusion": True})).compile.enabled == "auto"
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


def test_compiled_grouped_mm_per_expert_fallback_traces_first():
    """LoRA rank 4 in bf16 (8-byte rows: torch._grouped_mm refuses them) takes the per-expert loop; compiled
    fullgraph (AOT autograd) before any eager call (whose once-only warning would not trace), it matches eager,
    forward and backward, with -1 slots (another EP rank's) and the row count read on the host. Two experts, as
    an EP rank of tests/dist/test_compile_ep.py holds (whose LoRA case takes torch._grouped_mm: CI time)."""
    from moe.backends import expert_backend
    from moe.experts import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(2, 64, 32, lora_rank=4, lora_alpha=8, dtype=torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_lora_B.normal_(0, 0.1)
        experts.down_lora_B.normal_(0, 0.1)
    ids = torch.randint(0, 2, (12, 2))
    ids[0, 1] = -1
    ids[5] = -1
    x = torch.randn(12, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(12, 2, dtype=torch.bfloat16, requires_grad=True)
    factors = [p for name, p in experts.named_parameters() if "lora" in name]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(expert_backend("grouped_mm"), backend="aot_eager", fullgraph=True)
    outs = []
    for fn in (compiled, expert_backend("eager")):
        y = fn(x, ids, w, experts)
        outs.append((y, torch.autograd.grad(y.float().square().sum(), [x, w, *factors])))
    assert not counters["graph_break"]
    (y, g), (y_ref, g_ref) = outs
    assert (y.float() - y_ref.float()).norm() / y_ref.float().norm() <= 1e-2
    assert len(factors) == 4
    for a, b in zip(g, g_ref):
        assert torch.isfinite(a).all() and (a.float() - b.float()).norm() <= 2e-2 * b.float().norm()


@pytest.mark.parametrize("backend", ["grouped_mm", "auto"])  # auto is grouped_mm on the CPU
def test_fp32_grouped_mm_compile_on_cpu_is_refused_clearly(backend):
    """runtime.plan refuses it, before anything is built: grouped_mm declares it compiles on the CPU in bf16 only."""
    import yaml

    from runtime.plan import plan

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-moe.yaml"
    raw = yaml.safe_load(example.read_text())
    raw["model"]["expert_backend"] = backend
    raw["compile"] = {"enabled": True}
    with pytest.raises(ConfigError, match=r"grouped_mm compiles on the CPU only in model.dtype bfloat16"):
        plan(config_from_dict(raw, base_dir=example.parent), 1, "cpu")


_FIRST_LOOKUP_COMPILED = """
import torch
from moe.backends import expert_backend

names = ("eager", "grouped_mm", "scattermoe")
loaded = [expert_backend(name) for name in names]  # at build time, as MoEBlock does: imports the modules

@torch.compile(backend="eager", fullgraph=True)
def step(x):
    backends = [expert_backend(name) for name in names]
    return x * len(backends), backends

y, backends = step(torch.ones(3))
assert torch.equal(y, torch.full((3,), 3.0))
assert [b.__name__ for b in backends] == ["eager_backend", "grouped_mm_backend", "scattermoe_backend"], backends
"""


# In a fresh Python: the first lookups of the process. CI time: that Python runs beside the in-process tests.
FIRST_LOOKUP = Ahead(lambda tmp: subprocess.run([sys.executable, "-c", _FIRST_LOOKUP_COMPILED], env=lane_environ(),
                                                cwd=Path(__file__).resolve().parents[2], capture_output=True,
                                                text=True, timeout=300, check=False))


@pytest.mark.ahead(FIRST_LOOKUP)
def test_first_expert_backend_lookup_inside_fullgraph_compile():
    """After the build-time lookup (which imports the backend modules), lookups inside
    torch.compile(fullgraph=True) are dict reads: no graph break (fullgraph raises on one), and they return the
    registered backends."""
    done = FIRST_LOOKUP.result()
    assert done.returncode == 0, done.stderr[-3000:]


# --- packing that changes every step -------------------------------------------------------------------------
# Rows of 64 tokens; each step packs other documents: their count (cu_seqlens' length) and the longest
# (max_seqlen) change. The first batch holds one document per row.
PACKINGS = [[[64], [64]], [[40, 24], [64]], [[20, 20, 24], [30, 34]], [[10] * 6 + [4], [64]],
            [[64], [32, 32]], [[8] * 8, [16] * 4], [[50, 14], [60, 4]]]


def _packed_batches():
    from runtime.data.corpus import Corpus
    from runtime.data.packing import collate

    g = torch.Generator().manual_seed(0)
    for rows in PACKINGS:
        lengths = [n for row in rows for n in row]
        corpus = Corpus.from_documents([(torch.randint(0, 320, (n,), generator=g).tolist(), [True] * n)
                                        for n in lengths])
        starts = [sum(len(r) for r in rows[:b]) for b in range(len(rows))]
        yield collate([[(starts[b] + i, 0, n) for i, n in enumerate(row)] for b, row in enumerate(rows)], corpus,
                      64, 0)


def _graphs_per_step(model) -> list[int]:
    """Compiles the model's blocks (aot_eager) and trains one forward + backward per packing: the
    compiled graphs after each step (a recompile adds one)."""
    torch._dynamo.reset()
    counters.clear()
    apply_compile(model, {}, backend="aot_eager")
    graphs = []
    for batch in _packed_batches():
        model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
              max_seqlen=batch.max_seqlen, labels=batch.labels).backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    return graphs


def test_changing_packing_does_not_recompile_gdn_blocks(hybrid_ckpt):
    """GDN blocks read cu_seqlens inside the compiled block: a new document count every step reuses the
    first step's graphs (one per block kind) instead of recompiling."""
    model = from_pretrained(hybrid_ckpt, dtype=torch.bfloat16, expert_backend="grouped_mm",
                            norm_rope_impl="torch")
    graphs = _graphs_per_step(model)
    assert graphs == [2] * len(PACKINGS), graphs


@torch.library.custom_op("test_compile::varlen_attention", mutates_args=())
def _cpu_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                scale: float) -> torch.Tensor:
    """A CPU stand-in of the varlen kernels: an opaque op over [T, H, D] taking cu_seqlens and an int
    max_seqlen, as flash_attn_varlen_func and torch's varlen_attn do (max_seqlen is only checked here)."""
    out, _ = _cpu_varlen_math(q, k, v, cu_seqlens, scale)
    assert max_seqlen == int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return out.transpose(0, 1).to(q.dtype).contiguous()


def _cpu_varlen_math(q, k, v, cu_seqlens, scale):
    T, n_rep = q.shape[0], q.shape[1] // k.shape[1]
    doc_T = torch.searchsorted(cu_seqlens[1:].long(), torch.arange(T), right=True)
    mask_TT = (doc_T[:, None] == doc_T[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    q, k, v = (t.float().repeat_interleave(r, 1).transpose(0, 1) for t, r in ((q, 1), (k, n_rep), (v, n_rep)))
    p = torch.softmax((q @ k.transpose(1, 2) * scale).masked_fill(~mask_TT, float("-inf")), -1)
    return p @ v, (q, k, v, p)


@_cpu_varlen.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


def _cpu_varlen_backward(ctx, grad):
    q, k, v, cu_seqlens = ctx.saved_tensors
    _, (q32, k32, v32, p) = _cpu_varlen_math(q, k, v, cu_seqlens, ctx.scale)
    g = grad.float().transpose(0, 1)
    dp = g @ v32.transpose(1, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * ctx.scale
    kv_heads = k.shape[1]
    dq = (ds @ k32).transpose(0, 1).to(q.dtype)
    dk = (ds.transpose(1, 2) @ q32).unflatten(0, (kv_heads, -1)).sum(1).transpose(0, 1).to(k.dtype)
    dv = (p.transpose(1, 2) @ g).unflatten(0, (kv_heads, -1)).sum(1).transpose(0, 1).to(v.dtype)
    return dq, dk, dv, None, None, None


def _save_for_varlen_backward(ctx, inputs, output):
    q, k, v, cu_seqlens, _, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens)


_cpu_varlen.register_autograd(_cpu_varlen_backward, setup_context=_save_for_varlen_backward)


def _dense_causal_stand_in(q_BSHD, k_BSKD, v_BSKD, scale):
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKD))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("dense_causal,lora", [(False, False), (True, False), (False, True)])
def test_changing_packing_recompiles_varlen_attention_at_most_once(tmp_path, monkeypatch, dense_causal, lora):
    """The varlen attention path (the default on CUDA) takes cu_seqlens and max_seqlen, an int, into the
    compiled block: with new values every step it recompiles nothing (dense_causal False), or once where
    the first row holding several documents leaves the one-document-per-row branch (cuDNN on Hopper).
    With the default LoRA (fused q/k/v with their factors) the same holds, from a first step of two graphs:
    block 0's input (the frozen embedding's output) needs no gradient, so that block is a kind of its own.
    The CUDA-only kernels are replaced by CPU stand-ins of the same contract."""
    monkeypatch.setattr(attention_module, "_varlen_choice",
                        attention_module.VarlenImpl("cpu", lambda q, k, v, cu, m, scale: _cpu_varlen(q, k, v, cu, m,
                                                                                                     scale)))
    monkeypatch.setattr(attention_module, "_dense_causal_choice", dense_causal)
    monkeypatch.setattr(attention_module, "_check_varlen_inputs", lambda q, dtype: None)
    monkeypatch.setattr(attention_module, "cudnn_causal_attention", _dense_causal_stand_in)
    write_hf_checkpoint(tmp_path, "moe")
    model = from_pretrained(tmp_path, dtype=torch.bfloat16, expert_backend="grouped_mm", norm_rope_impl="torch",
                            attn_backend="flash")
    if lora:
        apply_lora(model, LoraConfig(enabled=True))
        assert model.model.layers["0"].self_attn.fuse_qkv
    graphs = _graphs_per_step(model)
    first = [1, 2] if dense_causal else [1, 1]
    assert graphs == [n + lora for n in first] + [graphs[1]] * (len(PACKINGS) - 2), graphs
