"""CPU tests of attention.norm_rope.qk_norm_rope.

1. The torch reference against an oracle assembled from transformers' own modules (Qwen3RMSNorm /
   Qwen3NextRMSNorm, apply_rotary_pos_emb, the rotary embeddings for cos/sin): forward and grads in
   fp32, and bit-exact in bf16 (same cast order as Qwen3Attention).
2. The Triton kernels under TRITON_INTERPRET=1 against the reference in fp32 (forward and backward).
   The interpreter is chosen when triton.jit decorates the kernels, i.e. at the first import of
   attention.kernels.norm_rope; an in-process env var cannot be trusted (another test may have imported it
   first, and flipping it would break GPU tests in the same session). So unless this process already
   interprets the kernels, one test re-runs the `interp` cases in a subprocess with the variable set.

Shapes: q [B, S, H, D], k [B, S, K, D], cos/sin [B, S, R].
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from attention.kernels import norm_rope as kernels
from attention.kernels.norm_rope import DEFAULT_LAUNCH_SETTINGS, LaunchSettings
from attention.norm_rope import NORM_ROPE_IMPLS, qk_norm_rope, qk_norm_rope_reference
from tests.conftest import Ahead, lane_environ

EPS = 1e-6


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-relative error (the repo's tolerance measure)."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def make_inputs(batch=2, seq=5, heads_q=4, heads_k=2, head_dim=16, rotary_dim=None, dtype=torch.float32,
                cos_batch=None, seed=0):
    """q/k as non-contiguous views of one fused qkv projection output, like the attention layer has them;
    cos/sin from a real rotary table (positions restart to mimic packing) with `cos_batch` rows."""
    gen = torch.Generator().manual_seed(seed)
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    qkv_BSF = torch.randn(batch, seq, (heads_q + 2 * heads_k) * head_dim, generator=gen).to(dtype)
    q_BSHD = qkv_BSF[..., : heads_q * head_dim].unflatten(-1, (heads_q, head_dim))
    k_BSKD = qkv_BSF[..., heads_q * head_dim: (heads_q + heads_k) * head_dim].unflatten(-1, (heads_k, head_dim))
    q_w = (1.0 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype)
    k_w = (1.0 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype)
    cos_batch = batch if cos_batch is None else cos_batch
    positions = (torch.arange(seq) % 3 + 7 * torch.arange(cos_batch)[:, None]).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return q_BSHD, k_BSKD, q_w, k_w, emb.cos().to(dtype), emb.sin().to(dtype)


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A grad-requiring copy with the same strides (clone() would make a strided view contiguous)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t).requires_grad_()


def forward_and_grads(fn, q, k, q_w, k_w, cos, sin, seed=1):
    """Outputs and grads of (q, k, q_w, k_w) under fixed random upstream grads."""
    q, k, q_w, k_w = leaf(q), leaf(k), leaf(q_w), leaf(k_w)
    q_out, k_out = fn(q, k, q_w, k_w, cos, sin)
    gen = torch.Generator().manual_seed(seed)
    grad_q = torch.randn(q_out.shape, generator=gen).to(q_out.dtype)
    grad_k = torch.randn(k_out.shape, generator=gen).to(k_out.dtype)
    grads = torch.autograd.grad((q_out, k_out), (q, k, q_w, k_w), (grad_q, grad_k))
    return (q_out, k_out, *grads)


# ----------------------------------------------------------------------------- transformers oracle


def transformers_oracle(q_BSHD, k_BSKD, q_w, k_w, cos, sin, unit_offset: bool):
    """transformers' Qwen3 (or Qwen3-Next, whose norm is (1 + w)) attention prologue, as its modules do it."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, apply_rotary_pos_emb

    head_dim = q_BSHD.shape[-1]

    def norm(x, w):
        module = Qwen3NextRMSNorm(head_dim, eps=EPS) if unit_offset else Qwen3RMSNorm(head_dim, eps=EPS)
        return torch.func.functional_call(module, {"weight": w}, (x,))

    # Qwen3Attention normalizes in [B, S, H, D], transposes to [B, H, S, D], then rotates
    # (qwen3_next's apply_rotary_pos_emb also handles partial rotary; with R == D it is Qwen3's).
    q_BHSD, k_BKSD = apply_rotary_pos_emb(norm(q_BSHD, q_w).transpose(1, 2), norm(k_BSKD, k_w).transpose(1, 2),
                                          cos, sin)
    return q_BHSD.transpose(1, 2), k_BKSD.transpose(1, 2)


