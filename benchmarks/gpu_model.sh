#!/usr/bin/env bash
# The model on one GPU: bf16 parity with transformers + a real Qwen3-30B-A3B-dims 2-layer training run, and the
# fused projections (q/k/v, LoRA) under CUDA autocast.
source benchmarks/gpu_env.sh
python -m pytest -m gpu tests/gpu/test_model_gpu.py tests/unit/test_projection.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/model.log" | grep -E "passed|failed|real-dims|Error"
