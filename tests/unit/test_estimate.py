"""runtime.estimate's activation count against the bytes a tiny model keeps for backward on the CPU.

The model runs the CUDA path's kernels: the Triton q/k norm+RoPE and scattermoe under the interpreter,
and two stand-ins that keep exactly what the CUDA-only ops keep: cuDNN attention (kv heads repeated; CPU
flash attention keeps the same q, k, v, output and log-sum-exp) and FLA's Gated DeltaNet ops (opaque
custom ops whose residuals have the shapes attention/gdn_ops_fla.py declares, computed by the torch op
set). Under CPU bf16 autocast the dtypes are those of a CUDA run: fp32 masters and an fp32 stream for a
full fine-tune, a bf16 base with fp32 adapters for LoRA.

Measured: every storage an op creates during forward that is still alive once only the loss is referenced
(the saved tensors, checkpointing's inputs and cache, what autograd nodes hold on ctx), parameters
excluded; casts of parameters are the weight copies, the rest the activations (with lm_head's gradient,
which the chunked loss computes in forward).
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if not torch.cuda.is_available():  # before the first triton import: the kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import attention.attention as attn
from attention import gdn_ops_torch
from attention.attention import repeat_kv_heads
from attention.gdn import GatedDeltaNet
from moe.kernels import tuning
from runtime.config import config_from_dict
from runtime.distributed.mesh import ParallelDims
from runtime.distributed.parallelize import parallelize
from runtime.distributed.process_group import DistEnv
from runtime.estimate import (
    FLA_CHUNK,
    MODES,
    activation_bytes_per_token,
    run_of,
    weight_copies,
)
from runtime.launch import main
from runtime.models.factory import build_model
from runtime.optim import apply_master_dtype

if not tuning.INTERPRET:
    pytest.skip("the model runs its Triton kernels on CPU tensors, in the interpreter only", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
# Not per token, so not counted: the (1 + w) of every unit-offset norm, scattermoe's expert offsets, ...
PER_LAYER = 4096
B, S = 2, 64  # tokens per forward: 128
BASE = {"vocab_size": 1024, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
KINDS = {
    "qwen3-moe": {**BASE, "model_type": "qwen3_moe", "num_hidden_layers": 2, "intermediate_size": 128,
                  "norm_topk_prob": True},
    # 3 Gated DeltaNet : 1 gated attention, a shared expert, partial RoPE: Qwen3.5-35B-A3B's structure
    "qwen3.5-moe": {**BASE, "model_type": "qwen3_5_moe_text", "num_hidden_layers": 4,
                    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "shared_expert_intermediate_size": 48,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25},
}
# name: (config, on CUDA). On CUDA a run keeps its values as runtime.optim says, emulated here by CPU bf16
# autocast over those parameters; off CUDA every value keeps its parameter's dtype.
TRAININGS = {
    "full-fp32-masters": ({"model": {"dtype": "bfloat16"}}, True),
    "lora-bf16-base": ({"model": {"dtype": "bfloat16"}, "lora": {"enabled": True, "rank": 4, "alpha": 8}}, True),
    "cpu-fp32": ({"model": {"dtype": "float32"}}, False),
}


def tiny_config(kind: str, training: str, mode: str):
    extra, _ = TRAININGS[training]
    raw = {"model": {"config": KINDS[kind], "expert_backend": "scattermoe", "attn_backend": "flash",
                     "norm_rope_impl": "triton", "gdn_op_set": "torch", **extra["model"]},
           "data": {"path": str(ROOT / "examples/tiny/data/train.jsonl"),
                    "tokenizer": str(ROOT / "examples/tiny/tokenizer"), "seq_len": S},
           "lora": extra.get("lora", {"enabled": False}),
           "parallelism": {"activation_checkpoint": mode},
           "train": {"micro_batch_size": B}}
    return config_from_dict(raw)


# ----------------------------------------------------------------------------- the CUDA-only ops' stand-ins


class _CudnnLikeAttention(torch.autograd.Function):
    """cuDNN's fused causal attention, forward only, by CPU flash attention on repeated kv heads (temporaries):
    it keeps what cuDNN keeps for backward, q, k and v (kv heads as they are), the output and its log-sum-exp."""

    @staticmethod
    def forward(ctx, q_BHSD, k_BKSD, v_BKSD, scale):
        n_rep = q_BHSD.shape[1] // k_BKSD.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_BHSD, repeat_kv_heads(k_BKSD, n_rep), repeat_kv_heads(v_BKSD, n_rep), 0.0, True, scale=scale)[:2]
        ctx.save_for_backward(q_BHSD, k_BKSD, v_BKSD, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("the stand-in only reproduces what forward keeps")


def cudnn_like_attention(q_BSHD, k_BSKD, v_BSKD, scale):
    """attention.attention.cudnn_causal_attention on the stand-in kernel above."""
    return _CudnnLikeAttention.apply(*(t.transpose(1, 2) for t in (q_BSHD, k_BSKD, v_BSKD)), scale).transpose(1, 2)


@torch.library.custom_op("estimate_test::conv_fwd", mutates_args=())
def _conv_fwd(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    docs = gdn_ops_torch.prepare_docs(cu_seqlens, x.shape[0], x.shape[1], x.device)
    return gdn_ops_torch.causal_conv1d_silu(x, weight, docs)


@torch.library.custom_op("estimate_test::gdr_fwd", mutates_args=())
def _gdr_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor, torch.Tensor, torch.Tensor]:
    """FLA's outputs: o and the residuals of its backward (normalized q/k, 1/norms, g's cumsum, A)."""
    B_, T, HV, _ = v.shape
    docs = gdn_ops_torch.prepare_docs(cu_seqlens, B_, T, q.device)
    o = gdn_ops_torch.chunk_gated_delta_rule(q, k, v, g, beta, docs).contiguous()  # FLA's o is contiguous
    rstd = (q.float().square().sum(-1) + 1e-6).rsqrt(), (k.float().square().sum(-1) + 1e-6).rsqrt()
    return (o, q * rstd[0].unsqueeze(-1).to(q.dtype), rstd[0], k * rstd[1].unsqueeze(-1).to(k.dtype), rstd[1],
            g.float().cumsum(1), k.new_zeros(B_, T, HV, FLA_CHUNK))


def _keep(saved_indices):
    """setup_context saving what the FLA op saves: inputs and outputs picked by (source, index)."""
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*[(inputs if src == "in" else output)[i] for src, i in saved_indices])
    return setup


def _forward_only(ctx, *grads):
    raise NotImplementedError("the stand-in only reproduces what forward keeps")


_conv_fwd.register_autograd(_forward_only, setup_context=_keep([("in", 0), ("in", 1), ("in", 2)]))
# gdn_ops_fla._gdr_setup: q_n, q_rstd, k_n, k_rstd, v, g_cum, beta, A, cu_seqlens
_gdr_fwd.register_autograd(_forward_only, setup_context=_keep(
    [("out", 1), ("out", 2), ("out", 3), ("out", 4), ("in", 2), ("out", 5), ("in", 4), ("out", 6), ("in", 5)]))


class FlaLikeOps:
    """The op-set contract of attention/gdn.py, on the stand-in ops."""

    @staticmethod
    def prepare_docs(cu_seqlens, batch, seq, device):
        return cu_seqlens

    @staticmethod
    def causal_conv1d_silu(x_BSD, weight_DW, cu_seqlens):
        return _conv_fwd(x_BSD, weight_DW, cu_seqlens)

    @staticmethod
    def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens):
        return _gdr_fwd(q, k, v, g, beta, cu_seqlens)[0]


@pytest.fixture
def cuda_kernels(monkeypatch):
    """Attention takes the cuDNN branch of the flash backend (rows of one document), on the stand-in."""
    monkeypatch.setattr(attn, "dense_causal", lambda: True)
    monkeypatch.setattr(attn, "_check_varlen_inputs", lambda q, dtype: None)
    monkeypatch.setattr(attn, "cudnn_causal_attention", cudnn_like_attention)


# ----------------------------------------------------------------------------- measuring


class RetainedStorages(TorchDispatchMode):
    """Records a weak reference to every storage an op outputs, and whether it is a cast of a parameter."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        weight_cast = func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.nn.Parameter)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.outputs.append((weakref.ref(storage), storage.data_ptr(), storage.nbytes(), weight_cast))
        return out

    def alive(self, exclude: set[int]) -> dict[bool, int]:
        """Bytes of the recorded storages still alive, by whether they are weight casts."""
        seen, total = set(exclude), {False: 0, True: 0}
        for ref, ptr, nbytes, weight_cast in self.outputs:
            if ref() is not None and ptr not in seen:
                seen.add(ptr)
                total[weight_cast] += nbytes
        return total


