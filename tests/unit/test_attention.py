"""Our attention layers vs transformers' on the same weights (fp32): Qwen3 and the gated
Qwen3-Next attention (partial rotary, (1+w) q/k norms, sigmoid output gate), forward and grads.
The varlen "flash" backend on the CPU: which implementation is chosen, how torch's varlen_attn
signatures are called, and the errors that name the fix."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from attention import attention as attn_mod
from attention.attention import (
    ATTN_BACKENDS,
    AttnMeta,
    Qwen3Attention,
    build_attn_meta,
    repeat_kv_heads,
    sdpa_attention,
)
from attention.rope import RopeConfig, RotaryEmbedding
from runtime.config import ConfigError
from tests.conftest import perturb_


def _hf_layer(kind: str):
    if kind == "qwen3":
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention as HF
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Rot

        cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention as HF
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding as Rot

        cfg = Qwen3NextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              partial_rotary_factor=0.25)
    cfg._attn_implementation = "sdpa"
    return cfg, HF(cfg, layer_idx=0), Rot(cfg)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next"])
def test_attention_matches_transformers(kind):
    cfg, hf, hf_rope = _hf_layer(kind)
    perturb_(hf, seed=1)
    gated = kind == "qwen3_next"
    rope = RopeConfig(theta=cfg.rope_parameters["rope_theta"],
                      partial_rotary_factor=cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    rotary = RotaryEmbedding(rope, 16)
    ours = Qwen3Attention(64, 4, 2, 16, cfg.rms_norm_eps, gated=gated, rotary_dim=rotary.rotary_dim,
                          norm_rope_impl="torch")
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 10, 64, requires_grad=True)
    pos = torch.arange(10).expand(2, 10)
    cos, sin = rotary(pos, x.dtype)
    hf_cos, hf_sin = hf_rope(x, pos)
    assert torch.allclose(cos, hf_cos, atol=1e-6)
    mask = torch.ones(10, 10, dtype=torch.bool).tril().expand(2, 1, 10, 10)
    ref = hf(x, (hf_cos, hf_sin), attention_mask=mask)[0]
    out = ours(x, cos, sin, AttnMeta())
    assert (out - ref).abs().max() <= 1e-5
    g = torch.randn_like(out)
    ref_grads = torch.autograd.grad((ref * g).sum(), [x, *hf.parameters()])
    our_grads = torch.autograd.grad((out * g).sum(), [x, *ours.parameters()])
    for a, b in zip(our_grads, ref_grads):
        assert (a - b).norm() / b.norm() <= 1e-5


# --- varlen "flash" backend: implementation choice, torch varlen_attn adapters, CPU errors ----------
# The CPU has no varlen kernel, so stand-ins with torch's signatures compute per-document causal
# attention by explicit loops; what is tested is our choice of implementation and how we call it.

def _loop_varlen_reference(q_THD, k_TKD, v_TKD, cu, causal, scale):
    """Per-document attention, one query at a time (kv heads shared by groups of q heads)."""
    n_rep = q_THD.shape[1] // k_TKD.shape[1]
    out = torch.empty_like(q_THD)
    bounds = cu.tolist()
    for lo, hi in itertools.pairwise(bounds):
        for i in range(lo, hi):
            end = i + 1 if causal else hi
            for h in range(q_THD.shape[1]):
                scores = (k_TKD[lo:end, h // n_rep] @ q_THD[i, h]) * scale
                out[i, h] = scores.softmax(0) @ v_TKD[lo:end, h // n_rep]
    return out


def _stand_in(signature: str, calls: list):
    """A varlen_attn with one of torch's signatures, enforcing what torch enforces."""
    def is_causal_v210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                       is_causal=False, scale=None):
        calls.append({"is_causal": is_causal, "scale": scale})
        assert query.shape[1] == key.shape[1], "no GQA in this signature"
        return _loop_varlen_reference(query, key, value, cu_seq_q, is_causal, scale or query.shape[-1] ** -0.5)

    def is_causal_no_scale(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                           return_aux=None):
        calls.append({"is_causal": is_causal})
        assert query.shape[1] == key.shape[1], "no GQA in this signature"
        return _loop_varlen_reference(query, key, value, cu_seq_q, is_causal, query.shape[-1] ** -0.5)

    def window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1)):
        calls.append({"window_size": window_size, "scale": scale})
        assert query.shape[1] == key.shape[1], "no GQA in this signature"
        causal = window_size == (-1, 0)  # what torch does: a list [-1, 0] would silently mean non-causal
        return _loop_varlen_reference(query, key, value, cu_seq_q, causal, scale or query.shape[-1] ** -0.5)

    def window_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.append({"window_size": window_size, "scale": scale, "enable_gqa": enable_gqa})
        if not enable_gqa and query.shape[1] != key.shape[1]:
            raise ValueError("Hq != Hkv needs enable_gqa=True")
        causal = window_size == (-1, 0)
        return _loop_varlen_reference(query, key, value, cu_seq_q, causal, scale or query.shape[-1] ** -0.5)

    return {"is_causal_v210": is_causal_v210, "is_causal_no_scale": is_causal_no_scale, "window": window,
            "window_gqa": window_gqa}[signature]


