#!/usr/bin/env bash
# Precision on one GPU: tests/gpu/test_precision_gpu.py — scattermoe and qk_norm_rope's Triton
# kernels in fp32 against fp64 references (IEEE by default <= 1e-5, TF32 allowed <= 1e-3), and the GDN
# layer's fp32 decay gradients (torch and fla op sets) against the fp64 token-by-token recurrence.
# Full logs go to $OUT: precision_env.log, precision_tests.log (everything but fla), precision_fla.log.
#
# The fla part needs the two-call install of ../shared/gpu/wheels.sh (its header says why: FLA 0.6 runs
# its gated backward through TileLang on Hopper). Prepare the wheels once with
# `bash ../shared/gpu/wheels.sh --gdn`, then back to back:
#   call 1, carry [".whl-gdn1"]: python3 -m pip install -q --no-index --no-deps --no-compile \
#       --no-cache-dir --target /tmp/site .whl-gdn1/*.whl && echo ok
#   call 2, carry [".whl", ".whl-gdn2"]: bash benchmarks/gpu_precision.sh
# Without call 1 (or on a fresh machine) the script runs everything but fla, and says so.
# FLA_TIMEOUT_S (default 240) bounds the fla part: TileLang compiles its kernels on first use.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls -d /tmp/site/z3* >/dev/null 2>&1 && [ -d .whl-gdn2 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .whl-gdn2/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  with_fla=1
else
  echo "note: /tmp/site lacks the .whl-gdn1 wheels (call 1) or .whl-gdn2 was not carried: fla part skipped"
  export PYTHONPATH=$PWD
  with_fla=0
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1
  python - <<'EOF'
import importlib.util
import torch, triton
extra = ""
for name in ("fla", "tilelang"):
    if importlib.util.find_spec(name) is not None:
        extra += f" {name} {__import__(name).__version__}"
print(f"torch {torch.__version__} triton {triton.__version__}{extra}; "
      f"fp32 matmul precision at start: {torch.backends.cuda.matmul.fp32_precision}")
EOF
} 2>&1 | tee "$OUT/precision_env.log"

pytest_args=(-m gpu tests/gpu/test_precision_gpu.py -q -rA -p no:cacheprovider --durations=5)
python -m pytest "${pytest_args[@]}" -k "not fla" 2>&1 | tee "$OUT/precision_tests.log" \
  | grep -E "^(scattermoe|eager|norm_rope|GDN)|passed|failed|error|^FAILED" | sort -u
if [ "$with_fla" = 1 ]; then
  timeout "${FLA_TIMEOUT_S:-240}" python -m pytest "${pytest_args[@]}" -k fla 2>&1 \
    | tee "$OUT/precision_fla.log" | grep -E "^GDN|passed|failed|error|^FAILED" | sort -u
  [ "${PIPESTATUS[0]}" = 124 ] && echo "fla part stopped at FLA_TIMEOUT_S=${FLA_TIMEOUT_S:-240} s"
fi
exit 0
