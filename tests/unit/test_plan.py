"""runtime.plan: every `auto` resolved once to a concrete name, every cross-check one ConfigError line naming
the key, the reason and the fix, before any process group; layers built from the plan never see "auto"."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runtime.choices import MODEL_CHOICES, resolve_model_choices
from runtime.config import ConfigError, config_from_dict
from runtime.plan import check_context_parallel, plan
from tests.conftest import TINY_HYBRID, Ahead, lane_environ

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"


def raw(edit=None, hybrid: bool = False) -> dict:
    r = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    if hybrid:
        r["model"]["config"] = {**TINY_HYBRID, "model_type": "qwen3_5_moe_text",
                                "layer_types": ["linear_attention", "full_attention"] * 2, "vocab_size": 512}
    if edit:
        edit(r)
    return r


def cfg_of(edit=None, hybrid: bool = False):
    return config_from_dict(raw(edit, hybrid), base_dir=EXAMPLE.parent)


def set_(section: str, **values):
    return lambda r: r.setdefault(section, {}).update(values)


@pytest.mark.parametrize("hybrid", [False, True], ids=["moe", "hybrid"])
def test_every_auto_is_resolved_on_cpu(hybrid):
    cfg = cfg_of(lambda r: r["model"].update(dict.fromkeys(MODEL_CHOICES, "auto")), hybrid=hybrid)
    p = plan(cfg, 1, "cpu")
    resolved = p.resolved()
    assert "auto" not in {v for v in resolved.values() if isinstance(v, str)}
    assert resolved["model.expert_backend"] == "grouped_mm" and resolved["model.attn_backend"] == "sdpa"
    assert resolved["model.norm_rope_impl"] == "torch" and resolved["model.loss_impl"] == "chunked"
    assert resolved["model.gdn_op_set"] == "torch"
    assert resolved["parallelism.fsdp_param_dtype"] == "bf16"
    assert p.user_config.model.expert_backend == "auto"  # what the user wrote stays as written


def test_fsdp_gather_dtype_auto_follows_ep():
    p = plan(cfg_of(set_("parallelism", ep=2)), 2, "cpu")
    assert p.config.parallelism.fsdp_param_dtype == "fp32" and p.dims.ep == 2


def test_dispatcher_auto_gathers_for_lora_on_cuda_where_the_estimate_fits():
    """auto: all_gather for LoRA on CUDA at 1 < ep <= 4 when runtime.estimate's peak with it (its bound grown
    twice) fits 90% of the device; all_to_all for a full fine-tune, past ep 4, on the CPU, or where it would not
    fit."""
    from runtime.estimate import estimate

    def pick(world, device="cuda", memory=None, lora=True, ep=None):
        cfg = cfg_of(lambda r: (r.setdefault("parallelism", {}).update(ep=ep or world, dispatcher="auto"),
                                r.setdefault("lora", {}).update(enabled=lora)))
        return plan(cfg, world, device, device_memory=memory).config.parallelism.dispatcher

    lora_ep2 = cfg_of(lambda r: (r.setdefault("parallelism", {}).update(ep=2, dispatcher="all_gather",
                                                                       gather_capacity=1.25 * 1.5 ** 2),
                                 r.setdefault("lora", {}).update(enabled=True)))  # the bound grown twice
    peak = estimate(lora_ep2, plan(lora_ep2, 2, "cuda", device_memory=2**40).dims, cuda=True,
                    device_memory_bytes=2**40).peak
    assert pick(2, memory=int(peak / 0.9) + 1) == "all_gather"
    assert pick(2, memory=int(peak / 0.9) - 2**20) == "all_to_all"  # it would not fit
    assert pick(2, memory=2**40, lora=False) == "all_to_all"
    assert pick(8, memory=2**40) == "all_to_all"
    assert pick(2, device="cpu") == "all_to_all"
    assert pick(1, memory=2**40) == "all_to_all"  # the identity at ep 1 either way


def test_compile_auto_compiles_lora_on_one_cuda_device_or_at_ep_world_on_all_gather():
    """compile.enabled auto (the default): true for LoRA without FP8 training on one CUDA device or at ep = world
    on the all_gather dispatcher; false for a full fine-tune, data parallelism, all_to_all or the CPU; true and
    false as written; the plan's config holds a bool."""
    def compiled(world=1, device="cuda", lora=True, ep=1, dispatcher="auto", memory=2**40, **compile_section):
        cfg = cfg_of(lambda r: (r.setdefault("parallelism", {}).update(ep=ep, dispatcher=dispatcher),
                                r.setdefault("lora", {}).update(enabled=lora), r.update(compile=compile_section)))
        p = plan(cfg, world, device, device_memory=memory)
        assert p.resolved()["compile.enabled"] is p.config.compile.enabled
        return p.config.compile.enabled

    assert cfg_of().compile.enabled == "auto"
    assert compiled() is True
    assert compiled(lora=False) is False
    assert compiled(world=2, ep=2) is True  # auto's dispatcher there: all_gather
    assert compiled(world=2, ep=2, dispatcher="all_to_all") is False
    assert compiled(world=2, ep=2, memory=2**20) is False  # all_gather would not fit: all_to_all, eager
    assert compiled(world=2, ep=2, lora=False) is False
    assert compiled(world=4, ep=2) is False  # dp_shard 4 over ep 2: FSDP units, unmeasured compiled
    assert compiled(world=2) is False
    assert compiled(device="cpu") is False
    assert compiled(enabled=False) is False
    assert compiled(lora=False, enabled=True) is True
    assert compiled(enabled="auto", inductor_options={"max_autotune": True}) is True


