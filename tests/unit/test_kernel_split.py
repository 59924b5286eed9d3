"""benchmarks/kernel_split.py: kernel classes, forward / backward by the launching thread (runtime and driver
launches alike), GPU busy time with overlapping streams counted once, on a chrome trace written as torch.profiler
writes one (the events the split reads)."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import kernel_split

MAIN, AUTOGRAD = 11, 22


def _trace(tmp_path):
    events, corr = [], 0

    def kernel(name, ts, dur, tid, api="cuda_runtime", stream=7):
        nonlocal corr
        corr += 1
        events.append({"ph": "X", "cat": api, "name": "cudaLaunchKernel", "ts": ts - 5, "dur": 3, "tid": tid,
                       "args": {"correlation": corr}})
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream,
                       "args": {"correlation": corr, "stream": stream}})

    kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 100, 400, MAIN)            # q/k/v/o GEMM, fwd
    kernel("void pytorch_flash::flash_fwd_kernel<...>", 500, 300, MAIN)                  # attention, fwd
    kernel("_grouped_linear_kernel", 800, 1000, MAIN, api="cuda_driver")                 # experts (Triton), fwd
    kernel("_grouped_linear_kernel", 2000, 2000, AUTOGRAD, api="cuda_driver")            # experts, bwd
    kernel("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 4000, 600, AUTOGRAD)
    kernel("ncclDevKernel_AllGather_RING_LL", 4100, 200, AUTOGRAD, stream=20)            # overlaps the one above
    kernel("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 5000, 100, MAIN)
    events.append({"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 5200, "dur": 10, "tid": 7,
                   "args": {}})
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_classes_phases_and_busy_time(tmp_path):
    by_class, by_name, busy = kernel_split.split(kernel_split.load(_trace(tmp_path)), steps=2)
    experts = "experts (grouped GEMMs, their LoRA, SwiGLU)"
    assert by_class[(experts, "fwd")] == pytest.approx(0.5) and by_class[(experts, "bwd")] == pytest.approx(1.0)
    assert by_class[("attention core", "fwd")] == pytest.approx(0.15)
    assert by_class[("attention core", "bwd")] == pytest.approx(0.3)
    assert by_class[("dense GEMMs (projections, router, LoRA, lm_head)", "fwd")] == pytest.approx(0.2)
    assert by_class[("optimizer (AdamW, grad clip)", "fwd")] == pytest.approx(0.05)
    assert by_class[("communication (NCCL)", "bwd")] == pytest.approx(0.1)
    # a kernel with no launch event (the memset) counts with the main thread
    assert by_class[("copies, casts, elementwise", "fwd")] == pytest.approx(0.005)
    assert by_name["_grouped_linear_kernel"] == pytest.approx(1.5)
    # 100..1800 and 2000..4600 (the NCCL kernel inside the second), 5000..5100, 5200..5210: 4.41 ms over 2 steps
    assert busy == pytest.approx(4.41 / 2)


def test_table_sums_each_run(tmp_path):
    path = _trace(tmp_path)
    run = kernel_split.split(kernel_split.load(path), steps=1)
    text = kernel_split.table({"a": run, "b": run})
    assert text.splitlines()[0].startswith("| kernel class | a fwd | a bwd | a total | b fwd")
    last = text.splitlines()[-1]
    assert last.count("1.81 | 2.80 | **4.61** (busy 4.41)") == 2  # fwd 0.4+0.3+1+0.1+0.01, bwd 2+0.6+0.2


@pytest.mark.parametrize("name", ["chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_local_cumsum_scalar_kernel",
                                  "chunk_scaled_dot_kkt_fwd_kernel", "merge_16x16_to_64x64_inverse_kernel",
                                  "recompute_w_u_fwd_kernel", "causal_conv1d_bwd_kernel", "l2norm_fwd_kernel"])
def test_fla_kernels_are_gdn_not_routing_or_norm(name):
    assert kernel_split.classify(name) == "GDN (delta rule, conv, l2norm)"


def test_the_loss_and_routing_keep_their_kernels():
    assert kernel_split.classify("_chunked_ce_fwd_kernel").startswith("loss")
    assert kernel_split.classify("void at::native::cumsum_kernel").startswith("routing")

