#!/usr/bin/env bash
# Issue 4 on one GPU: routing + scattermoe kernel tests at real shapes (bf16 vs fp32 eager), the
# expert-layer benchmark, then where the time goes (host time + cProfile, per-kernel GPU times).
source benchmarks/gpu_env.sh
python -m pytest -m gpu tests/gpu/test_routing_gpu.py tests/gpu/test_grouped_gemm_paths_gpu.py tests/gpu/test_scattermoe_gpu.py -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/experts_tests.log" | tail -n 3
python benchmarks/bench_experts.py --shapes qwen3-30b-a3b --backends scattermoe --out "$OUT" 2>&1 \
  | tee "$OUT/experts_bench.log" | tail -n 22
python benchmarks/bench_experts.py --host --shapes qwen3-30b-a3b --backends scattermoe > "$OUT/experts_host.log" 2>&1
grep "==" "$OUT/experts_host.log"
python benchmarks/bench_experts.py --profile --shapes qwen3-30b-a3b --backends scattermoe > "$OUT/experts_profile.log" 2>&1
grep "==" "$OUT/experts_profile.log"