def transformers_cos_sin(batch: int, seq: int, head_dim: int, partial: float, dtype: torch.dtype):
    """cos/sin from the rotary embedding modules themselves, so the layout assumption is tested too."""
    from transformers import Qwen3Config, Qwen3NextConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

    common = {"head_dim": head_dim, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    if partial == 1.0:
        rotary = Qwen3RotaryEmbedding(Qwen3Config(**common))
    else:
        rotary = Qwen3NextRotaryEmbedding(Qwen3NextConfig(partial_rotary_factor=partial, **common))
    position_ids = (torch.arange(seq) + 11 * torch.arange(batch)[:, None])
    return rotary(torch.empty(1, dtype=dtype), position_ids)


ORACLE_CASES = [(False, 1.0), (True, 1.0), (False, 0.25), (True, 0.5)]


@pytest.mark.parametrize("unit_offset,partial", ORACLE_CASES)
def test_reference_matches_transformers_fp32(unit_offset, partial):
    head_dim = 32
    cos, sin = transformers_cos_sin(2, 6, head_dim, partial, torch.float32)
    assert cos.shape == (2, 6, int(head_dim * partial))
    q, k, q_w, k_w, _, _ = make_inputs(seq=6, head_dim=head_dim)

    ours = forward_and_grads(
        lambda *a: qk_norm_rope(*a, EPS, unit_offset=unit_offset, rotary_dim=cos.shape[-1], impl="torch"),
        q, k, q_w, k_w, cos, sin)
    oracle = forward_and_grads(lambda *a: transformers_oracle(*a, unit_offset), q, k, q_w, k_w, cos, sin)
    for name, a, b in zip(("q", "k", "dq", "dk", "dq_w", "dk_w"), ours, oracle):
        assert rel_err(a, b) <= 1e-6, name


@pytest.mark.parametrize("unit_offset,partial", ORACLE_CASES)
def test_reference_bf16_is_bit_exact_with_transformers(unit_offset, partial):
    """Same cast order as Qwen3Attention / Qwen3-Next (norm in fp32, cast, RoPE in bf16)."""
    cos, sin = transformers_cos_sin(2, 6, 32, partial, torch.bfloat16)
    q, k, q_w, k_w, _, _ = make_inputs(seq=6, head_dim=32, dtype=torch.bfloat16)
    ours = qk_norm_rope(q, k, q_w, k_w, cos, sin, EPS, unit_offset, cos.shape[-1], impl="torch")
    with torch.no_grad():
        oracle = transformers_oracle(q, k, q_w, k_w, cos, sin, unit_offset)
    for a, b in zip(ours, oracle):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b)


def test_auto_on_cpu_is_the_reference():
    args = make_inputs(rotary_dim=8)
    for a, b in zip(qk_norm_rope(*args, EPS, rotary_dim=8), qk_norm_rope_reference(*args, EPS)):
        assert torch.equal(a, b)


def test_bad_impl_raises():
    with pytest.raises(ValueError, match=r"auto.*torch.*triton.*model\.norm_rope_impl"):
        qk_norm_rope(*make_inputs(), EPS, impl="cuda")


def test_impls_registry():
    """The names a config may use; "auto" (runtime.plan) is triton on CUDA where triton is installed."""
    from runtime.choices import Needs, choose

    assert NORM_ROPE_IMPLS.names() == ["auto", "torch", "triton"]
    assert choose("model.norm_rope_impl", "auto", Needs("cpu"))[0] == "torch"
    assert choose("model.norm_rope_impl", "auto", Needs("cuda"))[0] == ("triton" if kernels.AVAILABLE else "torch")


@pytest.mark.parametrize("bad", ["rotary_dim", "cos_shape", "weight_shape", "k_head_dim"])
def test_bad_shapes_raise(bad):
    q, k, q_w, k_w, cos, sin = make_inputs()
    rotary_dim = None
    if bad == "rotary_dim":
        rotary_dim = 7
    elif bad == "cos_shape":
        cos = cos[..., :8]
    elif bad == "weight_shape":
        q_w = q_w[:8]
    else:
        k = k[..., :8]
    with pytest.raises(ValueError):
        qk_norm_rope(q, k, q_w, k_w, cos, sin, EPS, rotary_dim=rotary_dim, impl="torch")


# ----------------------------------------------------------------------------- triton (interpreter)