def test_compile_auto_runs_eager_where_a_named_implementation_cannot_compile():
    """auto with an implementation that does not compile (eager on FP4 experts) resolves to false; an explicit
    true is the one-line error."""
    def fp4_eager(**compile_section):
        return cfg_of(lambda r: (r["model"].update(expert_backend="eager", dtype="bfloat16"),
                                 r.update(quant={"base_weights": "nvfp4"}, lora={"enabled": True},
                                          compile=compile_section)))

    p = plan(fp4_eager(), 1, "cuda")
    assert p.config.compile.enabled is False and p.config.model.expert_backend == "eager"
    with pytest.raises(ConfigError, match="^model.expert_backend: eager runs nvfp4 experts .* in eager mode only"):
        plan(fp4_eager(enabled=True), 1, "cuda")


def test_fp8_training_runs_eager():
    """No backend compiles FP8 training: compile auto resolves to false and plans; an explicit true is refused,
    naming the setting."""
    def fp8(**compile_section):
        return cfg_of(lambda r: (r["model"].update(dtype="bfloat16"),
                                 r.update(quant={"train_fp8": "experts"}, compile=compile_section)))

    for device in ("cpu", "cuda"):
        assert plan(fp8(), 1, device).config.compile.enabled is False
        with pytest.raises(ConfigError, match=r"in eager mode only, but compile.enabled is true"):
            plan(fp8(enabled=True), 1, device)


def test_frozen_dense_auto_is_resolved_on_the_models_real_bytes():
    """plan weighs the meta model's frozen dense bytes: at a device memory of exactly 8x the bytes the real
    model (build_model, as train builds it) holds, auto replicates; one byte less, it shards."""
    import torch

    from runtime.distributed.fsdp import frozen_dense_bytes
    from runtime.distributed.mesh import ParallelDims
    from runtime.distributed.process_group import DistEnv
    from runtime.models.factory import build_model

    cfg = cfg_of(set_("lora", enabled=True))
    model = build_model(cfg, DistEnv(0, 1, 0, torch.device("cpu")), ParallelDims.resolve(1, -1, 1, 1, 1))
    real = frozen_dense_bytes(model)
    assert real > 0
    placed = {mem: plan(cfg, 1, "cpu", device_memory=mem).config.parallelism.frozen_dense
              for mem in (8 * real, 8 * real - 1)}
    assert placed == {8 * real: "replicate", 8 * real - 1: "shard"}
    assert plan(cfg, 1, "cpu", device_memory=8 * real).resolved()["parallelism.frozen_dense"] == "replicate"


@pytest.mark.parametrize("setting,lora,expected", [("auto", False, "shard"), ("shard", True, "shard"),
                                                   ("replicate", True, "replicate")])
def test_frozen_dense_as_written_or_shard_for_a_full_fine_tune(setting, lora, expected):
    cfg = cfg_of(lambda r: (r.setdefault("lora", {}).update(enabled=lora),
                            r.setdefault("parallelism", {}).update(frozen_dense=setting)))
    assert plan(cfg, 1, "cpu").config.parallelism.frozen_dense == expected