def build(kind: str, training: str, mode: str):
    cfg, cuda = tiny_config(kind, training, mode), TRAININGS[training][1]
    dims = ParallelDims(1, 1, 1, 1, 1)
    model = build_model(cfg, DistEnv(0, 1, 0, torch.device("cpu")), dims)
    if cuda:  # the CUDA run's masters
        apply_master_dtype(model, cfg.optim.master_dtype, torch.device("cuda"))
    parallelize(model, dims, None, cfg)
    for layer in model.modules():
        if isinstance(layer, GatedDeltaNet):
            layer.ops = FlaLikeOps
    return cfg, model, cuda


def kept_by_forward(model, cuda: bool) -> tuple[dict[bool, int], dict[bool, int]]:
    """What forward keeps, {False: activations (with lm_head's gradient), True: weight casts}, at the end of
    forward (autocast's weight cache still alive) and at the start of backward (autocast exited)."""
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, model.config.vocab_size, (B, S), generator=g) for _ in range(2))
    mode = RetainedStorages()
    exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), ids, labels)}
    with mode:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = model(ids, labels=labels)
            gc.collect()
            end_of_forward = mode.alive(exclude)
        gc.collect()
        start_of_backward = mode.alive(exclude)
    del loss
    return end_of_forward, start_of_backward


