"""Bad configs fail before anything runs, with a message naming the key and the fix."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from runtime.config import ConfigError, config_from_dict, load_config
from runtime.distributed.mesh import MeshError, ParallelDims
from runtime.launch import prepare
from runtime.models.config_check import model_config_problems
from tests.conftest import TINY_DENSE, TINY_HYBRID, TINY_MOE, write_hf_checkpoint

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
    "bad backend": (lambda r: r["model"].update(expert_backend="fast"),
                    "model.expert_backend: unknown expert backend 'fast'; choose one of ['auto', 'eager', 'grouped_mm', "),
    "bad attention backend": (lambda r: r["model"].update(attn_backend="flex"),
                              "model.attn_backend: unknown attention backend 'flex'; choose one of"),
    "bad norm/rope impl": (lambda r: r["model"].update(norm_rope_impl="cuda"), "model.norm_rope_impl: unknown"),
    "bad GDN op set": (lambda r: r["model"].update(gdn_op_set="triton"),
                       "model.gdn_op_set: unknown GDN op set 'triton'; choose one of ['auto', 'fla', 'torch']"),
    "bad dispatcher": (lambda r: r.update(parallelism={"dispatcher": "alltoall"}),
                       "parallelism.dispatcher: unknown dispatcher 'alltoall'; choose one of"),
    "both model sources": (lambda r: r["model"].update(path="/x"), "set exactly one of model.path"),
    "missing data": (lambda r: r.pop("data"), "data: required key is missing"),
    "cp attention typo": (lambda r: r.update(parallelism={"cp": 2, "cp_attention": "ring"}),
                          "parallelism.cp_attention: Input should be 'allgather' or 'ulysses'"),
    "inductor option unknown": (lambda r: r.update(compile={"enabled": True, "inductor_options": {"foo": 1}}),
                                "compile.inductor_options has unknown keys ['foo']"),
    "inductor options without compile": (lambda r: r.update(compile={"enabled": False,
                                                                      "inductor_options": {"max_autotune": True}}),
                                         "set compile.enabled: true"),
    "compile typo": (lambda r: r.update(compile={"enabled": "yes please"}),
                     "compile.enabled: Input should be true, false or auto (got 'yes please')"),
    "lora target typo": (lambda r: r.update(lora={"enabled": True, "target_modules": ["qproj"]}),
                         "lora.target_modules.0: Input should be"),
    "zero dp_shard": (lambda r: r.update(parallelism={"dp_shard": 0}), "parallelism.dp_shard must be >= 1"),
}


# Keys of different sections that must agree: runtime.plan checks them, before any process group.
CROSS_SECTION = {
    "warmup too long": (lambda r: r["optim"].update(warmup_steps=100), "optim.warmup_steps (100) must be smaller"),
    "ep does not divide": (lambda r: r.update(parallelism={"dp_shard": 3, "ep": 2}), "parallelism.ep (2) must divide"),
    "fp4 full fine-tune": (lambda r: r.update(quant={"base_weights": "nvfp4"}), "set lora.enabled: true"),
    "cp pieces": (lambda r: r.update(parallelism={"cp": 3}), "set data.seq_len (now 256) to a multiple of 6"),
    "random init without tokenizer": (lambda r: r["data"].pop("tokenizer"), "set data.tokenizer"),
}


@pytest.mark.parametrize("name", sorted(CROSS_SECTION))
def test_cross_section_mistakes_are_planned_out(name):
    from runtime.plan import plan

    edit, message = CROSS_SECTION[name]
    cfg = config_from_dict(with_(edit))
    world = max(cfg.parallelism.dp_shard, 1) * cfg.parallelism.cp
    with pytest.raises(ConfigError) as err:
        plan(cfg, world, "cpu")
    assert message in str(err.value)


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
    _, cfg, _, _ = prepare([str(EXAMPLE), "--set", "model.expert_backend=eager", "--set", "lora.enabled=true",
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


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-lora.yaml", "qwen3-30b-a3b-full.yaml", "qwen3.5-35b-a3b-lora.yaml",
                                  "qwen3-30b-a3b-lora-nvfp4.yaml", "qwen3.5-35b-a3b-long-context.yaml"])
def test_real_shape_examples_validate(name):
    cfg = load_config(EXAMPLE.parent / name)
    assert cfg.model.path and (cfg.parallelism.ep > 1 or cfg.compile.enabled is True or cfg.quant.base_weights != "none")


# ----------------------------------------------------------------------------- model.config

TOKENIZER = EXAMPLE.parent / "tiny" / "tokenizer"  # 512 tokens; the example's vocab_size is 520


def check(raw: dict):
    """config_from_dict with the example's relative paths resolved, so the tokenizer is checked too."""
    return config_from_dict(raw, base_dir=EXAMPLE.parent)


