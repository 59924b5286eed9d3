#!/usr/bin/env bash
# SonicMoE on one GPU: install a candidate (cutlass-dsl, quack, sonic-moe) wheel set, smoke it, then run the
# sonicmoe GPU tests and the expert-layer benchmark with the first set that works.
#
# Wheel sets come from `bash benchmarks/sonicmoe_wheels.sh` (CPU side; it says what sets a, b, c are). Set TAG
# travels in two folders (each under one call's 64 MiB), so it takes two device calls back to back (a warm
# machine keeps /tmp for ~30 s between calls; a fresh one (warm: false) has lost it: stage again):
#   call 1, carry [".whl-sonic-TAG-1"]:  bash benchmarks/gpu_sonicmoe.sh stage TAG
#   call 2, carry [".whl-sonic-TAG-2"]:  bash benchmarks/gpu_sonicmoe.sh run TAG [TAG ...] [-- smoke tests bench]
# `run` assembles and unpacks each TAG whose parts are all on the machine into /tmp/sonic/TAG/site-packages
# (skipped when already there), smokes each (import + one small fwd/bwd through sonicmoe's general-routing
# call, against its torch statement moe.backends.sonicmoe.emulate_general_routing), then runs `tests` and
# `bench` with the first TAG that ran. Steps default to smoke tests bench, each bounded by what is left of DEADLINE
# (seconds, default 570: the call's 600 s limit). A later call on the warm machine may run more steps:
#   bash benchmarks/gpu_sonicmoe.sh run TAG -- bench
#   SHAPES=olmoe,mixtral-8x7b bash benchmarks/gpu_sonicmoe.sh run TAG -- bench e2e   # e2e: bench_e2e, both backends
#   eval "$(bash benchmarks/gpu_sonicmoe.sh env TAG)"; python3 ...   # any command with TAG's packages
#
# Why a folder named site-packages: quack >= 0.6.2 fingerprints what its epilogues reach except functions whose
# files lie under .../site-packages/ or .../dist-packages/ (quack/gemm_runtime/identity.py); wheels unpacked
# into /tmp/site made it fingerprint cutlass's own functions, whose globals (the _LOC_TRANSFORMS ContextVar)
# it refuses: the TypeError seen with cutlass-dsl 4.8.1 + quack 0.6.5. The CuTe DSL wheels share one
# folder (nvidia_cutlass_dsl/), so they are unpacked, not pip-installed; the .pth line they would add
# (dsl_packages/ from 4.6, python_packages/ in 4.4) is put on PYTHONPATH instead.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PARTS=/tmp/sonic-parts
SITES=/tmp/sonic
DEADLINE=${DEADLINE:-570}

site_of() { echo "$SITES/$1/site-packages"; }

pythonpath_of() {  # TAG's site-packages, its DSL folder, the carried .whl wheels (torchao), then the project
  local site pp
  site=$(site_of "$1")
  pp=$site
  for sub in nvidia_cutlass_dsl/dsl_packages nvidia_cutlass_dsl/python_packages; do
    [ -d "$site/$sub" ] && pp=$pp:$site/$sub
  done
  [ -d /tmp/site ] && pp=$pp:/tmp/site
  echo "$pp:$PWD"
}

