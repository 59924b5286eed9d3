"""Eval loss (runtime.evaluation): distributed like training and equal to the single-process eval loss of
the same eval set (gloo, fp32); the held-out documents are never trained on."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from runtime.config import load_config
from runtime.data.chat import load_tokenizer
from runtime.data.loader import build_dataloader, eval_batches
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.parallelize import parallelize
from runtime.distributed.process_group import DistEnv
from runtime.evaluation import evaluate
from runtime.models.factory import build_model
from tests.conftest import small_chat_data
from tests.dist.test_parity import EXAMPLE


def _cfg(**parallelism):
    overrides = {"data.seq_len": 64, "train.micro_batch_size": 3, "data.eval_fraction": 0.02,
                 "model.router_aux_loss_coef": 0.01, "data.path": small_chat_data(),
                 **{f"parallelism.{k}": v for k, v in parallelism.items()}}
    return load_config(EXAMPLE, overrides)


def _eval(cfg, rank: int, world_size: int) -> dict:
    p = cfg.parallelism
    dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.cp, p.ep, world_size)
    env = DistEnv(rank, world_size, 0, torch.device("cpu"))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    loader = build_dataloader(cfg.data, tokenizer, cfg.train.micro_batch_size, dims.dp_rank(rank), dims.dp_world)
    batches = eval_batches(cfg.data, tokenizer, cfg.train.micro_batch_size, loader.held_out, dims.dp_rank(rank),
                           dims.dp_world)
    model = build_model(cfg, env, dims)
    parallelize(model, dims, dims.build_meshes("cpu") if world_size > 1 else None, cfg)
    record = evaluate(model, batches, env, step=7)
    assert model.training  # back in train mode
    return {**record, "batches": len(batches)}


def _rank(rank, world_size, parallelism):
    return _eval(_cfg(**parallelism), rank, world_size)


def test_eval_loss_on_two_ranks_equals_one_process(run_dist):
    for parallelism in ({}, {"ep": 2}, {"cp": 2}):
        results = run_dist(_rank, 2, parallelism)
        single = _eval(_cfg(), 0, 1)
        assert results[0]["batches"] == results[1]["batches"]  # the same forwards on every rank
        for r in results:
            assert r["step"] == 7 and r["eval_tokens"] == single["eval_tokens"] > 0
            assert abs(r["eval_loss"] - single["eval_loss"]) <= 1e-6 * single["eval_loss"], (parallelism, r, single)


def test_held_out_documents_are_never_trained_on():
    cfg = _cfg()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    full = build_dataloader(cfg.data.model_copy(update={"eval_fraction": 0.0}), tokenizer, 1)
    loader = build_dataloader(cfg.data, tokenizer, 1)
    def docs(corpus) -> Counter:  # the bundled data repeats some documents: count them
        return Counter(tuple(corpus.piece(d, 0, int(n))[0].tolist()) for d, n in enumerate(corpus.lengths))
    train, held = docs(loader.corpus), docs(loader.held_out)
    assert train + held == docs(full.corpus)  # every document once: in training or held out
    assert loader.held_out.num_documents == round(0.02 * full.corpus.num_documents) > 0
    assert docs(build_dataloader(cfg.data, tokenizer, 1).held_out) == held  # chosen by data.seed: always the same


def test_a_held_out_file_is_evaluated_whole(tmp_path):
    from runtime.guard.preflight import PreflightError, preflight

    lines = (EXAMPLE.parent / "tiny" / "data" / "train.jsonl").read_text().splitlines()[:30]
    (tmp_path / "eval.jsonl").write_text("\n".join(lines) + "\n")
    cfg = load_config(EXAMPLE, {"data.seq_len": 64, "data.eval": str(tmp_path / "eval.jsonl"),
                             "data.path": small_chat_data()})
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    batches = eval_batches(cfg.data, tokenizer, 2)
    held = build_dataloader(cfg.data.model_copy(update={"path": cfg.data.eval}), tokenizer, 1).corpus
    assert sum(b.num_label_tokens for b in batches) == sum(  # every label token of the file, once
        int(held.trained[held.offsets[d] + 1:held.offsets[d + 1]].sum()) for d in range(held.num_documents))
    assert build_dataloader(cfg.data, tokenizer, 1).held_out is None  # the training data stays whole
    missing = load_config(EXAMPLE, {"data.eval": str(tmp_path / "nope.jsonl"),
                                    "train.output_dir": str(tmp_path / "out")})
    with pytest.raises(PreflightError, match="data.eval"):
        preflight(missing, 0)
