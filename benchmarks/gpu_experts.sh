#!/usr/bin/env bash
# Issue 4 on one GPU: routing + scattermoe kernel tests at real shapes (bf16 vs fp32 eager), the
# expert-layer benchmark (SM clock and power logged beside it), then where the time goes (host time +
# cProfile, per-kernel GPU times). Parts: `bash benchmarks/gpu_experts.sh [tests] [bench] [host] [profile]`
# (all four when none is named; the whole takes more than one 10-minute device call).
source benchmarks/gpu_env.sh
parts=${*:-tests bench host profile}
if [[ $parts == *tests* ]]; then
  python -m pytest -m gpu tests/gpu/test_routing_gpu.py tests/gpu/test_grouped_gemm_paths_gpu.py tests/gpu/test_scattermoe_gpu.py -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/experts_tests.log" | tail -n 3
fi
if [[ $parts == *bench* ]]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader -lms 100 \
    > "$OUT/experts_clocks.csv" &
  smi=$!
  python benchmarks/bench_experts.py --shapes qwen3-30b-a3b --backends scattermoe --out "$OUT" 2>&1 \
    | tee "$OUT/experts_bench.log" | tail -n 28
  kill $smi
  # SM clock (MHz) while the GPU drew more than 300 W: the clocks the layer ran at under load.
  awk -F', ' '$4+0 > 300 {print $2+0, $4+0}' "$OUT/experts_clocks.csv" | sort -n \
    | awk '{c[NR]=$1; p+=$2} END {if (NR) printf "== clocks under load: %d samples, SM MHz min %d median %d max %d, mean %.0f W\n", NR, c[1], c[int((NR+1)/2)], c[NR], p/NR}'
fi
if [[ $parts == *host* ]]; then
  python benchmarks/bench_experts.py --host --shapes qwen3-30b-a3b --backends scattermoe > "$OUT/experts_host.log" 2>&1
  grep "==" "$OUT/experts_host.log"
fi
if [[ $parts == *profile* ]]; then
  python benchmarks/bench_experts.py --profile --shapes qwen3-30b-a3b --backends scattermoe > "$OUT/experts_profile.log" 2>&1
  grep "==" "$OUT/experts_profile.log"
fi