install_set() {  # assemble the split wheel(s) of TAG and unpack all of its wheels; 0 when installed
  local tag=$1 site parts w name
  site=$(site_of "$tag")
  parts=$PARTS/$tag
  [ -f "$site/.installed" ] && { echo "set $tag: already installed in $site"; return 0; }
  mkdir -p "$parts"
  for d in ".whl-sonic-$tag-1" ".whl-sonic-$tag-2"; do  # what this call carries (or an earlier one left)
    [ -d "$d" ] && cp "$d"/* "$parts/"
  done
  for w in "$parts"/*.part.aa; do
    [ -e "$w" ] || continue
    name=${w%.part.aa}
    [ -e "$name.part.ab" ] || { echo "set $tag: no part .ab (carry .whl-sonic-$tag-2 in this call)"; return 1; }
    cat "$name".part.* > "$name" && rm -f "$name".part.*
  done
  if ! ls "$parts"/nvidia_cutlass_dsl_libs_cu1*.whl >/dev/null 2>&1; then
    echo "set $tag: its CuTe DSL library wheel is not on this machine: 'stage $tag' (carry .whl-sonic-$tag-1) right"
    echo "  before this call (a fresh machine has lost what an earlier call staged), and carry .whl-sonic-$tag-2 here"
    return 1
  fi
  rm -rf "$site" && mkdir -p "$site"
  # DSL base, core, then the library flavor (its files win where they overlap), then the rest
  for w in "$parts"/nvidia_cutlass_dsl_libs_base-*.whl "$parts"/nvidia_cutlass_dsl_libs_core-*.whl \
           "$parts"/nvidia_cutlass_dsl_libs_cu1*.whl "$parts"/nvidia_cutlass_dsl-*.whl "$parts"/quack_kernels-*.whl \
           "$parts"/sonic_moe-*.whl "$parts"/apache_tvm_ffi-*.whl "$parts"/torch_c_dlpack_ext-*.whl; do
    [ -e "$w" ] || continue
    python3 -m zipfile -e "$w" "$site" || { echo "set $tag: cannot unpack $w"; return 1; }
  done
  touch "$site/.installed"
  echo "set $tag: installed in $site ($(du -sh "$site" | cut -f1)): $(ls "$parts" | tr '\n' ' ')"
}

left() { local s=$((DEADLINE - SECONDS)); echo $((s > 1 ? s : 1)); }

smoke() {  # exit 0: runs and matches its torch statement, 2: runs but differs, 124: out of time, else fails
  local tag=$1
  PYTHONPATH=$(pythonpath_of "$tag") QUACK_CACHE_DIR=/tmp/quack-cache/$tag PYTHONUNBUFFERED=1 \
    timeout "$(left)" python3 /tmp/sonicmoe_smoke.py
}

write_smoke() {
  cat > /tmp/sonicmoe_smoke.py <<'EOF'
import importlib.metadata as md
import sys
import time
import traceback

import torch

t0 = time.time()
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "?"
print(f"versions: nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}, quack-kernels {version('quack-kernels')}, "
      f"sonic-moe {version('sonic-moe')}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
try:
    import cutlass
    import quack

    print(f"cutlass from {cutlass.__file__}, quack from {quack.__file__}")
    import moe.backends.sonicmoe as sm

    sm.load_sonic()  # imports sonicmoe; QuACK's default GEMM configs
except Exception:
    traceback.print_exc()
    print("SMOKE import FAILED")
    sys.exit(1)
print(f"imports ok in {time.time() - t0:.1f} s")

from moe.backends import EXPERT_BACKENDS, expert_backend
from moe.experts import GroupedExperts

print(f"registry: sonicmoe available = {EXPERT_BACKENDS.is_available('sonicmoe')}")
torch.manual_seed(0)
E, H, I, k, T = 8, 256, 128, 2, 512
ex = GroupedExperts(E, H, I, device="cuda", dtype=torch.bfloat16)
w, ids = torch.randn(T, 2 * E, device="cuda").softmax(-1).topk(k, dim=-1)
ids = torch.where(ids < E, ids, -1)  # about half the slots -1 (ep=2 layout)
ids[5] = -1
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

def fwd_bwd(fn):
    xx, ww = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    for p in ex.parameters():
        p.grad = None
    y = fn(xx, ids, ww, ex)
    y.backward(dy)
    torch.cuda.synchronize()
    return {"y": y.detach(), "dx": xx.grad, "dw": ww.grad, "dW_gate_up": ex.gate_up.grad, "dW_down": ex.down.grad}

try:
    t1 = time.time()
    got = fwd_bwd(expert_backend("sonicmoe"))
    t2 = time.time()
    fwd_bwd(expert_backend("sonicmoe"))
    print(f"fwd+bwd ran: first {t2 - t1:.1f} s (compiles), second {time.time() - t2:.3f} s")
except Exception:
    traceback.print_exc()
    print("SMOKE run FAILED")
    sys.exit(1)
ref = fwd_bwd(lambda *a: sm.sonicmoe_forward(*a, sm.emulate_general_routing, "swiglu"))
errors = {n: ((got[n].float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item() for n, r in ref.items()}
print("norm-relative error vs emulate_general_routing: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
ok = all(e <= 1e-2 for e in errors.values())
print(f"SMOKE {'OK' if ok else 'RUNS BUT DIFFERS'} in {time.time() - t0:.1f} s")
sys.exit(0 if ok else 2)
EOF
}

verb=${1:-}
shift || true
case "$verb" in
  stage)
    for tag in "$@"; do
      mkdir -p "$PARTS/$tag" && cp ".whl-sonic-$tag-1"/* "$PARTS/$tag/" && echo "staged: $(ls -l "$PARTS/$tag" | tail -n +2)"
    done
    ;;
  env)
    echo "export PYTHONPATH=$(pythonpath_of "$1") QUACK_CACHE_DIR=/tmp/quack-cache/$1"
    ;;
  run)
    tags=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do tags+=("$1"); shift; done
    [ "${1:-}" = "--" ] && shift
    steps=${*:-smoke tests bench}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1
    if [ -d .whl ]; then  # torchao for the FP4-base cases (carry .whl beside .whl-sonic-TAG-2)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >/dev/null 2>&1 || echo "warning: .whl install failed"
    fi
    python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
    chosen=""
    for tag in "${tags[@]}"; do
      install_set "$tag" || continue
      if [[ $steps != *smoke* ]]; then chosen=$tag; break; fi
      echo "== smoke, set $tag"
      write_smoke
      smoke "$tag" 2>&1 | tee "$OUT/sonicmoe_smoke_$tag.log"
      rc=${PIPESTATUS[0]}
      echo "== set $tag: smoke exit $rc (0 ok, 2 runs but differs, 124 out of time, else fails)"
      if [ "$rc" = 0 ] || [ "$rc" = 2 ]; then chosen=$tag; break; fi
    done
    [ -n "$chosen" ] || { echo "== no set ran"; exit 1; }
    echo "== using set $chosen ($(left) s left)"
    PYTHONPATH=$(pythonpath_of "$chosen")
    export PYTHONPATH QUACK_CACHE_DIR=/tmp/quack-cache/$chosen PYTHONUNBUFFERED=1
    if [[ $steps == *tests* ]]; then
      kargs=()
      [ -n "${TESTS_K:-}" ] && kargs=(-k "$TESTS_K")
      timeout "$(left)" python3 -m pytest -m gpu tests/gpu/test_sonicmoe_gpu.py -q -rf --tb=short -p no:cacheprovider \
        --timeout=240 "${kargs[@]}" 2>&1 | tee "$OUT/sonicmoe_tests.log" | grep -E "passed|failed|FAILED|Error|error" | tail -n 40
      echo "== tests exit ${PIPESTATUS[0]} ($(left) s left)"
    fi
    if [[ $steps == *bench* ]]; then
      # shellcheck disable=SC2086  # BENCH_ARGS: more bench_experts options, e.g. "--modes lora16"
      timeout "$(left)" python3 -m benchmarks.bench_experts --shapes "${SHAPES:-qwen3-30b-a3b}" \
        --backends "${BACKENDS:-sonicmoe,scattermoe,transformers}" ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/sonicmoe_bench.log" | tail -n 45
      echo "== bench exit ${PIPESTATUS[0]} ($(left) s left)"
    fi
    if [[ $steps == *e2e* ]]; then  # the training step: sonicmoe (+ transformers), scattermoe alone; E2E_LIMIT s each
      for mode in ${E2E_MODES:-lora full}; do
        for experts in ${E2E_BACKENDS:-sonicmoe scattermoe}; do
          base=()
          [ "$experts" = scattermoe ] && base=(--no-baseline)
          lim=$(left); [ "$lim" -gt "${E2E_LIMIT:-200}" ] && lim=${E2E_LIMIT:-200}
          timeout "$lim" python3 -m benchmarks.bench_e2e --mode "$mode" --experts "$experts" "${base[@]}" \
            --steps 5 --warmup 3 --tag "$experts-$mode" --out "$OUT" 2>&1 | tee "$OUT/e2e_$experts-$mode.log" | tail -n 6
          echo "== e2e $mode $experts exit ${PIPESTATUS[0]} ($(left) s left)"
        done
      done
    fi
    if [[ $steps == *tuned* ]]; then  # QuACK's autotuner instead of its default configs (P fixed in the bench)
      mkdir -p "$OUT/tuned"
      timeout "$(left)" python3 -c "
import sys
import moe.backends.sonicmoe as sm
sm.fixed_gemm_configs = lambda modules: None
from benchmarks.bench_experts import main
sys.argv = ['bench_experts', '--shapes', 'qwen3-30b-a3b', '--backends', 'sonicmoe', '--modes', 'full',
            '--out', '$OUT/tuned']
main()" 2>&1 | tee "$OUT/sonicmoe_tuned.log" | grep -E "^qwen3|Error|error" | tail -n 20
      echo "== tuned exit ${PIPESTATUS[0]} ($(left) s left)"
    fi
    ;;
  *)
    echo "usage: bash benchmarks/gpu_sonicmoe.sh stage TAG | run TAG [TAG ...] [-- smoke tests bench] | env TAG"
    exit 1
    ;;
esac
