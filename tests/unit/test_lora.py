"""LoRA on our model: freezing, zero-B identity, PEFT export that transformers + peft reproduce, import."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe.experts import GroupedExperts
from runtime.config import LoraConfig
from runtime.lora import (
    LoRAFormatError,
    LoRALinear,
    apply_lora,
    experts_A_from_peft,
    experts_A_to_peft,
    experts_B_from_peft,
    experts_B_to_peft,
    export_peft,
    load_peft,
    lora_state_dict,
)
from runtime.models import from_pretrained
from tests.conftest import write_hf_checkpoint

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]
# 2I = 48 != H = 64, so swapping gate_up and down factors cannot go unnoticed by a shape.
MOE_OVERRIDES = {"moe_intermediate_size": 24}


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(seed))


def lora_cfg(targets=ALL_TARGETS, **kw) -> LoraConfig:
    return LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=targets, **kw)


def randomize_lora_(model: torch.nn.Module, seed: int = 5) -> None:
    """Nonzero A and B everywhere, so every factor and its layout shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(lora_state_dict(model).items()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def ours_from(path, backend: str = "eager"):
    return from_pretrained(path, expert_backend=backend, norm_rope_impl="torch")


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_moe")
    write_hf_checkpoint(path, "moe", **MOE_OVERRIDES)
    return path


def test_only_lora_is_trainable_and_base_weights_are_not_copied(moe_ckpt):
    model = ours_from(moe_ckpt)
    q = model.model.layers["0"].self_attn.q_proj
    q_weight = q.weight
    apply_lora(model, lora_cfg())
    new_q = model.model.layers["0"].self_attn.q_proj
    assert isinstance(new_q, LoRALinear) and new_q.weight is q_weight
    assert new_q.lora_A.shape == (4, 64) and new_q.lora_B.shape == (64, 4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model))
    # 3 layers x (4 attention projections x 2 factors + experts' 4 factors)
    assert len(trainable) == 3 * (4 * 2 + 4)
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()


def test_fresh_lora_leaves_logits_unchanged(moe_ckpt):
    model = ours_from(moe_ckpt)
    with torch.no_grad():
        before = model(ids())
        after = apply_lora(model, lora_cfg())(ids())
    assert torch.equal(before, after)


def test_disabled_config_is_a_no_op(moe_ckpt):
    model = ours_from(moe_ckpt)
    apply_lora(model, LoraConfig(enabled=False))
    assert not lora_state_dict(model) and all(p.requires_grad for p in model.parameters())


def test_expert_layout_maps_are_inverse_and_match_peft_math():
    E, r, O, I = 3, 2, 5, 4
    A, B = torch.randn(E, r, I), torch.randn(E, O, r)
    A_p, B_p = experts_A_to_peft(A), experts_B_to_peft(B)
    assert A_p.shape == (E * r, I) and B_p.shape == (O, r * E)
    assert torch.equal(experts_A_from_peft(A_p, E), A) and torch.equal(experts_B_from_peft(B_p, E), B)
    # PEFT ParamWrapper.get_delta_weight for an (experts, out, in) parameter.
    delta = torch.einsum("o r e, e r i -> e o i", B_p.reshape(O, -1, E), A_p.reshape(E, -1, I))
    assert torch.allclose(delta, B @ A, atol=1e-6)


CASES = {
    "moe_all_eager": ("moe", ALL_TARGETS, "eager", 0.0),
    "moe_all_grouped_mm_dropout": ("moe", ALL_TARGETS, "grouped_mm", 0.1),
    "moe_experts_only": ("moe", ["experts"], "eager", 0.0),
    "dense_attention": ("dense", ["q_proj", "k_proj", "v_proj", "o_proj"], "eager", 0.05),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_loads_our_export_and_reproduces_logits(tmp_path, case):
    kind, targets, backend, dropout = CASES[case]
    hf = write_hf_checkpoint(tmp_path / "base", kind, **(MOE_OVERRIDES if kind == "moe" else {}))
    ours = ours_from(tmp_path / "base", backend)
    with torch.no_grad():
        base_logits = ours(ids())
    apply_lora(ours, lora_cfg(targets, dropout=dropout))
    randomize_lora_(ours)
    ours.eval()
    with torch.no_grad():
        our_logits = ours(ids())
    assert (our_logits - base_logits).abs().max() > 1e-2  # the adapter matters

    export_peft(ours, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter")
    with torch.no_grad():
        peft_logits = peft_model(ids()).logits
    assert (peft_logits - our_logits).abs().max().item() <= 1e-4

    fresh = load_peft(ours_from(tmp_path / "base", backend), tmp_path / "adapter").eval()
    with torch.no_grad():
        # 1e-5, not bit-equal: an adapter targeting experts is written with dropout 0, so the reloaded model's
        # q/k/v run as one GEMM where ours (dropout) ran three: fp32 rounding apart
        assert (fresh(ids()) - our_logits).abs().max().item() <= 1e-5
    assert {n for n, p in fresh.named_parameters() if p.requires_grad} == set(lora_state_dict(fresh))


def normalized_config(path) -> dict:
    cfg = json.loads((path / "adapter_config.json").read_text())
    return {k: sorted(v) if isinstance(v, list) else v for k, v in cfg.items()}


def tensor_layout(path) -> dict:
    with safe_open(path / "adapter_model.safetensors", "pt") as f:
        slices = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        layout = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in slices.items()}
        return {"metadata": f.metadata(), **layout}


def peft_twin_config(targets):
    attention = [t for t in targets if t != "experts"]
    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if "experts" in targets else None
    return PeftLoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=attention,
                          target_parameters=params)


