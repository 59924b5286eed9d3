"""Bad configs fail before anything runs, with a message naming the key and the fix."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from runtime.config import ConfigError, config_from_dict, load_config
from runtime.launch import prepare
from runtime.mesh import MeshError, ParallelDims

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-moe.yaml"


def base() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def with_(edit) -> dict:
    raw = copy.deepcopy(base())
    edit(raw)
    return raw


BAD = {
    "unknown top-level section": (lambda r: r.update(modle={}), "modle: unknown key"),
    "unknown nested key": (lambda r: r["optim"].update(learning_rate=1), "optim.learning_rate: unknown key"),
    "wrong type": (lambda r: r["train"].update(max_steps="many"), "train.max_steps: Input should be a valid integer"),
    "negative lr": (lambda r: r["optim"].update(lr=-1), "optim.lr: Input should be greater than 0"),
    "bad backend": (lambda r: r["model"].update(expert_backend="fast"), "model.expert_backend: Input should be"),
    "both model sources": (lambda r: r["model"].update(path="/x"), "set exactly one of model.path"),
    "missing data": (lambda r: r.pop("data"), "data: required key is missing"),
    "warmup too long": (lambda r: r["optim"].update(warmup_steps=100), "optim.warmup_steps (100) must be smaller"),
    "ep does not divide": (lambda r: r.update(parallelism={"dp_shard": 3, "ep": 2}), "parallelism.ep (2) must divide"),
    "fp4 not built": (lambda r: r.update(quant={"base_weights": "nvfp4"}), "is not implemented yet"),
    "context parallel not built": (lambda r: r.update(parallelism={"cp": 2}), "context parallelism is not implemented"),
    "deepep not built": (lambda r: r.update(parallelism={"dispatcher": "deepep"}), "deepep is not implemented"),
    "inductor option unknown": (lambda r: r.update(compile={"enabled": True, "inductor_options": {"foo": 1}}),
                                "compile.inductor_options has unknown keys ['foo']"),
    "inductor options without compile": (lambda r: r.update(compile={"inductor_options": {"max_autotune": True}}),
                                         "set compile.enabled: true"),
    "lora target typo": (lambda r: r.update(lora={"enabled": True, "target_modules": ["qproj"]}),
                         "lora.target_modules.0: Input should be"),
    "random init without tokenizer": (lambda r: r["data"].pop("tokenizer"), "set data.tokenizer"),
    "zero dp_shard": (lambda r: r.update(parallelism={"dp_shard": 0}), "parallelism.dp_shard must be >= 1"),
    "compile with ep": (lambda r: r.update(parallelism={"ep": 2}, compile={"enabled": True}),
                        "compile.enabled with parallelism.ep > 1 is not supported yet"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_config_names_the_key(name):
    edit, message = BAD[name]
    with pytest.raises(ConfigError) as err:
        config_from_dict(with_(edit))
    assert message in str(err.value)


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  path: x\n  dtype: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: YAML syntax error"):
        load_config(path)


def test_flags_override_yaml_and_relative_paths_resolve():
    cfg = load_config(EXAMPLE, {"train.max_steps": 10, "parallelism.ep": 2})
    assert cfg.train.max_steps == 10 and cfg.parallelism.ep == 2
    assert Path(cfg.data.path).is_file()


@pytest.mark.parametrize("dims, message", [
    ({"dp_replicate": 1, "dp_shard": 3, "cp": 1, "ep": 1, "world_size": 4}, "but the world size is 4"),
    ({"dp_replicate": 1, "dp_shard": 4, "cp": 1, "ep": 3, "world_size": 4}, "ep=3 must divide dp_shard*cp = 4"),
    ({"dp_replicate": 0, "dp_shard": 4, "cp": 1, "ep": 1, "world_size": 4}, "dp_replicate must be >= 1"),
])
def test_bad_mesh(dims, message):
    with pytest.raises(MeshError, match=message.replace("*", r"\*")):
        ParallelDims(**dims)


def test_ep_must_divide_experts():
    with pytest.raises(MeshError, match=r"ep=4 must divide the number of experts \(6\)"):
        ParallelDims(1, 4, 1, 4, 4).check_experts(6)


def test_set_overrides_any_key_with_yaml_typed_values():
    _, cfg, _ = prepare([str(EXAMPLE), "--set", "model.expert_backend=eager", "--set", "lora.enabled=true",
                         "--set", "lora.target_modules=[q_proj, experts]", "--set", "optim.lr=1e-4",
                         "--max-steps", "10", "--set", "train.max_steps=12"])
    assert cfg.model.expert_backend == "eager" and cfg.lora.enabled is True
    assert cfg.lora.target_modules == ["q_proj", "experts"] and cfg.optim.lr == 1e-4
    assert cfg.train.max_steps == 12  # --set comes after the named flags
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        prepare([str(EXAMPLE), "--set", "model.expert_backend"])
    with pytest.raises(ConfigError, match="model.expert_backend"):
        prepare([str(EXAMPLE), "--set", "model.expert_backend=scatter"])


def test_launch_checks_mesh_against_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(MeshError, match="world size is 4"):
        prepare([str(EXAMPLE), "--dp-shard", "2"])


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-lora.yaml", "qwen3-30b-a3b-full.yaml", "qwen3.5-35b-a3b-lora.yaml"])
def test_real_shape_examples_validate(name):
    cfg = load_config(EXAMPLE.parent / name)
    assert cfg.model.path and (cfg.parallelism.ep > 1 or cfg.compile.enabled)
