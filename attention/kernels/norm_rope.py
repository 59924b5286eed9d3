"""Triton kernels of the fused q/k RMSNorm + RoPE (API and torch reference: attention/norm_rope.py).

    qk_norm_rope_triton(q_BSHD, k_BSKD, q_weight_D, k_weight_D, cos_BSR, sin_BSR, eps, unit_offset,
                        settings=DEFAULT_LAUNCH_SETTINGS) -> (q_out_BSHD, k_out_BSKD)

B batch, S sequence, H query heads, K key/value heads, D head_dim, R rotary_dim (<= D, even); inputs
checked by the caller. Forward and backward are `torch.library.triton_op`s (moert::qk_norm_rope_fwd /
_bwd) with autograd, so torch.compile traces them without a graph break and Inductor inlines the
kernels. `LaunchSettings` is tuning only: any settings give the same results up to the order of the
fp32 dW sums.

Kernels. Rows are the flattened (b, s, h) triples of q (then of k); a program handles tiles of BLOCK_R
rows. Each row is loaded as three pieces so rotate-half needs no gather: x1 = x[:R/2], x2 = x[R/2:R] and
the pass-through tail x[R:] (compiled out when R == D). q and k share one launch: programs below the q
count work on q, the rest on k. Outputs and input grads are written contiguous.

Per backward call: one main kernel (input grads + one fp32 dW partial row per program, no atomics) and
one tiny kernel that sums the partial rows in a fixed order and writes dW in the weight dtype. Every
accumulation is fp32 whatever dtype a scalar argument arrives in (Inductor passes Python floats as fp64
to user kernels): eps is cast once at kernel entry and the accumulators' updates are cast explicitly, so
the loop-carried types never change. The kernels have no dot products, so fp32 inputs are computed in
IEEE fp32 whatever torch's TF32 setting.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from gpu.device import num_sms

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    from gpu.launch import cdiv, next_power_of_2
except ImportError:  # the reference stays usable where triton is missing (e.g. macOS, CPU-only wheels)
    triton = None

AVAILABLE = triton is not None


@dataclass(frozen=True)
class LaunchSettings:
    """How the kernels are launched. One fixed config, no autotune: the interpreter cannot autotune, and
    the backward's partial-sum buffer depends on the grid. The defaults are the best measured (see
    docs/benchmarks.md#norm-and-rope; `python -m benchmarks.bench_norm_rope --sweep` times others)."""
    fwd_tile_elements: int = 1024  # elements per forward tile (rows per tile = this / padded row)
    fwd_num_warps: int = 4
    bwd_tile_elements: int = 2048
    bwd_num_warps: int = 4
    # Backward grid: about this many programs per SM, each looping over an equal share of the row tiles
    # (q and k programs alike, so none runs long). Fewer programs = fewer dW partial rows to sum.
    bwd_programs_per_sm: int = 4
    dw_sum_block_p: int = 256  # dW partial-row sum: rows x columns per load
    dw_sum_block_d: int = 16

    def as_list(self) -> list[int]:
        """The settings as the ops take them (a custom op's schema has no dataclasses); field order.
        Spelled out rather than dataclasses.astuple, which deep-copies and is no friend of tracing."""
        return [self.fwd_tile_elements, self.fwd_num_warps, self.bwd_tile_elements, self.bwd_num_warps,
                self.bwd_programs_per_sm, self.dw_sum_block_p, self.dw_sum_block_d]


DEFAULT_LAUNCH_SETTINGS = LaunchSettings()


def qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps: float, unit_offset: bool,
                        settings: LaunchSettings = DEFAULT_LAUNCH_SETTINGS) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused forward op (its backward registered as autograd); shapes checked by the caller."""
    if triton is None:
        raise RuntimeError("qk_norm_rope(impl='triton') needs the triton package")
    return torch.ops.moert.qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, float(eps), bool(unit_offset),
                                            settings.as_list())


def _sms(device: torch.device) -> int:
    return num_sms(device) if device.type == "cuda" else 4  # interpreter: a few programs is plenty


def _launch(kernel, grid: tuple[int, int, int], tensors: tuple, ints: tuple, floats: tuple, meta: dict) -> None:
    """kernel[grid](*tensors, *ints, *floats, **meta) through wrap_triton, which tracing needs. Interpreted
    kernels (CPU tests) are launched plainly: nothing traces them there, and not every torch release's
    wrap_triton accepts them."""
    args = (*tensors, *ints, *floats)
    if type(kernel).__name__ == "InterpretedFunction":
        kernel[grid](*args, **meta)
    else:
        wrap_triton(kernel)[grid](*args, **meta)


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
def _meta_cached(head_dim: int, rotary_dim: int, unit_offset: bool, tile_elements: int,
                 num_warps: int) -> tuple[dict, int]:
    half, tail = rotary_dim // 2, head_dim - rotary_dim
    block_half = next_power_of_2(half)
    block_tail = next_power_of_2(max(tail, 1))
    padded_row = 2 * block_half + (block_tail if tail else 0)  # the row as the kernel holds it
    rows = max(1, tile_elements // padded_row)
    block_r = 1 << (rows.bit_length() - 1)
    meta = {"D": head_dim, "HALF": half, "TAIL": tail, "BLOCK_R": block_r, "BLOCK_HALF": block_half,
            "BLOCK_TAIL": block_tail, "UNIT_OFFSET": unit_offset, "num_warps": num_warps}
    return meta, block_r


def _meta(head_dim, rotary_dim, unit_offset: bool, backward: bool, settings: LaunchSettings) -> tuple[dict, int]:
    """Compile-time kernel arguments and BLOCK_R (rows per tile); int() pins symbolic sizes (tracing with
    dynamic shapes)."""
    if backward:
        tile = settings.bwd_tile_elements, settings.bwd_num_warps
    else:
        tile = settings.fwd_tile_elements, settings.fwd_num_warps
    return _meta_cached(int(head_dim), int(rotary_dim), bool(unit_offset), *tile)


def _prepare(q, k, q_weight, k_weight, cos, sin):
    """The tensors as the kernels take them (dense last dim, one rope stride pair) and the rope strides.
    No copy unless an input needs one."""
    q, k = _dense_last_dim(q), _dense_last_dim(k)
    q_weight, k_weight = _dense_last_dim(q_weight), _dense_last_dim(k_weight)
    cos, sin, stride_cb, stride_cs = _rope_table(cos, sin, q.shape[0])
    return (q, k, q_weight, k_weight, cos, sin), (stride_cb, stride_cs)


def fwd_launch(q, k, q_weight, k_weight, cos, sin, eps: float, unit_offset: bool, settings: LaunchSettings):
    """Allocates the outputs and launches the forward kernel (the op's body; the benchmark times it bare)."""
    (q, k, q_weight, k_weight, cos, sin), rope_strides = _prepare(q, k, q_weight, k_weight, cos, sin)
    batch, seq, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    q_out = q.new_empty(q.shape)
    k_out = k.new_empty(k.shape)
    meta, block_r = _meta(head_dim, cos.shape[-1], unit_offset, False, settings)
    n_q_rows, n_k_rows = batch * seq * heads_q, batch * seq * heads_k
    n_q_tiles = cdiv(n_q_rows, block_r)
    n_tiles = n_q_tiles + cdiv(n_k_rows, block_r)
    if n_tiles > 0:
        q_strides, k_strides = q.stride(), k.stride()
        _launch(_qk_norm_rope_fwd_kernel, (n_tiles, 1, 1),
                (q, k, q_out, k_out, q_weight, k_weight, cos, sin),
                (n_q_rows, n_k_rows, n_q_tiles, seq, heads_q, heads_k,
                 q_strides[0], q_strides[1], q_strides[2], k_strides[0], k_strides[1], k_strides[2], *rope_strides),
                (eps,), meta)
    return q_out, k_out


def _bwd_grid(n_q_rows, n_k_rows, block_r: int, device: torch.device, programs_per_sm: int):
    """(tiles per program, q programs, k programs): every program gets the same number of tiles."""
    n_q_tiles, n_k_tiles = cdiv(n_q_rows, block_r), cdiv(n_k_rows, block_r)
    tiles_per_prog = max(1, cdiv(n_q_tiles + n_k_tiles, programs_per_sm * _sms(device)))
    return tiles_per_prog, cdiv(n_q_tiles, tiles_per_prog), cdiv(n_k_tiles, tiles_per_prog)


def bwd_launch(q, k, q_weight, k_weight, cos, sin, grad_q_out, grad_k_out, eps: float, unit_offset: bool,
               settings: LaunchSettings):
    """Allocates the grads and launches the backward kernel and the dW sum (the op's body)."""
    (q, k, q_weight, k_weight, cos, sin), rope_strides = _prepare(q, k, q_weight, k_weight, cos, sin)
    grad_q_out, grad_k_out = _dense_last_dim(grad_q_out), _dense_last_dim(grad_k_out)
    batch, seq, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    device = q.device
    meta, block_r = _meta(head_dim, cos.shape[-1], unit_offset, True, settings)
    n_q_rows, n_k_rows = batch * seq * heads_q, batch * seq * heads_k
    tiles_per_prog, n_q_progs, n_k_progs = _bwd_grid(n_q_rows, n_k_rows, block_r, device,
                                                     settings.bwd_programs_per_sm)
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
                (eps,), meta)
    grad_q_weight = q_weight.new_empty(q_weight.shape)
    grad_k_weight = k_weight.new_empty(k_weight.shape)
    head_dim = int(head_dim)
    block_p, block_d = settings.dw_sum_block_p, settings.dw_sum_block_d
    _launch(_dw_sum_kernel, (2, cdiv(head_dim, block_d), 1),
            (dw_partial, grad_q_weight, grad_k_weight), (n_q_progs, n_progs), (),
            {"D": head_dim, "BLOCK_P": block_p, "BLOCK_D": block_d, "num_warps": 4})
    return grad_q, grad_k, grad_q_weight, grad_k_weight


# ----------------------------------------------------------------------------- kernels


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
                          cos: torch.Tensor, sin: torch.Tensor, eps: float, unit_offset: bool,
                          settings: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return fwd_launch(q, k, q_weight, k_weight, cos, sin, eps, unit_offset, LaunchSettings(*settings))

    @triton_op("moert::qk_norm_rope_bwd", mutates_args={})
    def _qk_norm_rope_bwd(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, grad_q_out: torch.Tensor,
                          grad_k_out: torch.Tensor, eps: float, unit_offset: bool,
                          settings: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return bwd_launch(q, k, q_weight, k_weight, cos, sin, grad_q_out, grad_k_out, eps, unit_offset,
                          LaunchSettings(*settings))

    def _setup_context(ctx, inputs, output):
        q, k, q_weight, k_weight, cos, sin, eps, unit_offset, settings = inputs
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps, ctx.unit_offset, ctx.settings = eps, unit_offset, settings

    def _backward(ctx, grad_q_out, grad_k_out):
        grads = torch.ops.moert.qk_norm_rope_bwd(*ctx.saved_tensors, grad_q_out, grad_k_out,
                                                 ctx.eps, ctx.unit_offset, ctx.settings)
        return (*grads, None, None, None, None, None)

    _qk_norm_rope_fwd.register_autograd(_backward, setup_context=_setup_context)
