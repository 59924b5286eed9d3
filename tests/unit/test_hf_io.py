"""HF checkpoint I/O: sharded save/load round trip through transformers, EP slices, clear key errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.models import from_pretrained, save_pretrained
from runtime.models.hf import CheckpointError, config_from_hf, load_hf_weights, read_hf_config
from runtime.models.qwen import QwenForCausalLM


def test_sharded_save_loads_in_transformers(tiny_moe_ckpt, tmp_path):
    from transformers import Qwen3MoeForCausalLM

    ours = from_pretrained(tiny_moe_ckpt, expert_backend="eager")
    save_pretrained(ours, tmp_path / "out", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")], "temporary folder left behind"
    hf = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (1, 16))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() <= 1e-5
    reloaded = from_pretrained(tmp_path / "out", expert_backend="eager")
    for (n, a), (_, b) in zip(ours.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_expert_slice_reads_only_owned_experts(tiny_moe_ckpt):
    full = from_pretrained(tiny_moe_ckpt, expert_backend="eager")
    cfg = config_from_hf(read_hf_config(tiny_moe_ckpt))
    with torch.device("meta"):
        part = QwenForCausalLM(cfg)
    for block in part.moe_blocks():  # what EP rank 1 of 2 builds
        block.experts.__init__(4, cfg.hidden_size, cfg.moe_intermediate_size, device="meta", expert_offset=4)
    load_hf_weights(part, tiny_moe_ckpt, torch.float32, "cpu")
    for fb, pb in zip(full.moe_blocks(), part.moe_blocks()):
        assert torch.equal(pb.experts.gate_up, fb.experts.gate_up[4:])
        assert torch.equal(pb.experts.down, fb.experts.down[4:])


def _copy_ckpt(src, dst, edit):
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_missing_and_unexpected_keys_are_listed(tiny_moe_ckpt, tmp_path):
    def edit(t):
        del t["model.layers.1.self_attn.q_proj.weight"]
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    _copy_ckpt(tiny_moe_ckpt, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as err:
        from_pretrained(tmp_path / "bad")
    assert "missing keys (1): model.layers.1.self_attn.q_proj.weight" in str(err.value)
    assert "unexpected keys (1): model.layers.0.self_attn.extra.weight" in str(err.value)


def test_shape_mismatch_is_listed(tiny_moe_ckpt, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(64, 31)
    _copy_ckpt(tiny_moe_ckpt, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=r"experts.3.down_proj.weight: checkpoint \(64, 31\) vs model \(64, 32\)"):
        from_pretrained(tmp_path / "bad")


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        from_pretrained(tmp_path)


def test_layer_override_ignores_deeper_layers(tiny_moe_ckpt):
    model = from_pretrained(tiny_moe_ckpt, num_layers=1)
    assert len(model.model.layers) == 1
