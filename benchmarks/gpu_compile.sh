#!/usr/bin/env bash
# Issue 6 compile on one GPU (call 2 of the two-call GDN install, see benchmarks/gpu_gdn.sh): compiled hybrid
# decoder with AC full/selective, then the 4-layer Qwen3.5-35B-A3B stack benchmark (eager vs compiled).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-gdn2/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD; mkdir -p $OUT
timeout 200 python -m pytest -m gpu tests/gpu/test_compile_gpu.py -q -p no:cacheprovider -k "full or selective" > $OUT/compile_tests.log 2>&1; tail -n 3 $OUT/compile_tests.log
grep -E "^E  " $OUT/compile_tests.log | head -n 12
timeout 330 python benchmarks/bench_hybrid_compile.py --out $OUT 2>&1 | tee $OUT/bench_hybrid_compile.log | tail -n 8
