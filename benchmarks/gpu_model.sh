#!/usr/bin/env bash
# The model on one GPU: bf16 parity with transformers + a real Qwen3-30B-A3B-dims 2-layer training run.
source benchmarks/gpu_env.sh
python -m pytest -m gpu tests/gpu/test_model_gpu.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/model.log" | grep -E "passed|failed|real-dims|Error"
