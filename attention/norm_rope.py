"""Fused per-head q/k RMSNorm + rotary embedding (Qwen3 / Qwen3.5 / Qwen3-Next attention).

Contract::

    qk_norm_rope(q_BSHD, k_BSKD, q_weight_D, k_weight_D, cos_BSR, sin_BSR, eps,
                 unit_offset=False, rotary_dim=None, impl="auto") -> (q_out_BSHD, k_out_BSKD)

B batch, S sequence, H query heads, K key/value heads, D head_dim, R rotary_dim (<= D, even).
q/k may be non-contiguous views (e.g. slices of a fused qkv projection); the last dim must be dense.
cos/sin are what transformers' rotary embedding returns: cat(freqs, freqs) layout, rotate-half
convention, shape [B, S, R] (a batch dim of 1 broadcasts).

Per (token, head) row: RMSNorm over D in fp32, x * rsqrt(mean(x^2) + eps) * w, or * (1 + w) when
`unit_offset` (Qwen3.5 / Qwen3-Next), then RoPE on the first R dims; dims R..D pass through.

impl: "torch" is the plain-torch reference and reproduces transformers' numerics step by step
(Qwen3RMSNorm casts the normalized row to the input dtype before the weight multiply, Qwen3NextRMSNorm
multiplies by (1 + w) in fp32 and casts after; RoPE then runs in the input dtype).
"triton" is the fused kernel (forward and backward are `torch.library.triton_op`s, so torch.compile
traces them without a graph break); it keeps the whole row in fp32 and rounds once at the store.
"auto" picks triton for CUDA tensors and the reference otherwise.
The kernels have no dot products (elementwise math and row sums in fp32), so fp32 inputs are computed in
IEEE fp32 whatever torch's TF32 setting; nothing there to switch.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    from gpu import launch as gpu_launch
    from gpu.launch import cdiv
except ImportError:  # the reference stays usable where triton is missing (e.g. macOS, CPU-only wheels)
    triton = None

IMPLS = ("auto", "triton", "torch")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, unit_offset: bool = False,
                 rotary_dim: int | None = None, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize each q/k head over D and rotate its first `rotary_dim` dims; see the module docstring."""
    if impl not in IMPLS:
        raise ValueError(f"qk_norm_rope: impl must be one of {IMPLS}, got {impl!r}")
    if torch.compiler.is_compiling():  # shapes may be symbolic (unhashable): check them uncached
        _check_inputs(q, k, q_weight, k_weight, cos, sin, rotary_dim)
    else:
        _check_inputs_cached(q.shape, k.shape, q_weight.shape, k_weight.shape, cos.shape, sin.shape,
                             q.dtype, k.dtype, rotary_dim)
    if impl == "torch" or (impl == "auto" and not q.is_cuda):
        return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps, unit_offset)
    return _qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps, unit_offset)


def _check_inputs(q, k, q_weight, k_weight, cos, sin, rotary_dim: int | None) -> None:
    """Validate shapes once, up front. After this, cos.shape[-1] is the rotary dim both impls use."""
    _check_shapes(q.shape, k.shape, q_weight.shape, k_weight.shape, cos.shape, sin.shape, q.dtype, k.dtype,
                  rotary_dim)


def _check_shapes(q_shape, k_shape, q_weight_shape, k_weight_shape, cos_shape, sin_shape, q_dtype, k_dtype,
                  rotary_dim: int | None) -> None:
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(f"q and k must be [B, S, heads, D]; got {tuple(q_shape)} and {tuple(k_shape)}")
    head_dim = q_shape[-1]
    if q_shape[:2] != k_shape[:2] or k_shape[-1] != head_dim:
        raise ValueError(f"q {tuple(q_shape)} and k {tuple(k_shape)} disagree on B, S or D")
    if q_dtype != k_dtype:
        raise ValueError(f"q and k dtypes differ: {q_dtype} vs {k_dtype}")
    if q_weight_shape != (head_dim,) or k_weight_shape != (head_dim,):
        raise ValueError(f"weights must be [{head_dim}]; got {tuple(q_weight_shape)}, {tuple(k_weight_shape)}")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}]; got {rotary_dim}")
    for name, shape in (("cos", cos_shape), ("sin", sin_shape)):
        if len(shape) != 3 or shape[-1] != rotary_dim or shape[1] != q_shape[1] or shape[0] not in (1, q_shape[0]):
            raise ValueError(f"{name} must be [B or 1, S, rotary_dim={rotary_dim}]; got {tuple(shape)}")


