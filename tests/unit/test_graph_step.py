"""runtime.graph_step on the CPU: the shape buckets, and a padded batch's step equal to the batch's own (the
loss's label bound and the empty documents change nothing). Capture and replay: tests/gpu/test_graph_step_gpu.py."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from benchmarks.bench_graph_step import DRY_ARGV, build
from runtime.data.chat import load_tokenizer
from runtime.data.loader import build_dataloader
from runtime.data.packing import Batch
from runtime.graph_step import LABEL_BUCKET, GraphedSteps, bucket_of, static_batch
from runtime.step import forward_backward, global_label_count, train_step
from tests.conftest import small_chat_data


def _batch(seqlens: list[int], labels: int, rows: int = 1) -> Batch:
    S = sum(seqlens) // rows
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.zeros(rows, S, dtype=torch.long)
    return Batch(ids, ids.clone(), ids.clone(), cu, max(seqlens), labels)


def test_buckets_round_documents_and_longest_to_powers_of_two_and_label_rows_up():
    assert bucket_of(_batch([3000, 2000, 1000, 2192], labels=5000)) == (4, 4096, 5 * LABEL_BUCKET)
    assert bucket_of(_batch([100] * 80 + [192], labels=3000)) == (128, 256, 3 * LABEL_BUCKET)
    assert bucket_of(_batch([5, 5, 6], labels=9)) == (4, 8, 16)  # capped at the B*S tokens
    # one document per row: the dense branch's shapes, kept
    assert bucket_of(_batch([8192, 8192], labels=16382, rows=2)) == (2, 8192, 16 * LABEL_BUCKET)


def test_static_batch_appends_empty_documents_and_refuses_a_smaller_bucket():
    batch = _batch([3, 5, 8], labels=10)
    padded = static_batch(batch, (8, 16, 16))
    assert padded.cu_seqlens.tolist() == [0, 3, 8, 16, 16, 16, 16, 16, 16]
    assert (padded.max_seqlen, padded.num_label_tokens, padded.loss_rows) == (16, 10, 16)
    assert padded.input_ids is batch.input_ids and batch.label_bound is None and batch.loss_rows == 10
    with pytest.raises(ValueError, match="below"):
        static_batch(batch, (2, 16, 16))


def test_a_padded_batch_steps_as_the_batch_itself():
    """forward and backward of the tiny LoRA model on a packed row of chat data and on the same row padded to a
    larger bucket: the same loss and gradients, to the bit (the CPU's attention reads positions, and the
    loss's rows past the label count add exact zeros)."""
    _, env, _, model, _, batch = build([*DRY_ARGV, "--set", f"data.path={small_chat_data()}"], "config")
    docs, _, rows = bucket_of(batch)
    padded = static_batch(batch, (2 * docs, batch.input_ids.shape[1], rows))
    assert padded.loss_rows > batch.num_label_tokens > 0

    def step(b: Batch):
        loss = forward_backward(model, [b], env, nullcontext(), global_label_count([b], model, env))
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss, grads

    (loss, grads), (padded_loss, padded_grads) = step(batch), step(padded)
    assert grads and grads.keys() == padded_grads.keys()
    torch.testing.assert_close(padded_loss, loss, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(padded_grads[name], grads[name], rtol=0, atol=0)


def _trained(graphed: bool, micro_batches: int, steps: int = 8) -> tuple[list[float], GraphedSteps | None]:
    """The tiny LoRA model stepped `steps` times over `micro_batches` packed chat rows of 64 tokens (several
    documents each), by GraphedSteps or by runtime.step.train_step; torch's fused AdamW on the CPU, a constant lr."""
    cfg, env, _, model, _, _ = build([*DRY_ARGV, "--set", f"data.path={small_chat_data()}"], "config")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
    loader = build_dataloader(cfg.data, load_tokenizer(cfg.data.tokenizer), 1)
    runner = GraphedSteps(model, optimizer, cfg, env) if graphed else None
    losses, previous = [], None
    for _ in range(steps):
        batches = [next(loader) for _ in range(micro_batches)]
        launched = (runner.launch(batches, previous) if runner else
                    train_step(model, batches, optimizer, cfg, env, previous=previous))
        losses.append(launched.result().loss)
        previous = launched
    return losses, runner


def capture_without_cuda(step, pool):
    """A stand-in for runtime.graph_step.capture_step off CUDA: records the step without running it (as a
    capture does) and runs it at each replay on what the static batches then hold, into one numbers tensor."""
    numbers = torch.zeros(6, dtype=torch.float64)  # runtime.step.LaunchedStep.numbers
    return (lambda: numbers.copy_(step())), numbers


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_replayed_steps_train_as_queued_ones(monkeypatch, micro_batches):
    """GraphedSteps' bookkeeping on the CPU, with capture_without_cuda for torch's CUDA graph: the first step
    eager, buckets captured once and replayed with each step's rows, label count and numbers; the losses
    are the queued steps'."""
    monkeypatch.setattr("runtime.graph_step.capture_step", capture_without_cuda)
    queued, _ = _trained(False, micro_batches)
    replayed, runner = _trained(True, micro_batches)
    assert 0 < len(runner.graphs) < len(replayed) - 1  # some bucket came back and was replayed
    torch.testing.assert_close(torch.tensor(replayed), torch.tensor(queued), rtol=1e-5, atol=0)
    assert replayed[-1] < replayed[0]


def test_an_update_inside_learning_rates_from_reads_the_device_scalars():
    """What a captured update does at each replay: torch's fused AdamW takes its learning rate from the scalar
    tensors (filled from the groups' floats on entry), and the groups hold their floats again after."""
    from runtime.graph_step import learning_rates_from

    def stepped(use_tensors: bool) -> torch.Tensor:
        p = torch.nn.Parameter(torch.linspace(-1, 1, 8))
        p.grad = torch.linspace(0.5, -0.3, 8)
        optimizer = torch.optim.AdamW([p], lr=0.1, fused=True)
        lrs = [torch.zeros(())]
        with learning_rates_from(optimizer, lrs) if use_tensors else nullcontext():
            assert (optimizer.param_groups[0]["lr"] is lrs[0]) == use_tensors
            optimizer.step()
        assert optimizer.param_groups[0]["lr"] == 0.1 and (not use_tensors or lrs[0].item() == pytest.approx(0.1))
        return p.detach()

    torch.testing.assert_close(stepped(True), stepped(False), rtol=0, atol=0)
