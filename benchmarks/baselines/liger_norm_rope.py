"""Liger's RMSNorm and RoPE kernels as a q/k norm + RoPE baseline, behind our reference's signature.

    fn = liger_qk_norm_rope(with_rope=True, eps=1e-6)    # raises ImportError without liger-kernel
    q_out, k_out = fn(q, k, q_weight, k_weight, cos, sin)

What a transformers user can swap in today: Liger's RMSNorm (llama casting: the Qwen3 cast order) on q
and k, then either our eager RoPE (`with_rope=False`) or Liger's RoPE kernel. q/k [B, S, heads, D],
cos/sin [B, S, D] as transformers' rotary embedding returns them. Liger's RoPE rotates its inputs and
upstream gradients in place; harmless for timing. pyproject extra `bench` installs it.
"""

from __future__ import annotations

from attention.norm_rope import rope_reference


def liger_qk_norm_rope(with_rope: bool, eps: float):
    from liger_kernel.ops import LigerRMSNormFunction
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    def norm(x, w):
        # in_place=False: the in-place variant would overwrite the upstream grad buffer in backward.
        return LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)

    def fn(q, k, q_weight, k_weight, cos, sin):
        q_n, k_n = norm(q, q_weight), norm(k, k_weight)
        if not with_rope:
            return rope_reference(q_n, cos, sin), rope_reference(k_n, cos, sin)
        q_out, k_out = liger_rotary_pos_emb(q_n.transpose(1, 2), k_n.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return fn