HAVE_TRITON = importlib.util.find_spec("triton") is not None

INTERPRETED_HERE = HAVE_TRITON and type(kernels._qk_norm_rope_fwd_kernel).__name__ == "InterpretedFunction"
interp = pytest.mark.skipif(not INTERPRETED_HERE, reason="kernels are not interpreted in this process "
                                                        "(test_interp_cases_in_subprocess runs them)")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED_HERE, reason="the interp cases run in this process")
def test_interp_cases_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
         "-k", "interp and not subprocess"],
        env=env, cwd=repo_root, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary, result.stdout[-2000:]


def assert_triton_matches_reference(inputs, unit_offset, rotary_dim, grad_transform=None,
                                    settings=DEFAULT_LAUNCH_SETTINGS):
    def run(impl):
        def fn(q, k, q_w, k_w, cos, sin):
            q_out, k_out = qk_norm_rope(q, k, q_w, k_w, cos, sin, EPS, unit_offset, rotary_dim, impl=impl,
                                        launch_settings=settings)
            # A [B, heads, S, D] view of the outputs with contiguous upstream grads hands the op strided
            # [B, S, heads, D] grads, as an attention backend working in that layout does.
            return (q_out, k_out) if grad_transform is None else (grad_transform(q_out), grad_transform(k_out))
        return forward_and_grads(fn, *inputs)

    for name, a, b in zip(("q", "k", "dq", "dk", "dq_w", "dk_w"), run("triton"), run("torch")):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


@interp
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, None), (128, None), (256, None), (128, 32), (256, 64)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_interp_triton_matches_reference(head_dim, rotary_dim, unit_offset):
    inputs = make_inputs(batch=2, seq=3, heads_q=3, heads_k=1, head_dim=head_dim, rotary_dim=rotary_dim)
    assert not inputs[0].is_contiguous() and not inputs[1].is_contiguous()
    assert_triton_matches_reference(inputs, unit_offset, rotary_dim)


@interp
def test_interp_broadcast_cos_contiguous_inputs_and_strided_grads():
    q, k, q_w, k_w, cos, sin = make_inputs(batch=3, seq=4, heads_q=2, heads_k=2, head_dim=16, cos_batch=1)
    inputs = (q.contiguous(), k.contiguous(), q_w, k_w, cos, sin)
    assert_triton_matches_reference(inputs, True, None,
                                    grad_transform=lambda x: x.transpose(1, 2))


@interp
def test_interp_many_tiles_per_backward_program():
    """With 4 backward programs as the target (4 "SMs" on the CPU, 1 per SM), the 38 q tiles and 10 k
    tiles of 32 rows go 12 per program: q programs loop with a ragged end, the k program runs past its
    rows. Exercises the dW partial loop and its masking."""
    inputs = make_inputs(batch=2, seq=150, heads_q=4, heads_k=1, head_dim=64, rotary_dim=32)
    assert_triton_matches_reference(inputs, False, 32, settings=LaunchSettings(bwd_programs_per_sm=1))


@interp
def test_interp_dw_sum_loops_over_many_partial_rows():
    """16 backward programs (4 per "SM") and a dW sum that takes 4 partial rows and 16 columns per load:
    the q sum loops with a ragged last block, the k sum starts mid-buffer, D spans 4 column programs."""
    inputs = make_inputs(batch=2, seq=40, heads_q=4, heads_k=2, head_dim=64)
    settings = LaunchSettings(bwd_programs_per_sm=4, dw_sum_block_p=4, dw_sum_block_d=16)
    assert_triton_matches_reference(inputs, True, None, settings=settings)


@interp
def test_interp_other_tile_settings_give_the_same_results():
    """Settings only tune: smaller tiles and fewer warps match the reference too."""
    inputs = make_inputs(batch=2, seq=7, heads_q=3, heads_k=1, head_dim=32, rotary_dim=16)
    settings = LaunchSettings(fwd_tile_elements=64, fwd_num_warps=2, bwd_tile_elements=128, bwd_num_warps=2)
    assert_triton_matches_reference(inputs, True, 16, settings=settings)


@interp
def test_interp_autograd_goes_through_the_op():
    """Eager calls and traced calls alike run the moert op (its autograd is registered on it)."""
    q, k, q_w, k_w, cos, sin = make_inputs(batch=2, seq=5, heads_q=3, heads_k=1, head_dim=32, rotary_dim=16)
    q_out, _ = qk_norm_rope(leaf(q), k, q_w, k_w, cos, sin, EPS, True, 16, impl="triton")
    name = type(q_out.grad_fn).__name__
    assert "moert" in name and "qk_norm_rope_fwd" in name, name


