"""runtime.optim: what each optim.master_dtype keeps parameters, grads and AdamW states in; bf16 updates
below bf16 resolution still move the weights (stochastic rounding); the schedule drives either optimizer;
the combinations that cannot work fail naming the config key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from runtime.config import load_config
from runtime.optim import apply_master_dtype, build_optimizer, lr_factor

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-moe.yaml"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # apply_master_dtype reads only the device type


def config(master_dtype: str, **optim):
    overrides = {"optim.master_dtype": master_dtype, "optim.weight_decay": 0.0, "optim.warmup_steps": 2,
                 "train.max_steps": 10, **{f"optim.{k}": v for k, v in optim.items()}}
    return load_config(EXAMPLE, overrides)


def model(dtype: torch.dtype, frozen_bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(64, 64).to(dtype)
    layer.bias.requires_grad_(not frozen_bias)
    return layer


def one_step(layer: nn.Linear, master_dtype: str):
    optimizer, _ = build_optimizer(layer, config(master_dtype), CPU)
    layer(torch.randn(8, 64, dtype=layer.weight.dtype)).square().sum().backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize(("master_dtype", "device", "model_dtype", "trained", "frozen"), [
    ("fp32", CUDA, torch.bfloat16, torch.float32, torch.bfloat16),  # fp32 masters under autocast
    ("fp32", CPU, torch.bfloat16, torch.bfloat16, torch.bfloat16),  # no autocast: model.dtype
    ("fp32", CPU, torch.float32, torch.float32, torch.float32),
    ("bf16", CUDA, torch.float32, torch.bfloat16, torch.float32),
    ("bf16", CPU, torch.bfloat16, torch.bfloat16, torch.bfloat16),
])
def test_apply_master_dtype_casts_only_what_trains(master_dtype, device, model_dtype, trained, frozen):
    layer = model(model_dtype, frozen_bias=True)
    apply_master_dtype(layer, master_dtype, device)
    assert (layer.weight.dtype, layer.bias.dtype) == (trained, frozen)


@pytest.mark.parametrize(("master_dtype", "model_dtype", "optimizer_module"), [
    ("fp32", torch.float32, "torch.optim"), ("bf16", torch.float32, "runtime.optim")])
def test_params_grads_and_states_per_mode(master_dtype, model_dtype, optimizer_module):
    layer = model(model_dtype)
    apply_master_dtype(layer, master_dtype, CPU)
    optimizer = one_step(layer, master_dtype)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[master_dtype]
    assert type(optimizer).__module__.startswith(optimizer_module)
    for p in layer.parameters():
        state = optimizer.state[p]
        assert {p.dtype, p.grad.dtype, state["exp_avg"].dtype, state["exp_avg_sq"].dtype} == {dtype}


def test_bf16_updates_below_resolution_follow_fp32_on_average():
    """Adam's first update is lr * sign(grad): 1e-3 is under half a bf16 ulp at 1.0 (2^-9), so rounded to
    nearest every update is lost, while stochastic rounding moves the mean weight like fp32 does."""
    steps, lr = 100, 1e-3

    def train(dtype: torch.dtype, master_dtype: str) -> float:
        torch.manual_seed(0)  # the rounding draws from the global generator
        weight = nn.Parameter(torch.ones(4096, dtype=dtype))
        holder = nn.Module()
        holder.weight = weight
        optimizer, _ = build_optimizer(holder, config(master_dtype, lr=lr, warmup_steps=0), CPU)
        for _ in range(steps):
            weight.grad = torch.ones_like(weight)
            optimizer.step()
        return float(weight.detach().float().mean()) - 1.0

    fp32 = train(torch.float32, "fp32")
    assert abs(fp32 + steps * lr) < 1e-4  # the reference: -lr per step
    assert abs(train(torch.bfloat16, "bf16") - fp32) < 0.02 * abs(fp32)
    assert train(torch.bfloat16, "fp32") == 0.0  # plain AdamW on bf16 parameters stalls


@pytest.mark.parametrize("master_dtype", ["fp32", "bf16"])
def test_schedule_drives_the_lr(master_dtype):
    layer = model(torch.float32)
    apply_master_dtype(layer, master_dtype, CPU)
    cfg = config(master_dtype)
    optimizer, scheduler = build_optimizer(layer, cfg, CPU)
    for step in range(cfg.train.max_steps):
        expected = cfg.optim.lr * lr_factor(step, cfg.optim, cfg.train.max_steps)
        assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(expected)
        assert float(scheduler.get_last_lr()[0]) == pytest.approx(expected)
        optimizer.step()
        scheduler.step()


def test_bf16_off_cuda_with_fp32_frozen_weights_fails_naming_the_keys():
    with pytest.raises(ValueError, match=r"optim.master_dtype: bf16 on cpu needs model.dtype: bfloat16"):
        apply_master_dtype(model(torch.float32, frozen_bias=True), "bf16", CPU)


def test_bf16_optimizer_refuses_fp32_parameters():
    with pytest.raises(ValueError, match=r"optim.master_dtype: bf16 needs bf16 trainable parameters.*float32"):
        build_optimizer(model(torch.float32), config("bf16"), CPU)


def test_stochastic_rounding_is_unbiased_and_keeps_exact_values():
    from runtime.optim import round_to_bf16_stochastically

    torch.manual_seed(0)
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    for x in (1 + 0.3 * ulp, -(1 + 0.7 * ulp), 3e-3):
        samples = round_to_bf16_stochastically(torch.full((200_000,), x)).float()
        below, above = torch.tensor(x).bfloat16().float(), None
        assert len(set(samples.unique().tolist())) == 2  # only the two neighbours
        assert abs(samples.mean().item() - x) < 2e-3 * abs(x)
        del below, above
    special = torch.tensor([1.0, -2.5, 0.0, float("inf"), float("-inf")])
    assert torch.equal(round_to_bf16_stochastically(special).float(), special)
    assert round_to_bf16_stochastically(torch.tensor([float("nan")])).isnan().all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_bf16_step_matches_torch_adamw_within_one_bf16_ulp(device):
    """Steps with weight decay and a changing lr, each from the same weights and (bf16-valued) states as
    torch AdamW run in fp32: every weight lands on a bf16 neighbour of torch's fp32 result (within one bf16
    spacing of its rounding to nearest), unbiased on average. On CUDA the update is the compiled one."""
    from runtime.optim import StochasticRoundingAdamW

    torch.manual_seed(0)
    ours = nn.Parameter(torch.randn(50_000, device=device).bfloat16())
    ref = nn.Parameter(ours.detach().float())
    kwargs = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt, ref_opt = StochasticRoundingAdamW([ours], lr=1e-2, **kwargs), torch.optim.AdamW([ref], lr=1e-2, **kwargs)
    for step in range(3):
        grad = torch.randn(50_000, device=device).bfloat16()
        ours.grad, ref.grad = grad, grad.float()
        for group in (*opt.param_groups, *ref_opt.param_groups):
            group["lr"] = 1e-2 / (step + 1)
        ref_opt.step()
        opt.step()
        exact = ref.detach()
        err = ours.detach().float() - exact.bfloat16().float()
        spacing = torch.exp2(exact.abs().log2().floor() - 7)
        assert (err.abs() <= spacing * 1.01).all()
        assert abs((ours.detach().float() - exact).mean().item()) < 1e-2 * spacing.mean().item()
        ref.data = ours.detach().float()  # the next step starts from the same weights and states
        for key in ("exp_avg", "exp_avg_sq"):
            ref_opt.state[ref][key] = opt.state[ours][key].float()


def test_one_compiled_graph_serves_every_step():
    """The update compiles once: lr and bias corrections are tensors, so new values do not recompile."""
    from torch._dynamo.testing import CompileCounter

    from runtime import optim

    counter = CompileCounter()
    update = torch.compile(optim._adamw_update, backend=counter, fullgraph=True, dynamic=False)
    params = [torch.randn(8).bfloat16(), torch.randn(3, 4).bfloat16()]
    states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    for step in range(1, 4):
        scalars = [torch.tensor(x) for x in (1e-3 / step, 1 - 0.9**step, (1 - 0.95**step) ** 0.5)]
        update(params, [torch.randn_like(p) for p in params], *states, *scalars, torch.tensor(1.0), 0.9, 0.95, 1e-8, 0.0)
    assert counter.frame_count == 1


def test_bf16_optimizer_state_dict_round_trip_continues_identically():
    from runtime.optim import StochasticRoundingAdamW

    def fresh():
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(256).bfloat16())
        return p, StochasticRoundingAdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def steps(p, opt, n, seed):
        torch.manual_seed(seed)
        for _ in range(n):
            p.grad = torch.randn_like(p)
            opt.step()

    p, opt = fresh()
    steps(p, opt, 2, seed=1)
    saved_p, saved = p.detach().clone(), copy.deepcopy(opt.state_dict())  # states update in place
    steps(p, opt, 2, seed=2)
    q, opt2 = fresh()
    q.data.copy_(saved_p)
    opt2.load_state_dict(saved)
    steps(q, opt2, 2, seed=2)
    assert torch.equal(p, q)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _adamw_pair(kind: str, device: str):
    """Two identical (parameter, optimizer) pairs of one kind: 'plain' / 'fused' torch AdamW in fp32, 'sr' ours."""
    from runtime.optim import StochasticRoundingAdamW

    pairs = []
    for _ in range(2):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(4096, device=device, dtype=torch.bfloat16 if kind == "sr" else torch.float32))
        kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
        opt = (StochasticRoundingAdamW([p], **kwargs) if kind == "sr"
               else torch.optim.AdamW([p], fused=kind == "fused", **kwargs))
        pairs.append((p, opt))
    return pairs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["plain", "fused", "sr"])
@pytest.mark.parametrize("scale", [0.5, 0.3, 1.0])
def test_optimizer_step_with_a_grad_scale_equals_a_step_on_scaled_gradients(kind, device, scale):
    """Clipping folded into the update (our AdamW, torch's fused AdamW through its grad_scale) gives the
    step, and the AdamW states, that pre-scaled gradients give: bit for bit where the scaling is exact
    (0.5, 1.0), within rounding otherwise. The states carry the scale (the first update alone is nearly
    scale-invariant)."""
    from runtime.optim import optimizer_step

    (ours, opt), (ref, ref_opt) = _adamw_pair(kind, device)
    grad = torch.randn_like(ours)
    ours.grad, ref.grad = grad.clone(), (grad.float() * scale).to(grad.dtype)
    torch.manual_seed(1)  # the same stochastic rounding draws on both sides
    optimizer_step(opt, torch.tensor(scale, device=device), torch.zeros((), device=device))
    torch.manual_seed(1)
    ref_opt.step()
    exact = scale in (0.5, 1.0)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[ours][key], ref_opt.state[ref][key], rtol=0 if exact else 2e-2, atol=0)
    # bf16 pre-scaled grads round; stochastic rounding may then land on the other neighbour
    atol = 0 if exact else 2e-2 if kind == "sr" else 1e-6
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=atol)


def test_fused_adamw_is_left_without_a_grad_scale():
    """The AMP attributes lent to torch's fused AdamW for one step do not stay (a later plain step, or a
    GradScaler, would find them)."""
    from runtime.optim import optimizer_step

    (p, opt), _ = _adamw_pair("fused", "cpu")
    p.grad = torch.randn_like(p)
    optimizer_step(opt, torch.tensor(0.25), torch.tensor(0.0))
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["plain", "fused", "sr"])
def test_a_skipped_step_changes_nothing_and_is_not_counted(kind, device):
    """A step skipped on the device (a non-finite gradient) leaves the parameter and the states as they were,
    and does not count: the next step equals a first step of an optimizer that never saw the skipped one."""
    from runtime.optim import optimizer_step

    (ours, opt), (ref, ref_opt) = _adamw_pair(kind, device)
    before = ours.detach().clone()
    ours.grad = torch.full_like(ours, float("nan"))
    optimizer_step(opt, torch.tensor(1.0, device=device), torch.ones((), device=device))
    assert torch.equal(ours.detach(), before)
    grad = torch.randn_like(ours)
    ours.grad, ref.grad = grad.clone(), grad.clone()
    torch.manual_seed(1)
    optimizer_step(opt, torch.tensor(1.0, device=device), torch.zeros((), device=device))
    torch.manual_seed(1)
    ref_opt.step()
    assert float(opt.state[ours]["step"]) == 1.0
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[ours][key], ref_opt.state[ref][key], rtol=0, atol=0)
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=0)


class _Stack(nn.Module):
    """Embedding, four identical layers, a head: the shape of a decoder for the optimizer's chunking."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(4))
        self.head = nn.Linear(8, 12, bias=False)