# Eager calls check each distinct set of shapes once (a success is cached; a failure raises every time).
_check_inputs_cached = functools.lru_cache(maxsize=256)(_check_shapes)


# ----------------------------------------------------------------------------- torch reference


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim with transformers' cast order (see the module docstring)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def rope_reference(x_BSHD: torch.Tensor, cos_BSR: torch.Tensor, sin_BSR: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R dims of each head; the remaining dims pass through."""
    rotary_dim = cos_BSR.shape[-1]
    cos_BS1R = cos_BSR.unsqueeze(2).to(x_BSHD.dtype)
    sin_BS1R = sin_BSR.unsqueeze(2).to(x_BSHD.dtype)
    x_rot, x_pass = x_BSHD[..., :rotary_dim], x_BSHD[..., rotary_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos_BS1R + rotated * sin_BS1R, x_pass), dim=-1)


def qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps: float,
                           unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch qk_norm_rope (differentiable by autograd); the rotary dim is cos.shape[-1]."""
    q_out = rope_reference(rms_norm_reference(q, q_weight, eps, unit_offset), cos, sin)
    k_out = rope_reference(rms_norm_reference(k, k_weight, eps, unit_offset), cos, sin)
    return q_out, k_out


# ----------------------------------------------------------------------------- triton kernels
#
# Rows are the flattened (b, s, h) triples of q (then of k); a program handles tiles of BLOCK_R rows.
# Each row is loaded as three pieces so rotate-half needs no gather: x1 = x[:R/2], x2 = x[R/2:R] and
# the pass-through tail x[R:] (compiled out when R == D). q and k share one launch: programs below
# the q count work on q, the rest on k. Outputs and input grads are written contiguous.
#
# Host path. The ops are `triton_op`s so that torch.compile / export / fake tensors see them as ops
# (no graph break; Inductor inlines the kernels). In plain eager mode (no compile, no dispatch mode,
# no functorch transform, plain CUDA tensors) the same launch code runs under a small
# autograd.Function instead: the custom-op dispatch path (Python autograd kernel, redispatch,
# aliasing checks) costs more host time than the kernels take at short lengths. Both paths launch the
# same kernels with the same arguments; EAGER_AUTOGRAD_FUNCTION = False forces the op path.
#
# Per backward call: one main kernel (input grads + one fp32 dW partial row per program, no atomics)
# and one tiny kernel that sums the partial rows in a fixed order and writes dW in the weight dtype.
# Every accumulation is fp32 whatever dtype a scalar argument arrives in (Inductor passes Python
# floats as fp64 to user kernels): eps is cast once at kernel entry and the accumulators' updates are
# cast explicitly, so the loop-carried types never change.

EAGER_AUTOGRAD_FUNCTION = True

# (elements per tile, num_warps) per pass; see _launch_config. One fixed config, no autotune: the
# interpreter cannot autotune, and the backward's partial-sum buffer depends on the grid.
# benchmarks/bench_norm_rope.py --sweep replaces these (then calls _meta_cached.cache_clear()).
# Measured on one H200 (bf16, Qwen3-14B heads, 4k and 16k tokens; bench_norm_rope.py --sweep): the forward
# is within 3% across 1K..4K elements and 4..8 warps (1024/4 best); the backward is best at ~16 warps
# per SM: 2048/4 with 4 programs per SM (one wave at 128 registers) ties 4096/8 with 2 per SM and
# keeps fewer registers for head_dim 256.
FWD_CONFIG = (1024, 4)
BWD_CONFIG = (2048, 4)
# Backward grid: about this many programs per SM, each looping over an equal share of the row tiles
# (q and k programs alike, so none runs long). Fewer programs = fewer dW partial rows to sum.
BWD_PROGRAMS_PER_SM = 4
# dW partial-row reduction: rows x columns per load of the summing kernel.
DW_SUM_BLOCK_P, DW_SUM_BLOCK_D = 256, 16


def _qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps, unit_offset):
    if triton is None:
        raise RuntimeError("qk_norm_rope(impl='triton') needs the triton package")
    eps, unit_offset = float(eps), bool(unit_offset)
    if EAGER_AUTOGRAD_FUNCTION and _plain_eager(q, k, q_weight, k_weight, cos, sin):
        return _QkNormRopeEager.apply(q, k, q_weight, k_weight, cos, sin, eps, unit_offset)
    return torch.ops.moert.qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, eps, unit_offset)


try:
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode as _in_dispatch_mode
except ImportError:  # older torch: be conservative, always take the op path
    def _in_dispatch_mode(include_infra_modes: bool = True) -> bool:
        return True

# nn.Parameter adds no __torch_function__ / __torch_dispatch__ behaviour: weights that are Parameters
# (the usual case in a model) take the fast path too. Other subclasses (DTensor, ...) take the op path.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain_eager(*tensors: torch.Tensor) -> bool:
    """True when nothing traces or transforms this call: plain (non-meta) tensors, eager autograd."""
    if torch.compiler.is_compiling() or _in_dispatch_mode() or torch._C._are_functorch_transforms_active():
        return False
    return all(type(t) in _PLAIN_TENSOR_TYPES and not t.is_meta for t in tensors)


def _launch_config(padded_row: int, backward: bool) -> tuple[int, int]:
    """(rows per tile, num_warps) for rows of `padded_row` elements as the kernel holds them."""
    elements, num_warps = BWD_CONFIG if backward else FWD_CONFIG
    rows = max(1, elements // padded_row)
    return 1 << (rows.bit_length() - 1), num_warps


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few programs is plenty
    return torch.cuda.get_device_properties(device).multi_processor_count


def _is_interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------- launching


def _launch(kernel, grid: tuple[int, int, int], tensors: tuple, ints: tuple, floats: tuple, meta: dict,
            wrap: bool) -> None:
    """kernel[grid](*tensors, *ints, *floats, **meta): through wrap_triton on the op path (what tracing
    needs), else by gpu.launch's cheap eager route. Interpreted kernels (CPU tests) are never
    wrapped: nothing traces them there, and not every torch release's wrap_triton accepts them."""
    args = (*tensors, *ints, *floats)
    if wrap and not _is_interpreted(kernel):
        wrap_triton(kernel)[grid](*args, **meta)
    else:
        gpu_launch.launch(kernel, grid, args, meta)


