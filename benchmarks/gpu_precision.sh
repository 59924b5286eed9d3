#!/usr/bin/env bash
# Issue 23 (precision) on one GPU: tests/gpu/test_precision_gpu.py — scattermoe and qk_norm_rope's Triton
# kernels in fp32 against fp64 references (IEEE by default <= 1e-5, TF32 allowed <= 1e-3: tf32x3 dots),
# the GDN layer's fp32 decay gradients (torch and fla op sets, and FLA's own function) against the fp64
# token-by-token recurrence, and a diagnosis of FLA's delta rule (FLA's public function and our op set
# vs the recurrence, fp32 and bf16, over decay bands from moderate to the HF initial decays).
#
#   bash benchmarks/gpu_precision.sh [tests] [fla]        # both stages when none is named
#   tests: pytest -k "not fla" -> $OUT/precision_tests.log; scattermoe fp32 timing (IEEE, tf32x3, cuBLAS)
#          -> $OUT/precision_timing.log
#   fla:   the FLA diagnosis -> $OUT/precision_diag.log (bounded by DIAG_TIMEOUT_S, default 300: FLA's
#          Triton autotuning and TileLang compile on first use, once per dtype), then pytest -k fla ->
#          $OUT/precision_fla.log (FLA_TIMEOUT_S, default 200; the caches are warm by then)
# $OUT/precision_env.log: device and versions.
#
# The fla stage needs the two-call install of ../shared/gpu/wheels.sh (its header says why: FLA 0.6 runs
# its gated backward through TileLang on Hopper). Prepare the wheels once with
# `bash ../shared/gpu/wheels.sh --gdn`, then back to back (the machine stays warm ~30 s between calls):
#   call 1, carry [".whl-gdn1"]: python3 -m pip install -q --no-index --no-deps --no-compile \
#       --no-cache-dir --target /tmp/site .whl-gdn1/*.whl && bash benchmarks/gpu_precision.sh tests
#   call 2, carry [".whl", ".whl-gdn2"]: bash benchmarks/gpu_precision.sh fla
# Without call 1's wheels in /tmp/site (or on a fresh machine) the fla stage is skipped, and says so.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=" ${*:-tests fla} "
with_fla=0
if [[ $stages == *" fla "* ]] && ls -d /tmp/site/z3* >/dev/null 2>&1 && [ -d .whl-gdn2 ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .whl-gdn2/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  with_fla=1
else
  [[ $stages == *" fla "* ]] && echo "note: /tmp/site lacks the .whl-gdn1 wheels (call 1) or .whl/.whl-gdn2" \
    "were not carried: fla stage skipped"
  export PYTHONPATH=$PWD
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
if [[ $stages == *" tests "* ]]; then
  start=$SECONDS
  python -m pytest "${pytest_args[@]}" -k "not fla" 2>&1 | tee "$OUT/precision_tests.log" \
    | grep -E "^(scattermoe|eager|norm_rope|GDN)|passed|failed|error|^FAILED" | sort -u
  echo "tests: $((SECONDS - start)) s"
  # scattermoe fp32 forward + backward at Qwen3-30B-A3B expert dims: IEEE dots (default), tf32x3 (TF32
  # allowed), and the eager backend (cuBLAS per expert) under both settings, for the cost of each.
  python - <<'EOF' 2>&1 | tee "$OUT/precision_timing.log"
import torch
from tests.gpu.test_precision_gpu import backend_run, make_experts, routed_inputs
from tests.unit.test_precision import fp32_matmul

E, H, I, M, k = 32, 2048, 768, 1024, 8
experts = make_experts(E, H, I, 0)
ids_Mk, weights_Mk = routed_inputs(M, E, k)
x_MH = torch.randn(M, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
flop = 3 * 2 * (M * k) * (2 * I * H + H * I)  # forward + backward (dx, dW) of gate_up and down
for backend in ("scattermoe", "eager"):
    for setting in (None, "tf32"):
        with fp32_matmul(setting):
            for _ in range(2):  # autotune / warm-up
                backend_run(backend, experts, x_MH, ids_Mk, weights_Mk)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                backend_run(backend, experts, x_MH, ids_Mk, weights_Mk)
            end.record()
            torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 5
        print(f"timing fp32 E{E} H{H} I{I} M{M} k{k} fwd+bwd {backend:10s} {setting or 'ieee':5s}: "
              f"{ms:7.2f} ms  {flop / ms / 1e9:6.1f} TFLOP/s")
EOF
fi

if [[ $stages == *" fla "* ]] && [ "$with_fla" = 1 ]; then
  start=$SECONDS
  timeout "${DIAG_TIMEOUT_S:-300}" python - <<'EOF' 2>&1 | tee "$OUT/precision_diag.log"
# FLA diagnosis (issue 23): FLA's public chunk_gated_delta_rule ("function", run twice) and our op set
# ("op set") vs the fp64 token-by-token recurrence, on the GDN test layer's own delta-rule inputs (HF
# initial decays, moderate decays) and on random inputs with g ~ U(lo, hi) per token; fp32 and bf16.
import time

import torch
from tests.gpu.test_precision_gpu import (band_delta_rule_inputs, delta_rule_grads, errors_vs, fla_function,
                                          fla_op_set, layer_delta_rule_inputs, recurrence_fp64)

t0 = time.time()
cases = [(f"layer-{decays}", layer_delta_rule_inputs(decays)) for decays in ("initial", "moderate")]
cases += [(f"g~U({lo},{hi})", band_delta_rule_inputs(lo, hi))
          for lo, hi in ((-1.0, -0.05), (-5.0, -1.0), (-20.0, -5.0), (-100.0, -20.0))]
for name, inputs in cases:
    g = inputs[3]
    q = torch.tensor([0.0, 0.5, 1.0], device="cuda")
    print(f"{name}: g per token, per value head (min / median / max): "
          + "  ".join("/".join(f"{v:.3g}" for v in torch.quantile(g[..., h].flatten(), q).tolist())
                      for h in range(g.shape[-1])))
for dtype in (torch.float32, torch.bfloat16):
    for name, inputs in cases:
        ref = delta_rule_grads(recurrence_fp64, inputs, dtype)
        fn1 = delta_rule_grads(fla_function, inputs, dtype)
        fn2 = delta_rule_grads(fla_function, inputs, dtype)
        ours = delta_rule_grads(fla_op_set, inputs, dtype)
        label = f"{str(dtype)[6:]:8s} {name:16s}"
        print(f"{label} function vs fp64: " + " ".join(f"{n} {e:.1e}" for n, e in errors_vs(fn1, ref).items()))
        print(f"{label} op set   vs fp64: " + " ".join(f"{n} {e:.1e}" for n, e in errors_vs(ours, ref).items()))
        print(f"{label} op set vs function (max over o, grads): {max(errors_vs(ours, fn1).values()):.1e}; "
              f"function vs its repeat: {max(errors_vs(fn2, fn1).values()):.1e}")
        g = inputs[3]
        strong, weak = g < -20, g > -1
        dg_ref, dg_fla = ref["dg"].double(), fn1["dg"].double()
        parts = []
        if strong.any():
            parts.append(f"g<-20 ({int(strong.sum())} tokens): max|dg| exact {dg_ref[strong].abs().max():.1e}, "
                         f"FLA {dg_fla[strong].abs().max():.1e}; max|dg*g| exact "
                         f"{(dg_ref * g)[strong].abs().max():.1e}, FLA {(dg_fla * g)[strong].abs().max():.1e}")
        if weak.any():
            rel = (dg_fla - dg_ref)[weak].norm() / dg_ref[weak].norm()
            parts.append(f"g>-1 ({int(weak.sum())} tokens): dg norm-relative {rel:.1e}")
        print(f"{label} dg by token: " + "; ".join(parts))
        print(f"{label} dA_log per head: exact " + " ".join(f"{v:+.3e}" for v in ref["dA_log"].tolist())
              + " | FLA " + " ".join(f"{v:+.3e}" for v in fn1["dA_log"].tolist()))
        print(f"  ({time.time() - t0:.0f} s)")
EOF
  [ "${PIPESTATUS[0]}" = 124 ] && echo "diagnosis stopped at DIAG_TIMEOUT_S=${DIAG_TIMEOUT_S:-300} s"
  echo "diagnosis: $((SECONDS - start)) s"
  start=$SECONDS
  timeout "${FLA_TIMEOUT_S:-200}" python -m pytest "${pytest_args[@]}" -k fla 2>&1 \
    | tee "$OUT/precision_fla.log" | grep -E "^(GDN|fla)|passed|failed|error|^FAILED|XPASS|XFAIL" | sort -u
  [ "${PIPESTATUS[0]}" = 124 ] && echo "fla tests stopped at FLA_TIMEOUT_S=${FLA_TIMEOUT_S:-200} s"
  echo "fla tests: $((SECONDS - start)) s"
fi
exit 0
