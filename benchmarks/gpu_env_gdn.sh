# Sourced by the GDN topic scripts (gpu_hybrid.sh, gpu_e2e_hybrid.sh), call 2 of the two-call install of
# ../shared/gpu/wheels.sh: checks that call 1 left its wheels in /tmp/site, installs .whl and .whl-gdn2 there.
set -uo pipefail
if ! ls -d /tmp/site/z3* >/dev/null 2>&1; then
  echo "error: /tmp/site lacks the .whl-gdn1 wheels (z3, tvm-ffi): run call 1 first (see header)"; exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-gdn2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1