# ----------------------------------------------------------------------------- host side of the ops


def _rope_table(cos_BSR: torch.Tensor, sin_BSR: torch.Tensor, batch: int):
    """(cos, sin, batch stride, seq stride) with a dense last dim and one stride pair for both; a batch
    dim of 1 gets batch stride 0 (no copy, no expand)."""
    if cos_BSR.shape[0] != sin_BSR.shape[0]:
        cos_BSR, sin_BSR = cos_BSR.expand(batch, -1, -1).contiguous(), sin_BSR.expand(batch, -1, -1).contiguous()
    stride = cos_BSR.stride()
    if stride != sin_BSR.stride() or stride[-1] != 1:
        cos_BSR, sin_BSR = cos_BSR.contiguous(), sin_BSR.contiguous()
        stride = cos_BSR.stride()
    return cos_BSR, sin_BSR, (0 if cos_BSR.shape[0] == 1 else stride[0]), stride[1]


def _dense_last_dim(x: torch.Tensor) -> torch.Tensor:
    """The kernels address rows by (b, s, h) strides but assume unit stride inside a row."""
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.lru_cache
def _meta_cached(head_dim: int, rotary_dim: int, unit_offset: bool, backward: bool) -> tuple[dict, int]:
    half, tail = rotary_dim // 2, head_dim - rotary_dim
    block_half = triton.next_power_of_2(half)
    block_tail = triton.next_power_of_2(max(tail, 1))
    block_r, num_warps = _launch_config(2 * block_half + (block_tail if tail else 0), backward)
    meta = {"D": head_dim, "HALF": half, "TAIL": tail, "BLOCK_R": block_r, "BLOCK_HALF": block_half,
            "BLOCK_TAIL": block_tail, "UNIT_OFFSET": unit_offset, "num_warps": num_warps}
    return meta, block_r