@pytest.mark.parametrize("targets", [ALL_TARGETS, ["experts"]])
def test_export_is_what_peft_writes(tmp_path, targets):
    hf = write_hf_checkpoint(tmp_path / "base", "moe", **MOE_OVERRIDES)
    ours = apply_lora(ours_from(tmp_path / "base"), lora_cfg(targets))
    export_peft(ours, tmp_path / "ours")
    get_peft_model(hf, peft_twin_config(targets)).save_pretrained(tmp_path / "peft")
    assert normalized_config(tmp_path / "ours") == normalized_config(tmp_path / "peft")
    assert tensor_layout(tmp_path / "ours") == tensor_layout(tmp_path / "peft")


def test_import_of_an_adapter_peft_trained(tmp_path):
    """The other direction: an adapter PEFT wrote (nonzero B) loads into our model with PEFT's logits."""
    hf = write_hf_checkpoint(tmp_path / "base", "moe", **MOE_OVERRIDES)
    peft_model = get_peft_model(hf, peft_twin_config(ALL_TARGETS))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        peft_model.eval()
        peft_logits = peft_model(ids()).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    ours = load_peft(ours_from(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        assert (ours(ids()) - peft_logits).abs().max().item() <= 1e-4


def test_import_into_ep_local_experts(tmp_path, moe_ckpt):
    """An EP rank's GroupedExperts (experts 4..7 of 8) receives its slice of every expert factor."""
    full = apply_lora(ours_from(moe_ckpt), lora_cfg())
    randomize_lora_(full)
    export_peft(full, tmp_path / "adapter")
    local = ours_from(moe_ckpt)
    for block in local.moe_blocks():
        e = block.experts
        block.experts = GroupedExperts(4, e.hidden, e.intermediate, expert_offset=4)
    load_peft(local, tmp_path / "adapter")
    full_state = lora_state_dict(full)
    for name, t in lora_state_dict(local).items():
        expected = full_state[name][4:8] if ".experts." in name else full_state[name]
        assert torch.equal(t, expected), name


def test_load_into_model_with_lora_applied_checks_hyperparameters(tmp_path, moe_ckpt):
    model = apply_lora(ours_from(moe_ckpt), lora_cfg())
    randomize_lora_(model)
    export_peft(model, tmp_path / "adapter")
    same = apply_lora(ours_from(moe_ckpt), lora_cfg())
    load_peft(same, tmp_path / "adapter")
    loaded, exported = lora_state_dict(same), lora_state_dict(model)
    assert all(torch.equal(loaded[k], exported[k]) for k in exported)
    other = apply_lora(ours_from(moe_ckpt), LoraConfig(enabled=True, rank=8, alpha=16.0))
    with pytest.raises(LoRAFormatError, match="lora.rank"):
        load_peft(other, tmp_path / "adapter")


def test_load_reports_missing_and_misshapen_keys(tmp_path, moe_ckpt):
    model = apply_lora(ours_from(moe_ckpt), lora_cfg())
    export_peft(model, tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    dropped = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    misshapen = "base_model.model.model.layers.2.mlp.experts.base_layer.lora_A.weight"
    del tensors[dropped]
    tensors[misshapen] = tensors[misshapen][:-1]
    save_file(tensors, weights)
    with pytest.raises(LoRAFormatError) as err:
        load_peft(ours_from(moe_ckpt), tmp_path / "adapter")
    assert f"missing keys (1): {dropped}" in str(err.value)
    assert f"{misshapen}: adapter (31, 64) vs model (32, 64)" in str(err.value)


def test_unsupported_peft_options_are_refused(tmp_path, moe_ckpt):
    export_peft(apply_lora(ours_from(moe_ckpt), lora_cfg()), tmp_path / "adapter")
    cfg_file = tmp_path / "adapter" / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "use_dora": True}))
    with pytest.raises(LoRAFormatError, match="use_dora"):
        load_peft(ours_from(moe_ckpt), tmp_path / "adapter")


