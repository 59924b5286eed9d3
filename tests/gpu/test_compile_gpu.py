"""GPU: the hybrid decoder compiled with inductor (GDN op set auto: fla where it can train here, else torch;
grouped_mm experts) has zero graph breaks with and without activation checkpointing, and its loss matches
eager."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from runtime.distributed.activation_checkpoint import apply_activation_checkpointing
from runtime.distributed.compile import apply_compile
from runtime.models import from_pretrained
from tests.conftest import label_loss_sum, write_hf_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_inductor_compiled_hybrid_no_graph_breaks(tmp_path, ac):
    from runtime.choices import Needs, choose

    op_set = choose("model.gdn_op_set", "auto", Needs("cuda"))[0]  # fla where it can train here, else torch
    write_hf_checkpoint(tmp_path, "qwen3_5_moe")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 320, (2, 128), generator=g).cuda()
    pos = torch.cat([torch.arange(50), torch.arange(78)]).expand(2, 128).cuda()
    labels = torch.randint(0, 320, (2, 128), generator=g).cuda()
    losses = []
    for compiled in (False, True):
        model = from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda", expert_backend="grouped_mm",
                                gdn_op_set=op_set, router_aux_loss_coef=0.01)
        apply_activation_checkpointing(model, ac)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            apply_compile(model, {})
        loss = label_loss_sum(model(ids, position_ids=pos), labels) / labels.numel()
        loss.backward()
        losses.append(loss.item())
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert abs(losses[0] - losses[1]) <= 2e-2 * abs(losses[0])