def _meta(head_dim, rotary_dim, unit_offset: bool, backward: bool) -> tuple[dict, int]:
    """Compile-time kernel arguments and BLOCK_R; int() pins symbolic sizes (tracing with dynamic shapes).
    Cached: call _meta_cached.cache_clear() after changing the configs above."""
    return _meta_cached(int(head_dim), int(rotary_dim), bool(unit_offset), backward)


def _prepare(q, k, q_weight, k_weight, cos, sin):
    """The tensors as the kernels take them (dense last dim, one rope stride pair) and the rope strides.
    No copy unless an input needs one."""
    q, k = _dense_last_dim(q), _dense_last_dim(k)
    q_weight, k_weight = _dense_last_dim(q_weight), _dense_last_dim(k_weight)
    cos, sin, stride_cb, stride_cs = _rope_table(cos, sin, q.shape[0])
    return (q, k, q_weight, k_weight, cos, sin), (stride_cb, stride_cs)


def _fwd_launch(q, k, q_weight, k_weight, cos, sin, eps: float, unit_offset: bool, wrap: bool):
    """Allocates the outputs and launches the forward kernel; shared by the op and the eager path."""
    tensors, rope_strides = _prepare(q, k, q_weight, k_weight, cos, sin)
    return _fwd_launch_prepared(*tensors, rope_strides, eps, unit_offset, wrap)


def _fwd_launch_prepared(q, k, q_weight, k_weight, cos, sin, rope_strides, eps: float, unit_offset: bool,
                         wrap: bool):
    batch, seq, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    q_out = q.new_empty(q.shape)
    k_out = k.new_empty(k.shape)
    meta, block_r = _meta(head_dim, cos.shape[-1], unit_offset, backward=False)
    n_q_rows, n_k_rows = batch * seq * heads_q, batch * seq * heads_k
    n_q_tiles = cdiv(n_q_rows, block_r)
    n_tiles = n_q_tiles + cdiv(n_k_rows, block_r)
    if n_tiles > 0:
        q_strides, k_strides = q.stride(), k.stride()
        _launch(_qk_norm_rope_fwd_kernel, (n_tiles, 1, 1),
                (q, k, q_out, k_out, q_weight, k_weight, cos, sin),
                (n_q_rows, n_k_rows, n_q_tiles, seq, heads_q, heads_k,
                 q_strides[0], q_strides[1], q_strides[2], k_strides[0], k_strides[1], k_strides[2], *rope_strides),
                (eps,), meta, wrap)
    return q_out, k_out


def _bwd_grid(n_q_rows, n_k_rows, block_r: int, device: torch.device):
    """(tiles per program, q programs, k programs): every program gets the same number of tiles."""
    n_q_tiles, n_k_tiles = cdiv(n_q_rows, block_r), cdiv(n_k_rows, block_r)
    tiles_per_prog = max(1, cdiv(n_q_tiles + n_k_tiles, BWD_PROGRAMS_PER_SM * _num_sms(device)))
    return tiles_per_prog, cdiv(n_q_tiles, tiles_per_prog), cdiv(n_k_tiles, tiles_per_prog)


def _bwd_launch(q, k, q_weight, k_weight, cos, sin, grad_q_out, grad_k_out, eps: float, unit_offset: bool,
                wrap: bool):
    """Allocates the grads and launches the backward kernel and the dW sum; shared by both paths."""
    tensors, rope_strides = _prepare(q, k, q_weight, k_weight, cos, sin)
    return _bwd_launch_prepared(*tensors, rope_strides, grad_q_out, grad_k_out, eps, unit_offset, wrap)


