"""HF checkpoint I/O: sharded save/load round trip through transformers, EP slices, clear key errors."""

from __future__ import annotations

import contextlib
import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import LoraConfig
from runtime.lora import apply_lora, export_peft
from runtime.models import from_pretrained, save_pretrained
from runtime.models.hf import (
    CheckpointError,
    config_from_hf,
    keys_read,
    load_hf_weights,
    missing_keys,
    read_hf_config,
)
from runtime.models.qwen import QwenForCausalLM
from tests.conftest import write_hf_checkpoint


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


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(folder) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.iterdir()]}


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_exports_respect_the_umask(tiny_moe_ckpt, tmp_path, mask):
    """HF and PEFT exports get the modes a plain mkdir / open give, not mkdtemp's 0700 or safetensors' 0600."""
    model = from_pretrained(tiny_moe_ckpt, expert_backend="eager")
    with umask(mask):
        save_pretrained(model, tmp_path / "hf", max_shard_bytes=200_000)  # sharded: several files and an index
        save_pretrained(model, tmp_path / "hf")  # over an existing export
        export_peft(apply_lora(model, LoraConfig(enabled=True, rank=2)), tmp_path / "adapter")
    for folder in (tmp_path / "hf", tmp_path / "adapter"):
        modes = _modes(folder)
        assert modes.pop(folder.name) == 0o777 & ~mask, folder
        assert set(modes.values()) == {0o666 & ~mask}, (folder, {k: oct(v) for k, v in modes.items()})


def test_config_from_hf_reads_only_the_keys_it_declares(tmp_path):
    """keys_read / missing_keys (what runtime.models.config_check relies on) match what config_from_hf reads."""
    read = []

    class Recording(dict):
        def __getitem__(self, key):
            read.append(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            read.append(key)
            return super().get(key, default)

        def __contains__(self, key):
            read.append(key)
            return super().__contains__(key)

    for kind in ("moe", "dense", "qwen3_next", "qwen3_5", "qwen3_5_moe"):
        write_hf_checkpoint(tmp_path / kind, kind)
        hf = read_hf_config(tmp_path / kind)
        read.clear()
        config_from_hf(Recording(hf))
        assert set(read) <= keys_read(hf["model_type"]), (kind, set(read) - keys_read(hf["model_type"]))
        assert missing_keys(hf) == []
        names = {"vocab_size": {"vocab_size"}, "num_experts": {"num_experts", "num_local_experts"},
                 "layer_types": {"layer_types"}}  # transformers v5 writes num_experts as num_local_experts
        for key in names.keys() & keys_read(hf["model_type"]):
            assert missing_keys({k: v for k, v in hf.items() if k not in names[key]}) == [key]
