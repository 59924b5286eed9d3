#!/usr/bin/env bash
# Hybrid models on one GPU: Gated DeltaNet tests (fla vs torch op sets in bf16, opcheck, signature guard,
# compile fullgraph), the GDN layer timing, the compiled hybrid decoder tests (AC none/full/selective,
# zero graph breaks) and the 4-layer Qwen3.5-35B-A3B stack, eager vs compiled. Parts:
# `bash benchmarks/gpu_hybrid.sh [gdn] [layer] [compile] [stack]` (all when none is named; TileLang compiles
# every fla kernel shape on first use, so all four may not fit one 10-minute device call).
#
# The fla op set needs the two-call install of ../shared/gpu/wheels.sh (its header says why: on Hopper with
# Triton 3.6, FLA 0.6 runs its gated backward through TileLang, and tilelang's wheels exceed one carry).
# Prepare the wheels here once with `bash ../shared/gpu/wheels.sh --gdn`, then back to back:
#   call 1, carry [".whl-gdn1"]: python3 -m pip install -q --no-index --no-deps --no-compile \
#       --no-cache-dir --target /tmp/site .whl-gdn1/*.whl && echo ok
#   call 2, carry [".whl", ".whl-gdn2"]: bash benchmarks/gpu_hybrid.sh
# If call 2 reports warm: false, /tmp/site is gone (this script then stops): repeat call 1 first.
# Part `conv` alone needs one call, carry [".whl"]: the frozen GDN conv's input-gradient kernel
# (tests/gpu/test_conv_silu_gpu.py, then bench_hybrid --gdn-conv against FLA's conv backward).
if [ "${1:-}" = conv ]; then  # FLA's conv kernels are Triton: no TileLang, one call, carry [".whl"]
  source benchmarks/gpu_env.sh
  python -m pytest -q -m gpu -p no:cacheprovider --durations=4 tests/gpu/test_conv_silu_gpu.py 2>&1 | tee "$OUT/conv_silu_tests.log" \
    | tail -n 12
  python -m benchmarks.bench_hybrid --gdn-conv --out "$OUT" 2>&1 | tee "$OUT/gdn_conv_bench.log" | tail -n 6
  exit 0
fi
source benchmarks/gpu_env_gdn.sh
parts=${*:-gdn layer compile stack}
python - <<'PY' 2>&1 | tee "$OUT/hybrid_env.log"
import torch, triton, fla, tilelang
from fla.utils.env import has_usable_nvcc
print(f"torch {torch.__version__} triton {triton.__version__} fla {fla.__version__} "
      f"tilelang {tilelang.__version__} nvcc for tilelang: {has_usable_nvcc()}")
PY
if [[ $parts == *gdn* ]]; then
  python -m pytest -m gpu tests/gpu/test_gdn_gpu.py -q -p no:cacheprovider -rA 2>&1 \
    | tee "$OUT/gdn_tests.log" | tail -n 25
fi
if [[ $parts == *layer* ]]; then
  python -m benchmarks.bench_hybrid --gdn-layer --out "$OUT" 2>&1 | tee "$OUT/gdn_layer_bench.log" | tail -n 6
fi
if [[ $parts == *compile* ]]; then
  python -m pytest -m gpu tests/gpu/test_compile_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/compile_tests.log" | tail -n 5
  grep -E "^E  " "$OUT/compile_tests.log" | head -n 12
fi
if [[ $parts == *stack* ]]; then
  python -m benchmarks.bench_hybrid --out "$OUT" 2>&1 | tee "$OUT/bench_hybrid.log" | tail -n 8
fi