def test_experts_target_on_dense_model_names_the_config_key(tmp_path):
    write_hf_checkpoint(tmp_path, "dense")
    with pytest.raises(ValueError, match=r"lora\.target_modules.*\['experts'\].*dense"):
        apply_lora(ours_from(tmp_path), lora_cfg())


def test_dropout_acts_in_train_mode_only(moe_ckpt):
    model = apply_lora(ours_from(moe_ckpt), lora_cfg(dropout=0.5))
    randomize_lora_(model)
    torch.manual_seed(0)
    with torch.no_grad():
        model.train()
        train_a, train_b = model(ids()), model(ids())
        model.eval()
        eval_a, eval_b = model(ids()), model(ids())
    assert not torch.allclose(train_a, train_b) and torch.equal(eval_a, eval_b)


def test_lora_on_gdn_projections_exports_to_peft(tmp_path):
    """LoRA on the Gated DeltaNet projections of a hybrid model round-trips through PEFT."""
    import peft

    from runtime.config import LoraConfig
    from runtime.lora import apply_lora, export_peft
    from runtime.models import from_pretrained
    from tests.conftest import write_hf_checkpoint

    hf = write_hf_checkpoint(tmp_path / "base", "qwen3_5_moe")
    ours = from_pretrained(tmp_path / "base", expert_backend="eager", norm_rope_impl="torch")
    apply_lora(ours, LoraConfig(enabled=True, rank=4, alpha=8, target_modules=["in_proj_qkv", "out_proj", "q_proj"]))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    export_peft(ours, tmp_path / "adapter")
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(0, 320, (1, 12))
    with torch.no_grad():
        assert (peft_model(input_ids=ids).logits - ours(ids)).abs().max() <= 1e-4


def _lora_formula(x, weight, bias, lora_A, lora_B, scaling):
    """The adapter's definition, written out (PEFT's LoRA layer): x W^T + b + scaling * (x A^T) B^T."""
    return x @ weight.T + bias + scaling * (x @ lora_A.T) @ lora_B.T


@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("base_trains", [False, True])
def test_the_one_node_lora_linear_is_the_formula_and_its_gradients(x_grad, base_trains):
    """LoRALinear's single autograd node (no dropout) against the formula in float64: output and the gradients
    of the input, both factors and (where it trains) the base; without an input gradient (the first block's
    projections) the factors still get theirs."""
    from runtime.lora import LoRALinear

    torch.manual_seed(0)  # the base's and A's init
    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(12, 10)
    layer = LoRALinear(base, rank=4, alpha=8.0)
    with torch.no_grad():
        layer.lora_B.normal_(generator=g)
    layer.weight.requires_grad_(base_trains)
    layer.bias.requires_grad_(base_trains)
    x = torch.randn(3, 5, 12, generator=g, requires_grad=x_grad)
    grad_y = torch.randn(3, 5, 10, generator=g)
    layer(x).backward(grad_y)
    leaves = [t.detach().double().requires_grad_() for t in (x, layer.weight, layer.bias, layer.lora_A, layer.lora_B)]
    y64 = _lora_formula(*leaves, layer.lora_scaling)
    y64.backward(grad_y.double())
    torch.testing.assert_close(layer(x).double(), y64, rtol=1e-5, atol=1e-5)
    ours = [x.grad, layer.weight.grad, layer.bias.grad, layer.lora_A.grad, layer.lora_B.grad]
    wanted = [x_grad, base_trains, base_trains, True, True]
    for got, ref, want in zip(ours, leaves, wanted, strict=True):
        if want:
            torch.testing.assert_close(got.double(), ref.grad, rtol=1e-5, atol=1e-5)
        else:
            assert got is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_the_one_node_lora_linear_under_autocast_computes_in_its_dtype(device):
    """Under bf16 autocast (fp32 factors, as LoRA's masters): a bf16 output within bf16 rounding of the formula,
    fp32 factor gradients."""
    from runtime.lora import LoRALinear

    torch.manual_seed(1)  # the base's and A's init
    g = torch.Generator().manual_seed(1)
    layer = LoRALinear(torch.nn.Linear(32, 16, bias=False), rank=8, alpha=16.0).to(device)
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g))
    layer.weight.requires_grad_(False)
    x = torch.randn(4, 32, generator=g).to(device).requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert layer.lora_A.grad.dtype == layer.lora_B.grad.dtype == torch.float32
    ref = _lora_formula(x.detach().double(), layer.weight.double(), 0.0, layer.lora_A.double(), layer.lora_B.double(),
                        layer.lora_scaling)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-2 * ref.abs().max().item())  # bf16 products
