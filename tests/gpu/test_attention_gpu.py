"""GPU tests of the varlen "flash" attention backend (attention/attention.py) on packed documents.

- bf16 `Qwen3Attention` with backend "flash" vs the same weights with backend "sdpa" (the block-diagonal
  causal mask): the output and the grads of x and of every parameter, norm-relative <= 2e-2. GQA (16 q
  heads on 4 kv heads, head_dim 128), plain and gated (partial rotary, rotary_dim 64 < head_dim); one
  packed row, two packed rows, packed rows with cu_seqlens derived from position_ids alone, unpacked rows.
- The same under bf16 autocast with fp32 parameters (how runtime/train.py runs the model).
- Isolation: perturbing some tokens changes no output of another document (another row included) and
  none of the earlier tokens of their own document.
- Rows of one document each take cuDNN's fused kernel on Hopper (dense_causal), checked the same way.
- The implementation that ran (flash-attn or torch's varlen_attn) is named in a warning in the log.

Shapes: x [B, S, hidden]; documents are packed along S; cu_seqlens run over the flattened B*S tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from attention.attention import Qwen3Attention, build_attn_meta, dense_causal, varlen_impl
from attention.rope import RopeConfig, RotaryEmbedding
from runtime.models.qwen import cu_seqlens_from_position_ids
from tests.conftest import perturb_

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EPS = 1024, 16, 4, 128, 1e-6
TOL = 2e-2
ONE_ROW = [[300, 1000, 700, 48]]
TWO_ROWS = [[300, 1000, 700, 48], [1024, 1, 511, 512]]  # a 1-token document; rows end inside no document
# name: (document lengths per row, where the flash backend's cu_seqlens come from)
CASES = {
    "one_row": (ONE_ROW, "collator"),
    "two_rows": (TWO_ROWS, "collator"),
    "two_rows_cu_from_positions": (TWO_ROWS, "positions"),
    "unpacked_rows": ([[2048], [2048]], "none"),  # one document per row: cuDNN on Hopper (dense_causal)
    "one_document_per_row": ([[2048], [2048]], "collator"),  # B + 1 boundaries: cuDNN on Hopper too
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def positions(rows: list[list[int]]) -> torch.Tensor:
    """[B, S] positions restarting at 0 at every document start."""
    return torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in rows]).cuda()


def make_layers(gated: bool, dtype: torch.dtype) -> tuple[Qwen3Attention, Qwen3Attention]:
    """A flash layer and an sdpa layer holding the same random weights (norm weights too)."""
    common = {"gated": gated, "rotary_dim": 64 if gated else None, "device": "cuda", "dtype": dtype}
    flash = Qwen3Attention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EPS, backend="flash", **common)
    sdpa = Qwen3Attention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EPS, backend="sdpa", **common)
    perturb_(flash, seed=1)
    sdpa.load_state_dict(flash.state_dict())
    return flash, sdpa


def rope_tables(pos_BS: torch.Tensor, gated: bool, dtype: torch.dtype):
    rotary = RotaryEmbedding(RopeConfig(theta=1e6, partial_rotary_factor=0.5 if gated else 1.0), HEAD_DIM,
                             device="cuda")
    assert rotary.rotary_dim == (64 if gated else HEAD_DIM)
    return rotary(pos_BS, dtype)


def metas(pos_BS: torch.Tensor, source: str):
    """(flash meta, sdpa meta) built the way QwenForCausalLM.hidden_states builds them."""
    if source == "none":  # no position_ids: every row is one document
        return build_attn_meta(None, backend="flash"), build_attn_meta(None, backend="sdpa")
    cu, max_len = cu_seqlens_from_position_ids(pos_BS)
    flash = build_attn_meta(pos_BS, cu, max_len, "flash") if source == "collator" else \
        build_attn_meta(pos_BS, backend="flash")
    assert torch.equal(flash.cu_seqlens, cu) and flash.max_seqlen == max_len and flash.sdpa_mask_B1SS is None
    return flash, build_attn_meta(pos_BS, cu, max_len, "sdpa")


def forward_and_grads(layer, x_BSH, cos, sin, meta, grad_BSH, autocast=False) -> dict[str, torch.Tensor]:
    """The output and the grads of x and of every named parameter for the upstream grad `grad_BSH`;
    `autocast` runs the forward (only, as train.py does) under bf16 autocast."""
    x_BSH = x_BSH.detach().clone().requires_grad_()
    names, params = zip(*sorted(layer.named_parameters()))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out_BSH = layer(x_BSH, cos, sin, meta)
    grads = torch.autograd.grad(out_BSH, [x_BSH, *params], grad_BSH.to(out_BSH.dtype))
    return {"out": out_BSH.detach(), "x": grads[0], **dict(zip(names, grads[1:]))}


def assert_close(ours: dict, ref: dict) -> None:
    assert ours.keys() == ref.keys()
    errors = {name: rel_err(ours[name], ref[name]) for name in ref}
    assert all(err <= TOL for err in errors.values()), errors


def test_varlen_implementation_is_available():
    impl = varlen_impl()
    assert impl is not None, "neither flash-attn nor torch.nn.attention.varlen is importable"
    warnings.warn(f"flash backend runs on: {impl.name}", stacklevel=1)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gated", [False, True])
def test_bf16_flash_matches_sdpa_on_packed_documents(case, gated):
    rows, source = CASES[case]
    pos_BS = positions(rows)
    flash, sdpa = make_layers(gated, torch.bfloat16)
    cos, sin = rope_tables(pos_BS, gated, torch.bfloat16)
    flash_meta, sdpa_meta = metas(pos_BS, source)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x_BSH = torch.randn(*pos_BS.shape, HIDDEN, device="cuda", generator=gen).bfloat16()
    grad_BSH = torch.randn(*pos_BS.shape, HIDDEN, device="cuda", generator=gen)
    ours = forward_and_grads(flash, x_BSH, cos, sin, flash_meta, grad_BSH)
    ref = forward_and_grads(sdpa, x_BSH, cos, sin, sdpa_meta, grad_BSH)
    assert ours["out"].dtype == torch.bfloat16
    assert_close(ours, ref)


def test_dense_causal_path_is_chosen_on_hopper():
    assert dense_causal() == (torch.cuda.get_device_capability() >= (9, 0))


@pytest.mark.parametrize("rows", [TWO_ROWS, [[2048], [2048]]], ids=["packed", "one_document_per_row"])
@pytest.mark.parametrize("gated", [False, True])
def test_flash_under_bf16_autocast_with_fp32_parameters(gated, rows):
    """The training path: fp32 master weights, bf16 autocast; the flash backend casts q/k/v itself."""
    pos_BS = positions(rows)
    flash, sdpa = make_layers(gated, torch.float32)
    cos, sin = rope_tables(pos_BS, gated, torch.float32)
    flash_meta, sdpa_meta = metas(pos_BS, "collator")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x_BSH = torch.randn(*pos_BS.shape, HIDDEN, device="cuda", generator=gen)
    grad_BSH = torch.randn(*pos_BS.shape, HIDDEN, device="cuda", generator=gen)
    ours = forward_and_grads(flash, x_BSH, cos, sin, flash_meta, grad_BSH, autocast=True)
    ref = forward_and_grads(sdpa, x_BSH, cos, sin, sdpa_meta, grad_BSH, autocast=True)
    assert ours["out"].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for name, g in ours.items() if name not in ("out", "x"))
    assert_close(ours, ref)


# (row, first token, end token) perturbed: the tail of a document (its head must not change), a whole
# document at the end of row 0 (row 1 must not change), the 1-token document of row 1.
PERTURBED = [(0, 800, 1300), (0, 2000, 2048), (1, 1024, 1025)]


@pytest.mark.parametrize("row,begin,end", PERTURBED)
@pytest.mark.parametrize("gated", [False, True])
@torch.no_grad()
def test_flash_keeps_documents_isolated(gated, row, begin, end):
    pos_BS = positions(TWO_ROWS)
    flash, _ = make_layers(gated, torch.bfloat16)
    cos, sin = rope_tables(pos_BS, gated, torch.bfloat16)
    meta, _ = metas(pos_BS, "collator")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x_BSH = torch.randn(*pos_BS.shape, HIDDEN, device="cuda", generator=gen).bfloat16()
    perturbed_BSH = x_BSH.clone()
    perturbed_BSH[row, begin:end] += torch.randn(end - begin, HIDDEN, device="cuda", generator=gen).bfloat16()
    base_BSH, out_BSH = flash(x_BSH, cos, sin, meta), flash(perturbed_BSH, cos, sin, meta)
    changed_BS = torch.zeros(pos_BS.shape, dtype=torch.bool, device="cuda")
    changed_BS[row, begin:end] = True
    diff_BSH = (out_BSH.float() - base_BSH.float()).abs()
    # A leak moves some token's output by a sizeable fraction of what the perturbed tokens move; the
    # forward is deterministic, so the unchanged tokens are expected bit-identical (the bound allows
    # for rounding noise all the same).
    assert diff_BSH[changed_BS].max() > 0.1 * base_BSH[changed_BS].float().abs().max()
    assert diff_BSH[~changed_BS].max() <= 1e-2 * diff_BSH[changed_BS].max(), diff_BSH[~changed_BS].max()
