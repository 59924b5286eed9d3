"""GPU: train.graph_step (runtime.graph_step). The varlen attention on a batch padded to its bucket (empty
documents, a larger max_seqlen) against the batch itself; then the tiny example trained with the step replayed
from CUDA graphs against the same run stepped eagerly: the same losses, and the graphs were captured."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from attention.attention import ATTN_BACKENDS, build_attn_meta
from runtime.config import load_config
from runtime.distributed.process_group import DistEnv
from runtime.plan import plan
from runtime.train import train
from tests.conftest import small_chat_data

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-moe.yaml"


def test_varlen_attention_ignores_empty_documents_and_a_larger_bound():
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths, S, Hq, Hkv, D = [300, 17, 500, 207], 1024, 8, 2, 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    padded_cu = torch.cat([cu, cu[-1:].expand(4)])
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()

    def run(cu_seqlens, max_seqlen):
        q, k, v = (torch.randn(1, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g.manual_seed(i))
                   .requires_grad_() for i, h in enumerate((Hq, Hkv, Hkv)))
        out = ATTN_BACKENDS.get("flash")(q, k, v, build_attn_meta(positions, cu_seqlens, max_seqlen, "flash"),
                                         D ** -0.5)
        out.backward(torch.ones_like(out))
        return out, q.grad, k.grad, v.grad

    for got, want in zip(run(padded_cu, 1024), run(cu, max(lengths))):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _train(tmp: Path, graph_step: bool, steps: int = 12) -> list[dict]:
    cfg = load_config(EXAMPLE, {"data.seq_len": 512, "train.max_steps": steps, "optim.warmup_steps": 0,
                                "logging.progress_bar": False, "checkpoint.save_final": False,
                                "train.output_dir": str(tmp), "data.path": small_chat_data(),
                                "lora.enabled": True, "train.graph_step": graph_step})
    run_plan = plan(cfg, 1, "cuda")
    return train(run_plan.config, DistEnv(0, 1, 0, torch.device("cuda")), run_plan.dims, plan=run_plan)


def test_a_graphed_run_trains_as_the_eager_one(tmp_path, caplog):
    eager = _train(tmp_path / "eager", False)
    with caplog.at_level(logging.INFO, logger="runtime"):
        graphed = _train(tmp_path / "graphed", True)
    assert "captured bucket" in caplog.text
    losses = [(a["loss"], b["loss"]) for a, b in zip(eager, graphed)]
    assert len(losses) == 12 and all(abs(a - b) <= 1e-2 * abs(a) for a, b in losses), losses