def test_frozen_dense_replicate_needs_lora():
    with pytest.raises(ConfigError, match="parallelism.frozen_dense: replicate needs lora.enabled"):
        plan(cfg_of(set_("parallelism", frozen_dense="replicate")), 1, "cpu")


def test_resolved_yaml_beside_the_config(tmp_path):
    p = plan(cfg_of(), 1, "cpu")
    written = yaml.safe_load(p.write(tmp_path).read_text())["resolved"]
    assert written["model.expert_backend"] == "grouped_mm" and written["mesh"]["ep"] == 1


def test_layers_built_from_the_plan_never_see_auto():
    from runtime.models.hf import model_config

    p = plan(cfg_of(hybrid=True), 1, "cpu")
    from runtime.models.qwen import QwenForCausalLM

    model = QwenForCausalLM(model_config(p.config))
    seen = [(name, attr, getattr(m, attr)) for name, m in model.named_modules()
            for attr in ("backend", "norm_rope_impl", "op_set") if isinstance(getattr(m, attr, None), str)]
    assert {attr for _, attr, _ in seen} == {"backend", "norm_rope_impl", "op_set"}
    assert not [s for s in seen if s[2] == "auto"], seen
    assert all(getattr(model.config, f) != "auto" for f in MODEL_CHOICES)


def test_direct_models_resolve_auto_at_construction():
    from runtime.models.qwen import QwenConfig

    cfg = resolve_model_choices(QwenConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                                           head_dim=8, intermediate_size=8), "cpu")
    assert {f: getattr(cfg, f) for f in MODEL_CHOICES} == {
        "expert_backend": "grouped_mm", "attn_backend": "sdpa", "norm_rope_impl": "torch", "loss_impl": "chunked",
        "gdn_op_set": "torch"}


CHECKS = {
    # new-user cases: a choice this machine cannot run is one line at plan time
    "sonicmoe on cpu": (set_("model", expert_backend="sonicmoe"),
                        "model.expert_backend: sonicmoe cannot run here: it runs on cuda only"),
    "fp4 block": (lambda r: (r["model"]["config"].update(moe_intermediate_size=48),
                             r.update(quant={"base_weights": "mxfp4"}, lora={"enabled": True})),
                  ("quant.base_weights: mxfp4 packs blocks of 32 along each expert weight's input dim, which does not "
                   "divide model.config.moe_intermediate_size = 48; use quant.base_weights: nvfp4")),
    "flash on cpu": (set_("model", attn_backend="flash"), "model.attn_backend: flash cannot run here"),
    "fla on cpu": (set_("model", gdn_op_set="fla"), "model.gdn_op_set: fla cannot run here: it runs on cuda only"),
    # moved from config.py and moe/dispatch
    "local dispatcher with ep": (set_("parallelism", dispatcher="local", ep=2),
                                 ("parallelism.dispatcher: local keeps every expert on every rank, but "
                                  "parallelism.ep is 2; choose one of ['all_gather', 'all_to_all']")),
    "deepep not built": (set_("parallelism", dispatcher="deepep"), "parallelism.dispatcher: deepep cannot run here"),
    # moved from distributed/compile.py check_compilable
    "grouped_mm compile fp32 cpu": (set_("compile", enabled=True),
                                    ("model.expert_backend: grouped_mm compiles on the CPU only in model.dtype "
                                     "bfloat16 (model.dtype is float32), but compile.enabled is true; choose one of")),
    "eager compiles fp4 never": (lambda r: (r["model"].update(expert_backend="eager", dtype="bfloat16"),
                                            r.update(quant={"base_weights": "nvfp4"}, lora={"enabled": True},
                                                     compile={"enabled": True})),
                                 ("model.expert_backend: eager runs nvfp4 experts (quant.base_weights: nvfp4) in "
                                  "eager mode only")),
}


@pytest.mark.parametrize("case", list(CHECKS))
def test_each_cross_check_is_one_line(case):
    edit, message = CHECKS[case]
    world = 2 if "ep" in case else 1
    with pytest.raises(ConfigError) as err:
        plan(cfg_of(edit), world, "cpu")
    text = str(err.value)
    assert "\n" not in text and message in text, text


