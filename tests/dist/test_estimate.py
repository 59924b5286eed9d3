"""runtime.estimate: the static part (parameters per rank, dense, LoRA, FP4 / FP8 bases, FSDP/EP-sharded) equals
what the trainer's model holds on each rank (gloo); activations scale as the estimate's model says; the CLI
prints before any process group. The comparison with measured GPU peaks is in docs/estimate.md."""

from __future__ import annotations

import pytest
import torch

from runtime.config import load_config
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.parallelize import parallelize
from runtime.distributed.process_group import DistEnv
from runtime.estimate import estimate
from runtime.launch import main
from runtime.models.factory import build_model
from tests.dist.test_parity import EXAMPLE

DENSE_QWEN3 = {"model_type": "qwen3", "vocab_size": 520, "hidden_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
               "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
# LoRA's frozen dense weights: replicated on every rank (auto on the CPU) or FSDP-sharded
CASES = {"full": {}, "lora": {"lora.enabled": True}, "lora-nvfp4": {"lora.enabled": True,
                                                                     "quant.base_weights": "nvfp4"},
         "lora-fp8": {"lora.enabled": True, "quant.base_weights": "fp8"},
         "lora-shard": {"lora.enabled": True, "parallelism.frozen_dense": "shard"},
         # a dense Qwen3: no expert unit, so replicate leaves no FSDP unit at all
         "lora-dense-model": {"lora.enabled": True, "model.config": DENSE_QWEN3,
                              "lora.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}


def _cfg(**extra):
    return load_config(EXAMPLE, {"parallelism.dp_shard": -1, **extra})


def _held_bytes(model) -> int:
    """Bytes of this rank's parameter shards and packed buffers."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local) + sum(
        b.numel() * b.element_size() for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] in
        ("qdata", "scale", "tensor_scale"))


def _rank(rank, world_size, extra, ep):
    cfg = _cfg(**extra, **{"parallelism.ep": ep})
    dims = ParallelDims.resolve(1, -1, 1, ep, world_size)
    model = build_model(cfg, DistEnv(rank, world_size, 0, torch.device("cpu")), dims)
    parallelize(model, dims, dims.build_meshes("cpu") if world_size > 1 else None, cfg)
    return _held_bytes(model), estimate(cfg, dims, cuda=False).parameters


@pytest.mark.parametrize("case", sorted(CASES))
def test_parameter_bytes_per_rank_are_what_the_model_holds(run_dist, case):
    held, estimated = _rank(0, 1, CASES[case], 1)
    assert held == estimated
    for ep in (1, 2):
        for held, estimated in run_dist(_rank, 2, CASES[case], ep):
            assert abs(held - estimated) <= 0.01 * held, (ep, held, estimated)


def test_activations_follow_tokens_cp_and_checkpointing():
    def act(**extra):
        cfg = _cfg(**extra)
        p = cfg.parallelism
        return estimate(cfg, ParallelDims.resolve(1, -1, p.cp, 1, p.cp)).activations
    assert act(**{"data.seq_len": 512}) == 2 * act(**{"data.seq_len": 256})
    assert act(**{"parallelism.cp": 2}) * 2 == act()
    full, selective, none = (act(**{"parallelism.activation_checkpoint": m}) for m in ("full", "selective", "none"))
    assert full < selective < none


def test_cli_prints_the_estimate_without_a_process_group(capsys):
    assert main(["--estimate", "--world-size", "2", "--ep", "2", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "world 2 = dp_replicate 1 x dp_shard 2 x cp 1; ep 2" in out and "peak (estimate)" in out
    assert not torch.distributed.is_initialized()