def _bwd_launch_prepared(q, k, q_weight, k_weight, cos, sin, rope_strides, grad_q_out, grad_k_out, eps: float,
                         unit_offset: bool, wrap: bool):
    grad_q_out, grad_k_out = _dense_last_dim(grad_q_out), _dense_last_dim(grad_k_out)
    batch, seq, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    device = q.device
    meta, block_r = _meta(head_dim, cos.shape[-1], unit_offset, backward=True)
    n_q_rows, n_k_rows = batch * seq * heads_q, batch * seq * heads_k
    tiles_per_prog, n_q_progs, n_k_progs = _bwd_grid(n_q_rows, n_k_rows, block_r, device)
    n_progs = n_q_progs + n_k_progs
    # The main kernel goes first; the dW outputs are allocated while it runs.
    grad_q = q.new_empty(q.shape)
    grad_k = k.new_empty(k.shape)
    dw_partial = torch.empty((n_progs, head_dim), dtype=torch.float32, device=device)
    if n_progs > 0:
        q_strides, k_strides = q.stride(), k.stride()
        gq_strides, gk_strides = grad_q_out.stride(), grad_k_out.stride()
        _launch(_qk_norm_rope_bwd_kernel, (n_progs, 1, 1),
                (q, k, grad_q_out, grad_k_out, grad_q, grad_k, q_weight, k_weight, cos, sin, dw_partial),
                (n_q_rows, n_k_rows, n_q_progs, tiles_per_prog, seq, heads_q, heads_k,
                 q_strides[0], q_strides[1], q_strides[2], k_strides[0], k_strides[1], k_strides[2],
                 gq_strides[0], gq_strides[1], gq_strides[2], gk_strides[0], gk_strides[1], gk_strides[2],
                 *rope_strides),
                (eps,), meta, wrap)
    grad_q_weight = q_weight.new_empty(q_weight.shape)
    grad_k_weight = k_weight.new_empty(k_weight.shape)
    head_dim = int(head_dim)
    _launch(_dw_sum_kernel, (2, cdiv(head_dim, DW_SUM_BLOCK_D), 1),
            (dw_partial, grad_q_weight, grad_k_weight), (n_q_progs, n_progs), (),
            {"D": head_dim, "BLOCK_P": DW_SUM_BLOCK_P, "BLOCK_D": DW_SUM_BLOCK_D, "num_warps": 4}, wrap)
    return grad_q, grad_k, grad_q_weight, grad_k_weight