# One fresh Python, outside the tests' interpreter, for two tests: first `import runtime.config` alone (then the
# kernel modules loaded, one per line, on stdout), then the FP4 + LoRA --set list through runtime.plan, which the
# command calls first, then the other through the command itself.
_FRESH_PROCESS = """
import sys
from runtime.config import ConfigError, load_config
print("\\n".join(sorted(m for m in sys.modules if m == "triton" or m.startswith(("triton.", "moe.kernels",
                                                                                 "attention.kernels")))))
print("--", flush=True)
from runtime.plan import plan
try:
    plan(load_config(sys.argv[1], dict(item.split("=", 1) for item in sys.argv[2].split(","))), 1, "cpu")
except ConfigError as err:
    print(f"error: {err}", flush=True)
from runtime.launch import main
main(sys.argv[3:])
"""
SCATTERMOE_ON_CPU = ("error: model.expert_backend: scattermoe cannot run here: it runs on cuda only, and "
                     "this machine has cpu; choose one of ['eager', 'grouped_mm'] (or auto)")


def _fresh_process(tmp: Path):
    """(the run of _FRESH_PROCESS, the command's output dir)."""
    out = tmp / "run"
    env = {k: v for k, v in lane_environ().items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-c", _FRESH_PROCESS, str(EXAMPLE),
            "model.expert_backend=scattermoe,quant.base_weights=mxfp4,lora.enabled=true",
            str(EXAMPLE), "--output-dir", str(out), "--set", "model.expert_backend=scattermoe"]
    done = subprocess.run(argv, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=300, check=False)
    return done, out


FRESH_PROCESS = Ahead(_fresh_process)  # CI time: a Python start, beside the in-process tests


@pytest.mark.ahead(FRESH_PROCESS)
def test_scattermoe_on_a_cpu_machine_is_one_line_before_any_step():
    """Outside the tests' Triton interpreter a CPU machine cannot run the Triton backend: the launch says so at
    plan time (it used to die at step 1 in gpu/launch.py as an internal error), with FP4 experts and LoRA
    too."""
    done, out = FRESH_PROCESS.result()
    assert done.returncode != 0
    assert done.stdout.split("--\n", 1)[1].strip() == SCATTERMOE_ON_CPU, done.stdout  # plan, FP4 + LoRA
    assert done.stderr.strip().splitlines()[-1] == SCATTERMOE_ON_CPU  # the command
    assert not out.exists()  # nothing ran


def test_sonicmoe_is_refused_eager_only_under_compile_on_cuda_terms():
    """Capabilities, not names: sonicmoe declares compile=False."""
    from moe.backends import EXPERT_BACKENDS

    assert EXPERT_BACKENDS.capabilities("sonicmoe").compile is False
    assert "mxfp4" in EXPERT_BACKENDS.capabilities("scattermoe").compile_quantized
    assert "fp8" in EXPERT_BACKENDS.capabilities("scattermoe").quantized_base


def test_fp8_experts_take_scattermoe_on_cuda_terms_and_grouped_mm_on_cpu():
    """scattermoe declares FP8 bases (compiled too): auto takes it on CUDA, grouped_mm (eager only: compiled, its
    FP8 GEMM's output came out zero on an H200) on the CPU."""
    from runtime.choices import Needs, choose

    uses = {"compile", "quantized", "lora", "ep"}
    for device, expected, compiled in (("cuda", "scattermoe", True), ("cpu", "grouped_mm", False)):
        needs = Needs(device, compile=compiled, quantized="fp8", lora=True, dtype="bfloat16")
        name, passed = choose("model.expert_backend", "auto", needs, uses)
        assert name == expected and passed == [], device
    with pytest.raises(ConfigError, match="grouped_mm runs fp8 experts .* in eager mode only"):
        choose("model.expert_backend", "grouped_mm", Needs("cuda", compile=True, quantized="fp8", lora=True,
                                                           dtype="bfloat16"), uses)
    # A plan for CUDA made on this GPU-less machine (runtime.estimate's case) resolves it the same way.
    cfg = config_from_dict(yaml.safe_load(EXAMPLE.read_text()), {"lora.enabled": True, "quant.base_weights": "fp8",
                                                               "model.expert_backend": "auto"})
    assert plan(cfg, world=1, device="cuda").config.model.expert_backend == "scattermoe"


