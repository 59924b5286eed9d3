#!/usr/bin/env bash
# Fused q/k norm + RoPE and attention on one GPU: kernel tests (bf16 parity, compile without graph breaks,
# opcheck), the varlen flash attention backend vs SDPA on packed documents, then the benchmark.
source benchmarks/gpu_env.sh
python -m pytest -m gpu tests/gpu/test_norm_rope_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/norm_rope_tests.log" | tail -n 3
python -m pytest -m gpu tests/gpu/test_attention_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/attention_flash_tests.log" | tail -n 3
python -m benchmarks.bench_norm_rope --out "$OUT" 2>&1 | tee "$OUT/norm_rope_bench.log" | tail -n 30