def test_layer_chunks_name_each_parameter_by_its_numbered_module():
    from runtime.optim import layer_chunks

    model = _Stack().bfloat16()
    model.layers[3][1].weight.requires_grad_(False)
    chunks = {name: layer_chunks(model).get(p) for name, p in model.named_parameters()}
    assert chunks["embed.weight"] == "" and chunks["head.weight"] == ""
    assert chunks["layers.2.0.weight"] == chunks["layers.2.1.bias"] == "layers.2"
    assert chunks["layers.3.1.weight"] is None  # frozen: not the optimizer's


def test_chunked_update_compiles_one_graph_per_distinct_layer_and_matches_one_call(monkeypatch):
    """The update runs per layer: four identical layers share one compiled graph (3 graphs: embedding,
    layer, head), and the weights equal one eager call over every parameter (same rounding draws)."""
    from torch._dynamo.testing import CompileCounter

    from runtime import optim

    def run(chunked: bool):
        torch.manual_seed(0)
        model = _Stack().bfloat16()
        params = list(model.parameters())
        opt = optim.StochasticRoundingAdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                            chunk_of=optim.layer_chunks(model) if chunked else None)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step(grad_scale=0.5)
        return [p.detach() for p in params]

    reference = run(chunked=False)
    counter = CompileCounter()
    torch._dynamo.reset()
    monkeypatch.setattr(optim, "_adamw_update", torch.compile(optim._adamw_update, backend=counter, fullgraph=True,
                                                              dynamic=False))
    chunked = run(chunked=True)
    assert counter.frame_count == 3
    assert all(torch.equal(a, b) for a, b in zip(chunked, reference))