def model_cfg(edit) -> dict:
    return with_(lambda r: edit(r["model"]["config"]))


def rename(old: str, new: str):
    return lambda c: c.update({new: c.pop(old)})


def drop(key: str):
    return lambda c: c.pop(key)


def hybrid(model_type: str, **edits) -> dict:
    """A tiny hybrid text config of `model_type` (Gated DeltaNet + attention every 4th layer)."""
    cfg = {**TINY_HYBRID, "model_type": model_type, "vocab_size": 520,
           "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    if model_type == "qwen3_5_moe_text":
        cfg.pop("intermediate_size")
    if model_type == "qwen3_5_text":  # dense
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok"):
            cfg.pop(key)
    return {**cfg, **edits}


MODEL_BAD = {
    "num_expert typo": (rename("num_experts", "num_expert"),
                        "model.config.num_expert: unknown key for model_type qwen3_moe; did you mean num_experts?"),
    "num_experts_per_token typo": (rename("num_experts_per_tok", "num_experts_per_token"),
                                   ("model.config.num_experts_per_token: unknown key for model_type qwen3_moe; "
                                    "did you mean num_experts_per_tok?")),
    "rope_theta typo": (lambda c: c["rope_parameters"].update(rope_thetta=1e6),
                        ("model.config.rope_parameters.rope_thetta: unknown key for model_type qwen3_moe; "
                         "did you mean rope_theta?")),
    "unknown key far from any": (lambda c: c.update(banana=1),
                                 "model.config.banana: unknown key for model_type qwen3_moe; remove it"),
    "missing vocab_size": (drop("vocab_size"),
                           "model.config.vocab_size: required key is missing for model_type qwen3_moe"),
    "missing moe_intermediate_size": (drop("moe_intermediate_size"),
                                      "model.config.moe_intermediate_size: required key is missing"),
    "top-k > experts": (lambda c: c.update(num_experts_per_tok=9),
                        "model.config.num_experts_per_tok: top-k (9) must be <= num_experts (8)"),
    "heads not divisible by kv heads": (lambda c: c.update(num_key_value_heads=3),
                                        ("model.config.num_attention_heads: 4 is not divisible by "
                                         "num_key_value_heads (3)")),
    "hidden not divisible by heads without head_dim": (lambda c: (c.pop("head_dim"), c.update(num_attention_heads=3,
                                                                                             num_key_value_heads=1)),
                                                       "model.config.head_dim: required when hidden_size (64)"),
    "zero experts": (lambda c: c.update(num_experts=0), "model.config.num_experts: must be a positive integer (got 0)"),
    "size as a string": (lambda c: c.update(hidden_size="64"),
                         "model.config.hidden_size: must be a positive integer (got '64')"),
    "rms_norm_eps read as a string": (lambda c: c.update(rms_norm_eps="1e-06"),
                                      "model.config.rms_norm_eps: must be a positive number (got '1e-06'"),
    "vocab smaller than the tokenizer": (lambda c: c.update(vocab_size=500),
                                         "model.config.vocab_size: 500 is smaller than the tokenizer's 512 tokens"),
    "unknown model_type": (lambda c: c.update(model_type="llama"),
                           "model.config.model_type: 'llama' is not supported; supported: qwen3, qwen3_moe"),
    "no model_type": (drop("model_type"), "model.config.model_type: required key is missing; set one of qwen3,"),
    "dense kind without intermediate_size": (
        lambda c: (c.clear(), c.update(model_type="qwen3", vocab_size=520, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4)),
        "model.config.intermediate_size: required key is missing for model_type qwen3"),
    "MoE key on a dense kind": (lambda c: (c.clear(), c.update(model_type="qwen3", num_experts=8, **TINY_DENSE)),
                                ("model.config.num_experts: unknown key for model_type qwen3; it configures qwen3_moe, "
                                 "qwen3_next, qwen3_5_moe_text: change model_type or remove it")),
    "hybrid without layer_types": (lambda c: (c.clear(), c.update({**hybrid("qwen3_next"), "layer_types": None})),
                                   "model.config.layer_types: required key is missing for model_type qwen3_next"),
    "hybrid layer_types too short": (lambda c: (c.clear(), c.update(hybrid("qwen3_next", layer_types=["full_attention"]))),
                                     "model.config.layer_types: must name each of the 4 layers"),
    "GDN value heads not divisible by key heads": (
        lambda c: (c.clear(), c.update(hybrid("qwen3_5_text", linear_num_value_heads=3))),
        "model.config.linear_num_value_heads: 3 is not divisible by linear_num_key_heads (2)"),
    "conditional generation without text_config": (lambda c: (c.clear(), c.update(model_type="qwen3_5_moe")),
                                                   "model.config.text_config: required key is missing"),
    "text key outside text_config": (
        lambda c: (c.clear(), c.update(model_type="qwen3_5_moe", text_config=hybrid("qwen3_5_moe_text"), vocab_size=9)),
        "model.config.vocab_size: unknown key for model_type qwen3_5_moe; it belongs in model.config.text_config"),
    "typo in the nested text_config": (
        lambda c: (c.clear(), c.update(model_type="qwen3_5_moe", text_config=hybrid("qwen3_5_moe_text", num_expert=8))),
        "model.config.text_config.num_expert: unknown key for model_type qwen3_5_moe_text; did you mean num_experts?"),
}


@pytest.mark.parametrize("name", sorted(MODEL_BAD))
def test_bad_model_config_names_the_key(name):
    edit, message = MODEL_BAD[name]
    with pytest.raises(ConfigError) as err:
        check(model_cfg(edit))
    assert message in str(err.value)
    assert len(str(err.value).splitlines()) == 2, "one problem, one line (after the header)"


def test_unknown_keys_are_all_named_at_once():
    with pytest.raises(ConfigError) as err:
        check(model_cfg(lambda c: (rename("num_experts", "num_expert")(c), c.update(hiden_size=64))))
    assert "model.config.num_expert:" in str(err.value) and "model.config.hiden_size:" in str(err.value)
    assert "required key is missing" not in str(err.value)  # the typos say what is missing


def test_known_key_this_runtime_ignores_warns():
    with pytest.warns(UserWarning, match=r"model.config.hidden_act: 'gelu' has no effect; this runtime does not "
                                         r"read it and trains as transformers' default \('silu'\)"):
        check(model_cfg(lambda c: c.update(hidden_act="gelu")))
    with pytest.warns(UserWarning, match="reads model.router_aux_loss_coef instead"):
        check(model_cfg(lambda c: c.update(router_aux_loss_coef=0.1)))


def test_load_config_checks_the_model_config(tmp_path):
    raw = model_cfg(rename("num_experts", "num_expert"))
    raw["data"].update(path=str(EXAMPLE.parent / raw["data"]["path"]), tokenizer=str(TOKENIZER))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=rf"invalid config {path}:\n  model.config.num_expert: unknown key"):
        load_config(path)