def test_fp8_training_takes_scattermoe_on_cuda_and_grouped_mm_on_the_cpu():
    """Both FP8-training backends declare it in eager mode only (compile_train_fp8=False): auto takes scattermoe on
    CUDA, grouped_mm on the CPU; naming either under compile is refused."""
    from runtime.choices import Needs, choose

    uses = {"compile", "quantized", "lora", "ep"}
    for device, expected in (("cuda", "scattermoe"), ("cpu", "grouped_mm")):
        needs = Needs(device, compile=False, train_fp8=True, dtype="bfloat16")
        assert choose("model.expert_backend", "auto", needs, uses)[0] == expected, device
    for name in ("scattermoe", "grouped_mm"):
        with pytest.raises(ConfigError, match=f"model.expert_backend: {name} trains its experts in FP8 "
                                              r"\(quant.train_fp8\) in eager mode only, but compile.enabled is true"):
            choose("model.expert_backend", name, Needs("cuda", compile=True, train_fp8=True, dtype="bfloat16"),
                   uses)
    cfg = config_from_dict(yaml.safe_load(EXAMPLE.read_text()), {"quant.train_fp8": "experts",
                                                               "model.expert_backend": "auto"})
    assert plan(cfg, world=1, device="cuda").config.model.expert_backend == "scattermoe"


CP = {
    "ulysses heads": ({"cp": 8, "cp_attention": "ulysses"}, None, "parallelism.cp_attention: ulysses splits the 4"),
    "gdn heads": ({"cp": 4}, None, "parallelism.cp=4: Gated DeltaNet layers run head-parallel"),
    "gdn state tail": ({"cp": 4, "cp_gdn": "state"}, lambda r: r["data"].update(seq_len=16),
                       "parallelism.cp_gdn: state reads conv tails"),
}


@pytest.mark.parametrize("case", list(CP))
def test_context_parallel_checks(case):
    parallelism, edit, message = CP[case]
    cfg = cfg_of(lambda r: (r.update(parallelism=parallelism), edit and edit(r)), hybrid=True)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        plan(cfg, parallelism["cp"], "cpu")
    from runtime.models.hf import model_config

    with pytest.raises(ConfigError):
        check_context_parallel(cfg, model_config(cfg))


@pytest.mark.ahead(FRESH_PROCESS)
def test_import_runtime_config_loads_no_kernel():
    done, _ = FRESH_PROCESS.result()
    assert "--\n" in done.stdout, done.stderr[-3000:]
    assert done.stdout.split("--\n", 1)[0].strip() == "", done.stdout  # no kernel module after the import


def test_graph_step_is_refused_where_a_graph_cannot_hold_the_step():
    """train.graph_step: CUDA only, no cp, no GDN layers, fused AdamW (fp32 masters), no FSDP unit on several GPUs
    (a full fine-tune, frozen_dense shard, experts sharing their mesh); each refusal names the key and the reason
    before any model is built."""
    def refusal(world=1, device="cuda", hybrid=False, **edits) -> str | None:
        def edit(r):
            r.setdefault("train", {})["graph_step"] = True
            for section, values in edits.items():
                r.setdefault(section, {}).update(values)
        try:
            plan(cfg_of(edit, hybrid=hybrid), world, device, device_memory=2**40)
        except ConfigError as err:
            return str(err)
        return None

    assert refusal(lora={"enabled": True}) is None
    assert refusal(world=2, lora={"enabled": True}, parallelism={"ep": 2}, model={"dtype": "bfloat16"}) is None
    assert "FSDP units" in refusal(world=2, lora={"enabled": True}, parallelism={"ep": 2})  # tiny's fp32 base
    assert "replays CUDA graphs" in refusal(device="cpu")
    assert "context parallelism" in refusal(world=2, parallelism={"cp": 2})
    assert "GDN" in refusal(hybrid=True)
    assert "fused AdamW" in refusal(optim={"master_dtype": "bf16"})
    assert "FSDP units" in refusal(world=2, parallelism={"ep": 2})
    assert "FSDP units" in refusal(world=2, lora={"enabled": True}, parallelism={"ep": 2, "frozen_dense": "shard"})
    assert "FSDP units" in refusal(world=4, lora={"enabled": True}, parallelism={"ep": 2})
    assert "all_gather" in refusal(world=2, lora={"enabled": True}, model={"dtype": "bfloat16"},
                                   parallelism={"ep": 2, "dispatcher": "all_to_all"})