def _no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    raise AssertionError("never called")


def _fake_flash_attn(*args, **kwargs):
    raise AssertionError("never called")


@pytest.fixture
def choose(monkeypatch):
    """choose(flash_attn_fn, torch_fn): what is importable; returns varlen_impl() chosen afresh."""
    def _choose(flash_attn_fn, torch_fn):
        monkeypatch.setattr(attn_mod, "_import_flash_attn_varlen", lambda: flash_attn_fn)
        monkeypatch.setattr(attn_mod, "_import_torch_varlen", lambda: torch_fn)
        monkeypatch.setattr(attn_mod, "_varlen_choice", attn_mod._UNCHOSEN)
        return attn_mod.varlen_impl()
    return _choose


def test_varlen_choice_prefers_flash_attn(choose):
    impl = choose(_fake_flash_attn, _stand_in("window_gqa", []))
    assert impl.name == "flash_attn"
    assert ATTN_BACKENDS.unavailable_reason("flash", "cuda") is None


@pytest.mark.parametrize("signature", ["is_causal_v210", "is_causal_no_scale", "window", "window_gqa"])
def test_varlen_choice_falls_back_to_torch(choose, signature):
    impl = choose(None, _stand_in(signature, []))
    assert impl.name == "torch"
    assert ATTN_BACKENDS.unavailable_reason("flash", "cuda") is None
    Qwen3Attention(64, 4, 2, 16, 1e-6, backend="flash")


@pytest.mark.parametrize("torch_fn", [None, _no_causal], ids=["no_varlen", "varlen_without_causal"])
def test_flash_backend_unavailable_is_a_clear_error(choose, torch_fn):
    assert choose(None, torch_fn) is None
    from runtime.choices import Needs
    from runtime.choices import choose as plan_choose

    with pytest.raises(ConfigError, match="model.attn_backend: flash cannot run here: it needs flash-attn installed"):
        plan_choose("model.attn_backend", "flash", Needs("cuda"))
    assert plan_choose("model.attn_backend", "auto", Needs("cuda"))[0] == "sdpa"  # no varlen kernel: the mask path


def test_unknown_backend_names_the_config_key():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flex'.*\['auto', 'flash', 'sdpa'\].*model.attn_backend"):
        Qwen3Attention(64, 4, 2, 16, 1e-6, backend="flex")


def test_varlen_choice_is_made_once(choose, monkeypatch):
    first = choose(None, _stand_in("window", []))
    monkeypatch.setattr(attn_mod, "_import_torch_varlen", lambda: None)
    assert attn_mod.varlen_impl() is first


def test_installed_torch_varlen_signature_is_understood():
    """The torch installed here (if it has varlen_attn) adapts: causal via window_size or is_causal."""
    fn = attn_mod._import_torch_varlen()
    if fn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    params = inspect.signature(fn).parameters
    assert "window_size" in params or "is_causal" in params
    assert attn_mod._torch_varlen_caller(fn) is not None