@pytest.mark.parametrize("files", [[], ["tokenizer_config.json"], ["chat_template.jinja"]])
def test_empty_or_incomplete_tokenizer_folder(tmp_path, files):
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in files:
        (folder / name).write_bytes((TOKENIZER / name).read_bytes())
    raw = with_(lambda r: r["data"].update(tokenizer=str(folder)))
    expected = "is empty" if not files else "holds no loadable tokenizer"
    with pytest.raises(ConfigError, match=rf"data.tokenizer: tokenizer folder {folder} {expected}.*point data.tokenizer"):
        check(raw)


def _checkpoint_folder(tmp_path, hf: dict):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return with_(lambda r: r.update(model={"path": str(folder)}))


def test_model_path_config_json_is_checked(tmp_path):
    hf = {**base()["model"]["config"], "num_experts_per_tok": 9}
    raw = _checkpoint_folder(tmp_path, hf)
    with pytest.raises(ConfigError, match=rf"{tmp_path}/hf/config.json num_experts_per_tok: top-k \(9\) must be <="):
        check(raw)


def test_model_path_vocab_smaller_than_tokenizer(tmp_path):
    raw = _checkpoint_folder(tmp_path, {**base()["model"]["config"], "vocab_size": 320})
    with pytest.raises(ConfigError, match=r"config.json vocab_size: 320 is smaller than the tokenizer's 512 tokens"):
        check(raw)