if triton is not None:

    @triton.jit
    def _row_coords(rows, S, H):
        """(b, s, h) of each flattened row, in int64 so that b * stride cannot overflow."""
        tok = rows // H
        return (tok // S).to(tl.int64), (tok % S).to(tl.int64), (rows % H).to(tl.int64)

    @triton.jit
    def _load_weight(w_ptr, cols, mask, UNIT_OFFSET: tl.constexpr):
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            w += 1.0
        return w

    @triton.jit
    def _fwd_tile(x_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr, tile, n_rows, S, H,
                  stride_b, stride_s, stride_h, stride_cb, stride_cs, eps,
                  D: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        b, s, h = _row_coords(rows, S, H)
        x_row = (b * stride_b + s * stride_s + h * stride_h)[:, None]
        c_row = (b * stride_cb + s * stride_cs)[:, None]
        out_row = (rows.to(tl.int64) * D)[:, None]
        cols = tl.arange(0, BLOCK_HALF)
        col_ok = cols < HALF
        mask = row_ok[:, None] & col_ok[None, :]

        x1 = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if TAIL > 0:
            tcols = 2 * HALF + tl.arange(0, BLOCK_TAIL)
            tmask = row_ok[:, None] & (tcols < D)[None, :]
            xt = tl.load(x_ptr + x_row + tcols, mask=tmask, other=0.0).to(tl.float32)
            sum_sq += tl.sum(xt * xt, axis=1)
        rstd = tl.rsqrt(sum_sq / D + eps).to(tl.float32)[:, None]

        y1 = x1 * rstd * _load_weight(w_ptr, cols, col_ok, UNIT_OFFSET)[None, :]
        y2 = x2 * rstd * _load_weight(w_ptr + HALF, cols, col_ok, UNIT_OFFSET)[None, :]
        cos1 = tl.load(cos_ptr + c_row + cols, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + c_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + c_row + cols, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + c_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + out_row + cols, (y1 * cos1 - y2 * sin1).to(out_ty), mask=mask)
        tl.store(out_ptr + out_row + HALF + cols, (y2 * cos2 + y1 * sin2).to(out_ty), mask=mask)
        if TAIL > 0:
            yt = xt * rstd * _load_weight(w_ptr, tcols, tcols < D, UNIT_OFFSET)[None, :]
            tl.store(out_ptr + out_row + tcols, yt.to(out_ty), mask=tmask)

    @triton.jit
    def _qk_norm_rope_fwd_kernel(
            q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
            n_q_rows, n_k_rows, n_q_tiles, S, HQ, HK,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_cb, stride_cs, eps,
            D: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        eps = tl.full([], eps, tl.float32)  # Inductor passes Python floats as fp64 scalars
        tile = tl.program_id(0)
        if tile < n_q_tiles:
            _fwd_tile(q_ptr, q_out_ptr, q_w_ptr, cos_ptr, sin_ptr, tile, n_q_rows, S, HQ,
                      stride_qb, stride_qs, stride_qh, stride_cb, stride_cs, eps,
                      D, HALF, TAIL, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, UNIT_OFFSET)
        else:
            _fwd_tile(k_ptr, k_out_ptr, k_w_ptr, cos_ptr, sin_ptr, tile - n_q_tiles, n_k_rows, S, HK,
                      stride_kb, stride_ks, stride_kh, stride_cb, stride_cs, eps,
                      D, HALF, TAIL, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, UNIT_OFFSET)

    @triton.jit
    def _bwd_rows(x_ptr, g_ptr, dx_ptr, w_ptr, cos_ptr, sin_ptr, dw_ptr, prog, tiles_per_prog, n_rows, S, H,
                  stride_b, stride_s, stride_h, stride_gb, stride_gs, stride_gh, stride_cb, stride_cs, eps,
                  D: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        """Input grads for `tiles_per_prog` consecutive tiles; this program's dW partial row goes to dw_ptr[:D]."""
        cols = tl.arange(0, BLOCK_HALF)
        col_ok = cols < HALF
        tcols = 2 * HALF + tl.arange(0, BLOCK_TAIL)
        w1 = _load_weight(w_ptr, cols, col_ok, UNIT_OFFSET)[None, :]
        w2 = _load_weight(w_ptr + HALF, cols, col_ok, UNIT_OFFSET)[None, :]
        wt = _load_weight(w_ptr, tcols, tcols < D, UNIT_OFFSET)[None, :]
        # dW accumulates per (row slot, col) and is reduced over rows once at the end: a row reduction
        # per tile would cross warps (shared memory + barrier) in every iteration.
        dw1 = tl.zeros([BLOCK_R, BLOCK_HALF], dtype=tl.float32)
        dw2 = tl.zeros([BLOCK_R, BLOCK_HALF], dtype=tl.float32)
        dwt = tl.zeros([BLOCK_R, BLOCK_TAIL], dtype=tl.float32)
        first_row = prog * tiles_per_prog * BLOCK_R
        for i in range(tiles_per_prog):
            rows = first_row + i * BLOCK_R + tl.arange(0, BLOCK_R)
            row_ok = rows < n_rows
            b, s, h = _row_coords(rows, S, H)
            x_row = (b * stride_b + s * stride_s + h * stride_h)[:, None]
            g_row = (b * stride_gb + s * stride_gs + h * stride_gh)[:, None]
            c_row = (b * stride_cb + s * stride_cs)[:, None]
            dx_row = (rows.to(tl.int64) * D)[:, None]
            mask = row_ok[:, None] & col_ok[None, :]

            x1 = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + x_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
            g1 = tl.load(g_ptr + g_row + cols, mask=mask, other=0.0).to(tl.float32)
            g2 = tl.load(g_ptr + g_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
            cos1 = tl.load(cos_ptr + c_row + cols, mask=mask, other=0.0).to(tl.float32)
            cos2 = tl.load(cos_ptr + c_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
            sin1 = tl.load(sin_ptr + c_row + cols, mask=mask, other=0.0).to(tl.float32)
            sin2 = tl.load(sin_ptr + c_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
            sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if TAIL > 0:
                tmask = row_ok[:, None] & (tcols < D)[None, :]
                xt = tl.load(x_ptr + x_row + tcols, mask=tmask, other=0.0).to(tl.float32)
                gt = tl.load(g_ptr + g_row + tcols, mask=tmask, other=0.0).to(tl.float32)
                sum_sq += tl.sum(xt * xt, axis=1)
            rstd = tl.rsqrt(sum_sq / D + eps).to(tl.float32)[:, None]
            n1 = x1 * rstd
            n2 = x2 * rstd

            # RoPE is a rotation per frequency pair; its backward applies the transposed rotation.
            dy1 = g1 * cos1 + g2 * sin2
            dy2 = g2 * cos2 - g1 * sin1
            dw1 += (dy1 * n1).to(tl.float32)
            dw2 += (dy2 * n2).to(tl.float32)
            dn1 = dy1 * w1
            dn2 = dy2 * w2
            dot = tl.sum(dn1 * n1, axis=1) + tl.sum(dn2 * n2, axis=1)
            if TAIL > 0:
                nt = xt * rstd
                dwt += (gt * nt).to(tl.float32)
                dnt = gt * wt
                dot += tl.sum(dnt * nt, axis=1)
            # d/dx of x * rstd(x): rstd * (dn - n * mean(dn * n))
            mean_dot = (dot / D).to(tl.float32)[:, None]
            dx_ty = dx_ptr.dtype.element_ty
            tl.store(dx_ptr + dx_row + cols, (rstd * (dn1 - n1 * mean_dot)).to(dx_ty), mask=mask)
            tl.store(dx_ptr + dx_row + HALF + cols, (rstd * (dn2 - n2 * mean_dot)).to(dx_ty), mask=mask)
            if TAIL > 0:
                tl.store(dx_ptr + dx_row + tcols, (rstd * (dnt - nt * mean_dot)).to(dx_ty), mask=tmask)
        tl.store(dw_ptr + cols, tl.sum(dw1, axis=0), mask=col_ok)
        tl.store(dw_ptr + HALF + cols, tl.sum(dw2, axis=0), mask=col_ok)
        if TAIL > 0:
            tl.store(dw_ptr + tcols, tl.sum(dwt, axis=0), mask=tcols < D)

    @triton.jit
    def _qk_norm_rope_bwd_kernel(
            q_ptr, k_ptr, gq_ptr, gk_ptr, dq_ptr, dk_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, dw_ptr,
            n_q_rows, n_k_rows, n_q_progs, tiles_per_prog, S, HQ, HK,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
            stride_gqb, stride_gqs, stride_gqh, stride_gkb, stride_gks, stride_gkh, stride_cb, stride_cs, eps,
            D: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        """Programs below n_q_progs do q, the rest k; program p writes row p of the [programs, D] fp32
        dW partial buffer (no atomics: _dw_sum_kernel sums the q rows and the k rows)."""
        eps = tl.full([], eps, tl.float32)  # Inductor passes Python floats as fp64 scalars
        pid = tl.program_id(0)
        dw_row_ptr = dw_ptr + pid.to(tl.int64) * D
        if pid < n_q_progs:
            _bwd_rows(q_ptr, gq_ptr, dq_ptr, q_w_ptr, cos_ptr, sin_ptr, dw_row_ptr, pid, tiles_per_prog,
                      n_q_rows, S, HQ, stride_qb, stride_qs, stride_qh, stride_gqb, stride_gqs, stride_gqh,
                      stride_cb, stride_cs, eps, D, HALF, TAIL, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, UNIT_OFFSET)
        else:
            _bwd_rows(k_ptr, gk_ptr, dk_ptr, k_w_ptr, cos_ptr, sin_ptr, dw_row_ptr, pid - n_q_progs,
                      tiles_per_prog, n_k_rows, S, HK, stride_kb, stride_ks, stride_kh,
                      stride_gkb, stride_gks, stride_gkh, stride_cb, stride_cs, eps,
                      D, HALF, TAIL, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, UNIT_OFFSET)

    @triton.jit
    def _dw_sum_kernel(partial_ptr, dq_w_ptr, dk_w_ptr, n_q_progs, n_progs,
                       D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
        """dW = sum of the fp32 partial rows in a fixed order (deterministic), stored in the weight dtype:
        program (0, j) sums rows [0, n_q_progs) into dq_w, program (1, j) rows [n_q_progs, n_progs)."""
        which = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        start = which * n_q_progs
        stop = n_q_progs + which * (n_progs - n_q_progs)
        acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
        for p0 in range(start, stop, BLOCK_P):
            prows = p0 + tl.arange(0, BLOCK_P)
            pmask = (prows < stop)[:, None] & col_ok[None, :]
            acc += tl.load(partial_ptr + prows.to(tl.int64)[:, None] * D + cols[None, :],
                           mask=pmask, other=0.0).to(tl.float32)
        dw = tl.sum(acc, axis=0)
        if which == 0:
            tl.store(dq_w_ptr + cols, dw.to(dq_w_ptr.dtype.element_ty), mask=col_ok)
        else:
            tl.store(dk_w_ptr + cols, dw.to(dk_w_ptr.dtype.element_ty), mask=col_ok)

    @triton_op("moert::qk_norm_rope_fwd", mutates_args={})
    def _qk_norm_rope_fwd(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, eps: float,
                          unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return _fwd_launch(q, k, q_weight, k_weight, cos, sin, eps, unit_offset, wrap=True)

    @triton_op("moert::qk_norm_rope_bwd", mutates_args={})
    def _qk_norm_rope_bwd(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, grad_q_out: torch.Tensor,
                          grad_k_out: torch.Tensor, eps: float,
                          unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _bwd_launch(q, k, q_weight, k_weight, cos, sin, grad_q_out, grad_k_out, eps, unit_offset,
                           wrap=True)

    def _setup_context(ctx, inputs, output):
        q, k, q_weight, k_weight, cos, sin, eps, unit_offset = inputs
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps, ctx.unit_offset = eps, unit_offset

    def _backward(ctx, grad_q_out, grad_k_out):
        grads = torch.ops.moert.qk_norm_rope_bwd(*ctx.saved_tensors, grad_q_out, grad_k_out,
                                                 ctx.eps, ctx.unit_offset)
        return (*grads, None, None, None, None)

    _qk_norm_rope_fwd.register_autograd(_backward, setup_context=_setup_context)

    class _QkNormRopeEager(torch.autograd.Function):
        """The eager fast path: the same kernels and arguments as the ops, without the custom-op dispatch.
        The forward prepares the inputs once (dense last dim, rope strides) and saves the prepared
        tensors, so the backward goes straight to its launches."""

        @staticmethod
        def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps, unit_offset):
            tensors, rope_strides = _prepare(q, k, q_weight, k_weight, cos, sin)
            outputs = _fwd_launch_prepared(*tensors, rope_strides, eps, unit_offset, wrap=False)
            ctx.save_for_backward(*tensors)
            ctx.rope_strides, ctx.eps, ctx.unit_offset = rope_strides, eps, unit_offset
            return outputs

        @staticmethod
        def backward(ctx, grad_q_out, grad_k_out):
            saved = ctx.saved_tensors
            if _plain_eager(grad_q_out, grad_k_out):
                grads = _bwd_launch_prepared(*saved, ctx.rope_strides, grad_q_out, grad_k_out, ctx.eps,
                                             ctx.unit_offset, wrap=False)
            else:  # e.g. compiled autograd tracing this backward
                grads = torch.ops.moert.qk_norm_rope_bwd(*saved, grad_q_out, grad_k_out, ctx.eps, ctx.unit_offset)
            return (*grads, None, None, None, None)