@interp
def test_interp_dispatch_mode_sees_the_op():
    """Under a TorchDispatchMode (what make_fx, export, fake tensors and SAC use) the call must be the
    moert op, not raw launches the mode cannot see."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, q_w, k_w, cos, sin = make_inputs(batch=1, seq=3, heads_q=2, heads_k=1, head_dim=16)
    with Record() as mode:
        out = qk_norm_rope(q, k, q_w, k_w, cos, sin, EPS, impl="triton")
    assert any("moert.qk_norm_rope_fwd" in op for op in mode.ops), mode.ops
    for a, b in zip(out, qk_norm_rope_reference(q, k, q_w, k_w, cos, sin, EPS)):
        assert rel_err(a, b) <= 1e-5


_FP64_EPS_COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attention.kernels import norm_rope as kernels

for backward in (True, False):
    for head_dim, rotary_dim in ((128, 128), (128, 32)):
        kernel = kernels._qk_norm_rope_bwd_kernel if backward else kernels._qk_norm_rope_fwd_kernel
        meta, _ = kernels._meta(head_dim, rotary_dim, True, backward, kernels.LaunchSettings())
        meta = {k: v for k, v in meta.items() if k != "num_warps"}
        signature = {name: "constexpr" if name in meta else "fp64" if name == "eps" else
                     ("*fp32" if name == "dw_ptr" else "*bf16") if name.endswith("_ptr") else "i32"
                     for name in kernel.arg_names}
        constexprs = {(kernel.arg_names.index(name),): value for name, value in meta.items()}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert "cvt.rn.f32.f64" in compiled.asm["ptx"]  # eps really arrived as a double
print("ok")
"""


# CI time: the compiling Python runs beside the in-process tests.
FP64_EPS_COMPILE = Ahead(lambda tmp: subprocess.run(
    [sys.executable, "-c", _FP64_EPS_COMPILE], env={**lane_environ(), "TRITON_INTERPRET": "0"},
    cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), capture_output=True,
    text=True, timeout=300, check=False))


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.ahead(FP64_EPS_COMPILE)
def test_kernels_compile_with_fp64_eps_for_sm90():
    """Inductor hands Python floats to user Triton kernels as fp64 scalars. The first GPU run failed
    there ("loop-carried variable dw1 ... re-assigned to fp64"): compile both kernels for sm_90 with eps
    typed fp64 (no GPU needed; skipped where this triton build has no CUDA backend or API)."""
    result = FP64_EPS_COMPILE.result()
    if result.returncode != 0 and ("CompilationError" not in result.stderr
                                   and "AssertionError" not in result.stderr):
        pytest.skip("cannot compile for sm_90 here: " + result.stderr.strip().splitlines()[-1][:200])
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


# ----------------------------------------------------------------------------- launch arguments


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_kernel_params_are_tensors_ints_floats_then_the_meta_constexprs():
    """_launch passes (*tensors, *ints, *floats) and then the constexprs in parameter order, taken from
    meta by name: every kernel's trailing params must be exactly its meta keys (less num_warps)."""
    cases = ((kernels._qk_norm_rope_fwd_kernel, 8, 14, False), (kernels._qk_norm_rope_bwd_kernel, 11, 21, True))
    for kernel, n_tensors, n_ints, backward in cases:
        meta, _ = kernels._meta(128, 64, True, backward, LaunchSettings())
        names = kernel.arg_names
        assert all(name.endswith("_ptr") for name in names[:n_tensors])
        assert not any(name.endswith("_ptr") for name in names[n_tensors:])
        assert names[n_tensors + n_ints] == "eps"
        assert names[n_tensors + n_ints + 1:] == [key for key in meta if key != "num_warps"]
    assert kernels._dw_sum_kernel.arg_names == ["partial_ptr", "dq_w_ptr", "dk_w_ptr", "n_q_progs", "n_progs",
                                                  "D", "BLOCK_P", "BLOCK_D"]


def test_launch_settings_round_trip_through_the_op_schema():
    settings = LaunchSettings(fwd_tile_elements=512, bwd_programs_per_sm=2, dw_sum_block_d=32)
    assert LaunchSettings(*settings.as_list()) == settings