# Each model once per training and once per checkpointing mode, paired differently on the two (CI time: the
# training terms and the mode terms are separate sums of the estimate, so a pairing tests both of its halves).
CASES = ([("qwen3-moe", training, mode) for training, mode in zip(sorted(TRAININGS), MODES[1:] + MODES[:1])]
         + [("qwen3.5-moe", training, mode) for training, mode in zip(sorted(TRAININGS), MODES)])


@pytest.mark.slow
@pytest.mark.parametrize("kind,training,mode", CASES, ids=["-".join(case) for case in CASES])
def test_activations_are_what_forward_keeps(cuda_kernels, kind, training, mode):
    cfg, model, cuda = build(kind, training, mode)
    end_of_forward, start_of_backward = kept_by_forward(model, cuda)
    run = run_of(cfg, model.config, cuda)
    lm_head = model.lm_head.weight
    expected = B * S * activation_bytes_per_token(run, mode) + (
        run.p.master * lm_head.numel() if lm_head.requires_grad else 0)
    c = run.p.compute if run.p.master != run.p.compute else 0
    for kept, in_backward in ((end_of_forward, False), (start_of_backward, True)):
        assert abs(kept[False] - expected) <= PER_LAYER, (in_backward, kept[False], expected)
        assert kept[True] == c * weight_copies(model, mode, in_backward), in_backward


def test_cli_prints_the_estimate_before_any_process_group(capsys):
    assert main(["--estimate", "--world-size", "8", "--ep", "2", "--cp", "2",
                 str(ROOT / "examples/tiny-qwen3-moe.yaml")]) == 0
    out = capsys.readouterr().out
    assert "world 8 = dp_replicate 1 x dp_shard 4 x cp 2; ep 2, efsdp 4" in out and "peak (estimate)" in out
    assert not torch.distributed.is_initialized()


def test_fp32_gathers_count_fp32_units_and_cast_copies():
    """parallelism.fsdp_param_dtype fp32 under FSDP (full fine-tune, fp32 masters, CUDA): the gathered units in
    fp32 and autocast's bf16 weight copies, neither of which bf16 gathers have."""
    from runtime.estimate import estimate

    cfg = tiny_config("qwen3-moe", "full-fp32-masters", "none")

    def gathers(dtype: str, dims: ParallelDims):
        update = {"parallelism": cfg.parallelism.model_copy(update={"fsdp_param_dtype": dtype})}
        return estimate(cfg.model_copy(update=update), dims, cuda=True)

    fsdp, ep = ParallelDims(1, 4, 1, 1, 4), ParallelDims(1, 4, 1, 2, 4)
    assert gathers("auto", fsdp).peak == gathers("bf16", fsdp).peak  # auto: bf16 without EP, fp32 with
    assert gathers("auto", ep).peak == gathers("fp32", ep).peak > gathers("bf16", ep).peak
    bf16, fp32 = gathers("bf16", fsdp), gathers("fp32", fsdp)
    copies = "bf16 copies of fp32 weights"
    assert copies in fp32.end_of_forward and copies not in bf16.end_of_forward
    assert fp32.end_of_forward["FSDP gathered units"] == 2 * bf16.end_of_forward["FSDP gathered units"]
    # under EP the experts gather in their own bf16 units: no cast copy of theirs
    assert gathers("fp32", ep).end_of_forward[copies] < fp32.end_of_forward[copies]


