#!/usr/bin/env bash
# Expert parallelism on 2-4 GPUs: NCCL bf16 parity (runtime.verify) at ep=2 and ep=4, then the EP layer benchmark.
source benchmarks/gpu_env.sh
N=$(nvidia-smi -L | wc -l)
for ep in 2 4; do
  [ "$ep" -le "$N" ] || continue
  torchrun --standalone --nproc_per_node "$N" -m runtime.verify --ep "$ep" examples/tiny-qwen3-moe.yaml --steps 3 \
    2>&1 | tee "$OUT/verify_ep$ep.log" | grep -vE "^\s*$|Warning|warn" | tail -n 8
done
torchrun --standalone --nproc_per_node "$N" -m benchmarks.bench_ep --out "$OUT" 2>&1 | tee "$OUT/bench_ep.log" | tail -n 6
