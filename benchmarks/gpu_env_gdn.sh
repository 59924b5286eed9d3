# Sourced by the GDN topic scripts (gpu_hybrid.sh, gpu_e2e_hybrid.sh), in the last call of the install of
# ../shared/gpu/wheels.sh's GDN wheels: checks that the calls before left .whl-gdn1's wheels in /tmp/site, installs
# the wheels this call carries (.whl, and .whl-gdn2 unless a call before installed it) there, and checks TileLang.
set -uo pipefail
if ! ls -d /tmp/site/z3* >/dev/null 2>&1; then
  echo "error: /tmp/site lacks the .whl-gdn1 wheels (z3, tvm-ffi): run call 1 first (see header)"; exit 1
fi
carried=(.whl/*.whl)
[ -d .whl-gdn2 ] && carried+=(.whl-gdn2/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${carried[@]}" || exit 1
if ! ls -d /tmp/site/tilelang* >/dev/null 2>&1; then
  echo "error: /tmp/site lacks TileLang: carry .whl-gdn2 (see header)"; exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1
