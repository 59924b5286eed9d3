"""The eval loss: the mean cross-entropy over every label token of the eval set, computed like training
(every data rank its share of the batches, context parallelism splitting each one once) without
gradients, then one reduction.

    record = evaluate(model, batches, env, step)   # {"step", "eval_loss", "eval_tokens"} on every rank

Every rank runs the same number of forwards (runtime.data.eval_batches pads the last step), so FSDP and EP
collectives stay matched; the result does not depend on the number of ranks (tests/dist/test_eval.py).
The model is in eval mode meanwhile (no router balance loss, no LoRA dropout) and back in train mode after.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from runtime.distributed.process_group import DistEnv, all_reduce_sum


@torch.no_grad()
def evaluate(model, batches: list, env: DistEnv, step: int) -> dict:
    cp = model.context_parallel
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if env.device.type == "cuda" else nullcontext()
    loss_sum = torch.zeros((), device=env.device, dtype=torch.float64)
    labels = 0
    model.eval()
    try:
        for batch in batches:
            batch = batch.to(env.device)
            if cp is not None:
                batch = cp.shard(batch)
            with autocast:
                loss_sum += model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                                  max_seqlen=batch.max_seqlen, labels=batch.labels,
                                  cp=batch.cp if cp is not None else None).double()
            labels += batch.num_label_tokens
    finally:
        model.train()
    total_loss, total_labels = all_reduce_sum(loss_sum.item(), env), all_reduce_sum(labels, env)
    eval_loss = total_loss / total_labels if total_labels else float("nan")
    return {"step": step, "eval_loss": eval_loss, "eval_tokens": int(total_labels)}