@pytest.mark.parametrize("n_rep", [1, 2, 4])
def test_repeat_kv_heads_matches_gqa_grouping(n_rep):
    kv_TKD = torch.randn(7, 3, 5, requires_grad=True)
    out = repeat_kv_heads(kv_TKD, n_rep)
    ref = torch.stack([kv_TKD[:, h // n_rep] for h in range(3 * n_rep)], dim=1)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * g).sum(), kv_TKD)
    (ref_grad,) = torch.autograd.grad((ref * g).sum(), kv_TKD)
    assert torch.allclose(grad, ref_grad, atol=1e-6)  # the copies may be summed in another order


def _packed_positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in rows])


@pytest.mark.parametrize("signature", ["is_causal_v210", "is_causal_no_scale", "window", "window_gqa"])
def test_torch_varlen_adapter_matches_packed_sdpa(signature):
    """Each signature gets causal, GQA (4 q heads on 2 kv heads) and document isolation right."""
    calls = []
    call = attn_mod._torch_varlen_caller(_stand_in(signature, calls))
    pos_BS = _packed_positions([[3, 6, 1], [10]])
    B, S = pos_BS.shape
    q_BSHD, k_BSKD, v_BSKD = torch.randn(B, S, 4, 8), torch.randn(B, S, 2, 8), torch.randn(B, S, 2, 8)
    meta = build_attn_meta(pos_BS, backend="flash")
    out_THD = call(q_BSHD.flatten(0, 1), k_BSKD.flatten(0, 1), v_BSKD.flatten(0, 1), meta.cu_seqlens,
                   meta.max_seqlen, 8 ** -0.5)
    ref_BSHD = sdpa_attention(q_BSHD, k_BSKD, v_BSKD, build_attn_meta(pos_BS), 8 ** -0.5)
    assert torch.allclose(out_THD.unflatten(0, (B, S)), ref_BSHD, atol=1e-5)
    (kwargs,) = calls
    assert kwargs.get("is_causal", True) is True and kwargs.get("window_size", (-1, 0)) == (-1, 0)
    assert type(kwargs.get("window_size", ())) is tuple


def test_torch_varlen_adapter_refuses_a_scale_it_cannot_pass():
    call = attn_mod._torch_varlen_caller(_stand_in("is_causal_no_scale", []))
    q_THD = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    call(q_THD, q_THD, q_THD, cu, 4, 8 ** -0.5)
    with pytest.raises(ValueError, match="no scale argument"):
        call(q_THD, q_THD, q_THD, cu, 4, 0.5)


def test_flash_meta_derives_cu_seqlens_from_positions():
    pos_BS = _packed_positions([[3, 6, 1], [4, 6]])
    meta = build_attn_meta(pos_BS, backend="flash")
    assert meta.sdpa_mask_B1SS is None
    assert meta.cu_seqlens.dtype == torch.int32 and meta.cu_seqlens.tolist() == [0, 3, 9, 10, 14, 20]
    assert meta.max_seqlen == 6
    cu, max_len = meta.cu_seqlens, meta.max_seqlen
    given = build_attn_meta(pos_BS, cu, max_len, backend="flash")
    assert given.cu_seqlens is cu


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("packed", [True, False])
def test_flash_layer_matches_sdpa_layer_with_stand_in_kernel(choose, monkeypatch, gated, packed):
    """The layer's flash path (flatten, cu_seqlens, GQA, unflatten) in fp32 on the CPU: the device
    guard is lifted and a reference-math stand-in plays torch's kernel."""
    choose(None, _stand_in("window", []))
    monkeypatch.setattr(attn_mod, "_check_varlen_inputs", lambda q, dtype: None)
    torch.manual_seed(0)
    flash = Qwen3Attention(32, 4, 2, 8, 1e-6, backend="flash", gated=gated, rotary_dim=4 if gated else None,
                           norm_rope_impl="torch")
    sdpa = Qwen3Attention(32, 4, 2, 8, 1e-6, backend="sdpa", gated=gated, rotary_dim=4 if gated else None,
                          norm_rope_impl="torch")
    perturb_(flash, seed=2)
    sdpa.load_state_dict(flash.state_dict())
    pos_BS = _packed_positions([[3, 6, 1], [10]]) if packed else None
    rope_pos = pos_BS if packed else torch.arange(10).expand(2, 10)
    rotary = RotaryEmbedding(RopeConfig(partial_rotary_factor=0.5 if gated else 1.0), 8)
    x = torch.randn(2, 10, 32)
    cos, sin = rotary(rope_pos, x.dtype)
    out = flash(x, cos, sin, build_attn_meta(pos_BS, backend="flash"))
    ref = sdpa(x, cos, sin, build_attn_meta(pos_BS, backend="sdpa"))
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_backend_on_cpu_names_the_fix(choose, dtype):
    choose(None, _stand_in("window_gqa", []))
    layer = Qwen3Attention(32, 4, 2, 8, 1e-6, backend="flash", norm_rope_impl="torch", dtype=dtype)
    x = torch.randn(1, 6, 32, dtype=dtype)
    rotary = RotaryEmbedding(RopeConfig(), 8)
    cos, sin = rotary(torch.arange(6).expand(1, 6), dtype)
    with pytest.raises(ValueError, match=r"runs on CUDA only .*set model.attn_backend: sdpa"):
        layer(x, cos, sin, build_attn_meta(None, backend="flash"))


def test_flash_backend_with_the_installed_torch_on_cpu_names_the_fix(monkeypatch):
    """No stand-ins: whatever this install picks, a CPU forward ends in our message, not a dispatcher error."""
    monkeypatch.setattr(attn_mod, "_varlen_choice", attn_mod._UNCHOSEN)
    if attn_mod.varlen_impl() is None:
        pytest.skip("no varlen implementation importable here")
    layer = Qwen3Attention(32, 4, 2, 8, 1e-6, backend="flash", norm_rope_impl="torch", dtype=torch.bfloat16)
    x = torch.randn(1, 6, 32, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(RopeConfig(), 8)(torch.arange(6).expand(1, 6), torch.bfloat16)
    with pytest.raises(ValueError, match="model.attn_backend: sdpa"):
        layer(x, cos, sin, build_attn_meta(None, backend="flash"))


def test_auto_backend_is_the_mask_path_off_cuda_and_varlen_on_cuda(choose):
    from runtime.choices import Needs
    from runtime.choices import choose as plan_choose

    def auto(device):
        return plan_choose("model.attn_backend", "auto", Needs(device))[0]
    assert auto("cpu") == "sdpa"
    choose(None, None)
    assert auto("cuda") == "sdpa"  # no varlen kernel installed: the mask path
    choose(_fake_flash_attn, None)
    assert auto("cuda") == "flash"
