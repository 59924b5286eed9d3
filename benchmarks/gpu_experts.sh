#!/usr/bin/env bash
# Issue 4 on one GPU: scattermoe kernel tests at real shapes (bf16 vs fp32 eager) + expert-layer benchmark.
source benchmarks/gpu_env.sh
python -m pytest -m gpu tests/gpu/test_scattermoe_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/experts_tests.log" | tail -n 5
python benchmarks/bench_experts.py --shapes qwen3-30b-a3b --backends grouped_mm,scattermoe --out "$OUT" 2>&1 \
  | tee "$OUT/experts_bench.log" | tail -n 40