def test_model_path_config_json_keeps_keys_of_older_transformers(tmp_path):
    # Published checkpoints carry keys transformers no longer takes (max_window_layers for Qwen3-MoE).
    raw = _checkpoint_folder(tmp_path, {**base()["model"]["config"], "max_window_layers": 48, "torch_dtype": "bfloat16"})
    assert check(raw).model.path == str(tmp_path / "hf")


def test_model_path_without_config_json(tmp_path):
    raw = with_(lambda r: r.update(model={"path": str(tmp_path)}))
    with pytest.raises(ConfigError, match=rf"model.path: {tmp_path} has no config.json"):
        check(raw)


@pytest.mark.parametrize("kind", ["moe", "dense", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_vl"])
def test_checkpoints_written_by_transformers_validate(tmp_path, kind):
    """The test fixtures' models, as model.path and pasted into model.config."""
    write_hf_checkpoint(tmp_path / "hf", kind, vocab_size=520)
    assert check(with_(lambda r: r.update(model={"path": str(tmp_path / "hf")}))).model.path
    pasted = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert check(with_(lambda r: r["model"].update(config=pasted))).model.config == pasted


@pytest.mark.parametrize("model_config", [
    {**TINY_MOE, "model_type": "qwen3_moe"}, {**TINY_DENSE, "model_type": "qwen3"}, hybrid("qwen3_next"),
    hybrid("qwen3_5_text"), hybrid("qwen3_5_moe_text"),
    {"model_type": "qwen3_5_moe", "text_config": hybrid("qwen3_5_moe_text")}], ids=lambda c: c["model_type"])
def test_fixture_configs_validate_as_model_config(model_config):
    # The model config alone: TINY_* have 320 tokens, fewer than the bundled tokenizer's 512.
    assert model_config_problems(model_config, None, None, "data.tokenizer") == []


@pytest.mark.parametrize("path", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_validates(path):
    load_config(path)


def test_gdn_state_passing_accepts_both_op_sets():
    # both GDN op sets take an initial state (gdr_fwd/gdr_bwd with initial_state / dh0): neither is refused
    for op_set in ("torch", "fla"):
        cfg = config_from_dict(with_(lambda r, o=op_set: (r["model"].update(gdn_op_set=o), r.setdefault(
            "parallelism", {}).update(cp=2, cp_gdn="state"))))
        assert cfg.model.gdn_op_set == op_set and cfg.parallelism.cp_gdn == "state"
