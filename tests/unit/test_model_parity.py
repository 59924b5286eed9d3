"""Our Qwen3 / Qwen3-MoE vs transformers' models on the same weights (fp32): logits and every gradient."""

from __future__ import annotations

import pytest
import torch

from runtime.models import from_pretrained
from tests.conftest import label_loss_sum, packed_vs_alone, write_hf_checkpoint

CASES = {
    "moe": ("moe", {}),
    "moe_sparse_step_untopk_tied": ("moe", {"decoder_sparse_step": 2, "norm_topk_prob": False, "tie_word_embeddings": True}),
    "moe_mlp_only_yarn": ("moe", {"mlp_only_layers": [0], "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}}),
    "dense": ("dense", {}),
    "dense_tied_linear_rope": ("dense", {"tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}),
}


def hf_grad_of(hf_model, fqn: str) -> torch.Tensor:
    # Our expert tensors are named gate_up/down; transformers v5 keeps the same [E, out, in] tensors
    # as gate_up_proj/down_proj.
    hf_name = fqn.replace("experts.gate_up", "experts.gate_up_proj").replace("experts.down", "experts.down_proj")
    return dict(hf_model.named_parameters())[hf_name].grad


BACKEND_CASES = [(case, backend) for case in sorted(CASES) for backend in ("eager", "grouped_mm")] + [
    ("moe", "scattermoe")]  # Triton kernels, interpreted on the CPU


@pytest.mark.parametrize("case,backend", BACKEND_CASES)
def test_logits_and_grads_match_transformers(tmp_path, case, backend):
    kind, overrides = CASES[case]
    hf = write_hf_checkpoint(tmp_path, kind, **overrides)
    ours = from_pretrained(tmp_path, dtype=torch.float32, device="cpu", expert_backend=backend,
                           norm_rope_impl="torch")
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))

    hf_logits = hf(ids).logits
    our_logits = ours(ids)
    assert (hf_logits - our_logits).abs().max().item() <= 1e-4

    weights = torch.randn(hf_logits.shape, generator=torch.Generator().manual_seed(2))
    (hf_logits * weights).sum().backward()
    (our_logits * weights).sum().backward()
    checked = 0
    for fqn, p in ours.named_parameters():
        ref = hf_grad_of(hf, fqn)
        assert ref is not None and p.grad is not None, fqn
        err = (p.grad - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err <= 1e-4, f"{fqn}: norm-relative grad error {err:.2e}"
        checked += 1
    assert checked == len(list(hf.parameters()))


def test_packed_batch_equals_documents_one_by_one(tiny_moe_ckpt):
    model = from_pretrained(tiny_moe_ckpt, expert_backend="eager", norm_rope_impl="torch")
    for doc, packed, alone in packed_vs_alone(model, (7, 12, 5)):
        assert (alone - packed).abs().max() <= 1e-5
        # Pre-shifted targets: each document predicts its own next tokens, never the next document's.
        labels = torch.cat([doc[1:], torch.tensor([-100])]).unsqueeze(0)
        assert torch.allclose(label_loss_sum(packed, labels), label_loss_sum(alone, labels), rtol=1e-5)


def test_fused_expert_layout_loads_like_per_expert(tmp_path):
    """A checkpoint in the fused transformers-v5 key layout (gate_up_proj [E, 2I, H]) loads the same."""
    from safetensors.torch import save_file

    hf = write_hf_checkpoint(tmp_path / "per_expert", "moe")
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, fused_dir / "model.safetensors")
    (fused_dir / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    a = from_pretrained(tmp_path / "per_expert", expert_backend="eager")
    b = from_pretrained(fused_dir, expert_backend="eager")
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


def test_grouped_mm_runs_without_fallback_at_aligned_dims(caplog):
    """The fast path must not silently fall back to the per-expert loop at real (aligned) shapes."""
    from moe.backends.grouped_mm import _grouped_mm_supported

    x = torch.zeros(4, 2048, dtype=torch.bfloat16)
    assert _grouped_mm_supported(x, 2048, 1536, 768) is None
    assert _grouped_mm_supported(x, 2048, 1536, 768, 16) is None
    assert "not 16-byte aligned" in _grouped_mm_supported(x, 2048, 1536, 768, 4)


def test_balance_loss_gradient_equals_adding_it_to_the_loss(tiny_moe_ckpt):
    """The balance loss reaches the router through the MoE output's backward exactly as if
    coef * aux had been added to the loss (checked against an explicit Switch loss)."""
    import torch.nn.functional as F

    from moe.router import switch_aux_loss

    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(5))
    coef = 0.3
    with_aux = from_pretrained(tiny_moe_ckpt, expert_backend="eager", router_aux_loss_coef=coef)
    plain = from_pretrained(tiny_moe_ckpt, expert_backend="eager")
    with_aux(ids).square().mean().backward()
    inputs = {}
    hooks = [b.gate.register_forward_hook(lambda m, args, out, i=i: inputs.__setitem__(i, args[0]))
             for i, b in enumerate(plain.moe_blocks())]
    loss = plain(ids).square().mean()
    for i, block in enumerate(plain.moe_blocks()):
        probs = torch.softmax(F.linear(inputs[i], block.gate.weight), -1, dtype=torch.float32)
        loss = loss + coef * switch_aux_loss(probs, torch.topk(probs, block.gate.top_k, -1).indices)
    loss.backward()
    for h in hooks:
        h.remove()
    for (name, a), (_, b) in zip(with_aux.named_parameters(), plain.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
