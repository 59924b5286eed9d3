"""GPU: op set fla is refused at build time exactly where FLA would refuse its gated backward mid-step.

FLA 0.6 raises at the first backward on Hopper with Triton 3.4 to 3.7.0 unless its TileLang backend can
run (FLA issue #640). attention/gdn_ops_fla.py's `backward_refusal()` predicts that from FLA's own flags;
the reference here is what FLA's backward actually does on this machine, then what the layer's build
makes of the prediction (fla refused with the fix named, auto passed over to torch with a warning).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():
    pytest.importorskip("fla", reason="op set fla needs flash-linear-attention")
    from attention import gdn_ops_fla
    from attention.gdn import GatedDeltaNet

LAYER = {"hidden": 256, "num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 64, "head_v_dim": 64,
         "conv_kernel": 4, "eps": 1e-6}


def flas_backward_error() -> RuntimeError | None:
    """Run the op set's gated delta rule forward and backward on a small bf16 case; FLA's error, if any."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, 128, 2, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 128, 4, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = -torch.rand(1, 128, 4, device="cuda", generator=gen) * 0.3
    beta = torch.rand(1, 128, 4, device="cuda", generator=gen, dtype=torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    try:
        gdn_ops_fla.chunk_gated_delta_rule(*leaves, None).float().sum().backward()
    except RuntimeError as error:
        return error
    return None


def test_refusal_predicts_flas_backward():
    error, refusal = flas_backward_error(), gdn_ops_fla.backward_refusal()
    assert (error is None) == (refusal is None), f"FLA's backward: {error!r}; predicted refusal: {refusal!r}"
    if error is not None:
        assert "#640" in str(error) and "#640" in refusal


def test_plan_follows_the_refusal():
    from runtime.choices import Needs, choose
    from runtime.config import ConfigError

    refusal = gdn_ops_fla.backward_refusal()
    if refusal is None:
        assert GatedDeltaNet(**LAYER, op_set="fla").op_set == "fla"
        assert choose("model.gdn_op_set", "auto", Needs("cuda"))[0] == "fla"
        return
    with pytest.raises(ConfigError, match=r"model\.gdn_op_set: fla cannot run here: .*tilelang"):
        choose("model.gdn_op_set", "fla", Needs("cuda"))
    name, passed_over = choose("model.gdn_op_set", "auto", Needs("cuda"))
    assert name == "torch" and "tilelang" in passed_over[0]  # plan() warns with it for hybrid models
