#!/usr/bin/env bash
# Experts on one GPU: routing + scattermoe kernel tests at real shapes (bf16 vs fp32 eager), the
# expert-layer benchmark (with the SM clock per row), then where the time goes (host time +
# cProfile, per-kernel GPU times), and the layer under torch.compile's CUDA graphs (eager vs graphed). Parts:
# `bash benchmarks/gpu_experts.sh [tests] [bench] [host] [profile] [graphs]` (all when none is named; the
# whole takes more than one 10-minute device call).
source benchmarks/gpu_env.sh
parts=${*:-tests bench host profile graphs}
if [[ $parts == *tests* ]]; then
  python -m pytest -m gpu tests/gpu/test_routing_gpu.py tests/gpu/test_grouped_gemm_paths_gpu.py tests/gpu/test_scattermoe_gpu.py -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/experts_tests.log" | tail -n 3
fi
if [[ $parts == *bench* ]]; then
  # No nvidia-smi logger beside it: polling NVML every 100 ms cost the host-bound rows ~0.35 ms per step
  # (LoRA ep4 steady 1.769 against 1.425 without); the bench reads the SM clock itself after each row.
  python -m benchmarks.bench_experts --shapes qwen3-30b-a3b --backends scattermoe --out "$OUT" 2>&1 \
    | tee "$OUT/experts_bench.log" | tail -n 30
fi
if [[ $parts == *host* ]]; then
  python -m benchmarks.bench_experts --host --shapes qwen3-30b-a3b --backends scattermoe > "$OUT/experts_host.log" 2>&1
  grep "==" "$OUT/experts_host.log"
fi
if [[ $parts == *profile* ]]; then
  python -m benchmarks.bench_experts --profile --shapes qwen3-30b-a3b --backends scattermoe > "$OUT/experts_profile.log" 2>&1
  grep "==" "$OUT/experts_profile.log"
fi
if [[ $parts == *graphs* ]]; then
  python -m benchmarks.bench_experts --graphs --shapes qwen3-30b-a3b > "$OUT/experts_graphs.log" 2>&1
  grep "==" "$OUT/experts_graphs.log"
fi