def test_replicated_frozen_dense_weights_count_whole_on_every_rank():
    """parallelism.frozen_dense under LoRA: replicate holds the frozen dense weights whole on each of the 4 ranks
    (shard: a quarter) and gathers no block unit; auto replicates below its bound, shards above it."""
    from runtime.distributed.fsdp import frozen_dense_bytes
    from runtime.estimate import estimate
    from runtime.models.factory import meta_model

    cfg = tiny_config("qwen3-moe", "lora-bf16-base", "none")
    dims = ParallelDims(1, 4, 1, 2, 4)

    def placed(setting: str, memory: int | None = None):
        update = {"parallelism": cfg.parallelism.model_copy(update={"frozen_dense": setting})}
        return estimate(cfg.model_copy(update=update), dims, cuda=True, device_memory_bytes=memory)

    dense = frozen_dense_bytes(meta_model(cfg))
    replicate, shard = placed("replicate"), placed("shard")
    assert replicate.parameters - shard.parameters == pytest.approx(dense * 3 / 4, abs=4)
    units = "FSDP gathered units"
    assert replicate.end_of_forward[units] < shard.end_of_forward[units]
    assert placed("auto").parameters == replicate.parameters  # the CPU's cap: tiny weights replicate
    assert placed("auto", memory=8 * dense - 8).parameters == shard.parameters


def test_all_gather_dispatcher_counts_its_bound():
    """parallelism.dispatcher all_gather sizes scattermoe's per-slot buffers by its bound (gather_capacity x the
    valid slots of balanced routing; at most ep x, every gathered slot) and receives every rank's tokens: the
    48-layer LoRA at ep4 of benchmarks/configs/qwen3-30b-a3b-random.yaml, no checkpointing, against the peaks
    4x H200 measured in one call (2026-11-27, docs/benchmarks.md#multi-gpu-step): all_to_all 64.3 GiB, all_gather
    105.0 GiB when its buffers took every gathered slot (capacity 4 = ep). The default bound (1.25) costs a
    quarter of those buffers' slots. Those runs' packed rows took torch 2.11's varlen attention, which has no
    enable_gqa, so the kv heads it kept were repeated (attention.attention._torch_varlen_caller): 2 x (Hq - Hkv)
    x head_dim bf16 values per token and layer more than the cuDNN kernel of one-document rows, which the
    estimate counts. That excess comes off the measured peaks."""
    from runtime.config import load_config
    from runtime.estimate import estimate

    repeated_kv_gib = 48 * 2 * (32 - 4) * 128 * 8192 * 2 / 2**30

    def peak_gib(dispatcher: str, capacity: float = 1.25) -> float:
        cfg = load_config(ROOT / "benchmarks/configs/qwen3-30b-a3b-random.yaml", {
            "lora.enabled": True, "optim.master_dtype": "fp32", "parallelism.activation_checkpoint": "none",
            "parallelism.dispatcher": dispatcher, "parallelism.ep": 4, "parallelism.gather_capacity": capacity})
        return estimate(cfg, ParallelDims.resolve(1, -1, 1, 4, 4), cuda=True).peak / 2**30

    for dispatcher, capacity, measured in (("all_to_all", 1.25, 64.3), ("all_gather", 4.0, 105.0)):
        expected = measured - repeated_kv_gib
        assert abs(peak_gib(dispatcher, capacity) - expected) <= 0.03 * expected, (dispatcher, capacity)
    assert peak_gib("all_to_all") < peak_gib("all_gather") < peak_gib("all_gather", 4.0) - 25
    assert peak_gib("all_gather", 8.0) == peak_gib("all_gather", 4.0)  # never past every gathered slot
