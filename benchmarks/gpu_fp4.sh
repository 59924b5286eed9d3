#!/usr/bin/env bash
# FP4 expert weights on one GPU (issue 18), carry [".whl"] (torchao and the rest the image lacks), H100 or H200,
# one part per device call (each compiles many kernel variants: the FP4 tests alone take ~580 s on an H100):
#   bash benchmarks/gpu_fp4.sh tests;  bash benchmarks/gpu_fp4.sh dense;  bash benchmarks/gpu_fp4.sh bench;  ... e2e
#   (sweep, check, gemms and fit are asked for by name only)
#   tests  tests/gpu/test_fp4_gpu.py: scattermoe on packed weights vs eager on the dequantized ones (bf16, the
#          real expert shapes, both formats, LoRA) and the memory accounting (no dequantized copy)
#   dense  the dense scattermoe GPU tests and the quant unit tests: a change to the packed path touches the
#          kernel every backend launch uses
#   bench  bench_quant on the device (error, quantize time at load), bench_experts --modes lora16-mxfp4,... (the expert layer
#          on bf16 / MXFP4 / NVFP4 weights, LoRA, Qwen3-30B-A3B shapes)
#   e2e    bench_e2e LoRA 12 layers: ours on bf16 experts vs transformers+PEFT, then ours on NVFP4 and MXFP4
#          experts (ms/step and peak GiB against the bf16 row)
#   check  what fits one call after a decode change: the decode of every code under every scale byte and the
#          dequantize kernel bit for bit, scattermoe on packed
#          experts at the Qwen3-30B-A3B shape (both formats, LoRA and frozen), the memory accounting; then the
#          expert layer on bf16 / MXFP4 / NVFP4 weights at that shape (time and transient peak, scattermoe)
#   sweep  one call (< 9 min) after a decode or tuning change: the decode of every code under every scale
#          byte compiled for the GPU and the dequantize kernel bit for bit, scattermoe on packed experts vs eager
#          at the Qwen3-30B-A3B shape (both formats, LoRA and frozen); the expert layer (bf16 / MXFP4 / NVFP4,
#          LoRA r=16, autotuned); then each FP4 GEMM config forced on every packed GEMM (tuning.force_fp4_gemm_config),
#          ep1 fwd+bwd ms per format, one line per config (the autotuner may mix configs across the 4 GEMMs)
#   gemms  each GEMM reading a packed weight in a LoRA step, bf16 vs MXFP4 vs NVFP4 (bench_experts --gemms)
#   fit    the whole Qwen3-30B-A3B (48 layers) LoRA on MXFP4 experts, rows of 8192, no checkpointing: peak
#          against the estimate (runtime.launch --estimate: 66.55 GiB)
# Logs in $OUT/*.log, rows in $OUT/*.json; the summary comes last.
source benchmarks/gpu_env.sh
parts=${*:-tests dense bench e2e}

if [[ $parts == *tests* ]]; then
  python -m pytest -q -rs tests/gpu/test_fp4_gpu.py > "$OUT/fp4_tests.log" 2>&1
  tail -n 3 "$OUT/fp4_tests.log"
fi
if [[ $parts == *dense* ]]; then
  python -m pytest -q -rs tests/gpu/test_scattermoe_gpu.py tests/gpu/test_grouped_gemm_paths_gpu.py \
    tests/unit/test_quant.py > "$OUT/fp4_dense_tests.log" 2>&1
  tail -n 3 "$OUT/fp4_dense_tests.log"
fi
if [[ $parts == *check* ]]; then
  python -m pytest -q -rs tests/unit/test_quant.py tests/gpu/test_fp4_gpu.py \
    -k "compiled_decode or dequantize or qwen3-30b-a3b or no_dense_copy" > "$OUT/fp4_check.log" 2>&1
  tail -n 3 "$OUT/fp4_check.log"
  python -m benchmarks.bench_experts --shapes qwen3-30b-a3b --modes lora16,lora16-mxfp4,lora16-nvfp4 \
    --backends scattermoe --out "$OUT" > "$OUT/bench_experts_fp4.log" 2>&1
fi
if [[ $parts == *sweep* ]]; then
  timeout 150 python -m pytest -q -rs tests/unit/test_quant.py tests/gpu/test_fp4_gpu.py \
    -k "compiled_decode or dequantize_kernel or qwen3-30b-a3b" > "$OUT/fp4_sweep_tests.log" 2>&1
  tail -n 3 "$OUT/fp4_sweep_tests.log"
  timeout 120 python -m benchmarks.bench_experts --shapes qwen3-30b-a3b --modes lora16,lora16-mxfp4,lora16-nvfp4 \
    --backends scattermoe --out "$OUT" > "$OUT/bench_experts_fp4.log" 2>&1
  # BM,BN,BK,warps,stages[,persistent]: tuning.FP4_GEMM_CONFIGS (compiled by the runs above), then SWEEP_MORE
  # (compiled here; the taller row blocks measured on 2026-11-25 were "256,64,64,8,3 256,64,64,8,3,1
  # 256,64,64,8,4 256,64,128,8,2"). The timeouts keep the whole part under 9 minutes.
  # shellcheck disable=SC2086
  for cfg in 128,128,64,8,3 128,256,64,8,3 256,128,64,8,3 ${SWEEP_MORE:-}; do
    timeout 40 python - "$cfg" >> "$OUT/fp4_sweep.log" 2>&1 <<'PY'
import sys
from benchmarks.bench_experts import Row, bench_row
from moe.kernels.tuning import force_fp4_gemm_config
bm, bn, bk, warps, stages, *persistent = (int(v) for v in sys.argv[1].split(","))
force_fp4_gemm_config(bm, bn, bk, warps, stages, bool(persistent and persistent[0]))
cells = []
for mode in ("lora16-mxfp4", "lora16-nvfp4"):
    row = bench_row(Row("qwen3-30b-a3b", 8192, mode, 1, "scattermoe"), iters=10, warmup=3, matmul=None)
    cells.append(f"{mode[7:]} {row.fwd_ms:6.3f} {row.fwd_bwd_ms:6.3f} {row.steady_ms:6.3f}")
print(f"sweep {sys.argv[1]:16s} " + "   ".join(cells), flush=True)
PY
    rc=$?
    ((rc)) && echo "sweep $cfg failed (rc $rc; 124: timed out)" >> "$OUT/fp4_sweep.log"
  done
fi
if [[ $parts == *gemms* ]]; then
  python -m benchmarks.bench_experts --gemms --shapes qwen3-30b-a3b,qwen3.5-35b-a3b --iters 20 > "$OUT/fp4_gemms.log" 2>&1
fi
if [[ $parts == *bench* ]]; then
  python -m benchmarks.bench_quant --experts 128 --out "$OUT" > "$OUT/bench_quant.log" 2>&1
  python -m benchmarks.bench_experts --shapes qwen3-30b-a3b,qwen3.5-35b-a3b --modes lora16,lora16-mxfp4,lora16-nvfp4 --backends transformers,scattermoe --out "$OUT" > "$OUT/bench_experts_fp4.log" 2>&1
fi
tags=()
e2e() {  # tag, then bench flags
  local tag=$1
  shift
  tags+=("$tag")
  python -m benchmarks.bench_e2e --mode lora --layers 12 --steps 5 --warmup 2 --tag "$tag" --out "$OUT" "$@" \
    > "$OUT/e2e_$tag.log" 2>&1
}
if [[ $parts == *e2e* ]]; then
  e2e lora_bf16
  e2e lora_nvfp4 --set quant.base_weights=nvfp4 --no-baseline
  e2e lora_mxfp4 --set quant.base_weights=mxfp4 --no-baseline
fi
if [[ $parts == *fit* ]]; then
  e2e lora48_mxfp4 --layers 48 --set quant.base_weights=mxfp4 --no-baseline
fi
echo "== summary"
[[ -f $OUT/bench_quant.log ]] && grep -vE "register_constant|Failed to load" "$OUT/bench_quant.log" | tail -n 5
[[ -f $OUT/bench_experts_fp4.log ]] && grep -vE "register_constant|Failed to load" "$OUT/bench_experts_fp4.log" | tail -n 24
[[ -f $OUT/fp4_gemms.log ]] && grep -E "packed GEMMs|^GEMM|x$|Error" "$OUT/fp4_gemms.log"
[[ -f $OUT/fp4_sweep.log ]] && echo "config (force_fp4_gemm_config)  fmt fwd fwd+bwd steady ms (ep1)" \
  && grep -E "^sweep|Error" "$OUT/fp4_sweep.log"
for tag in "${tags[@]}"; do
  grep -E "^(ours|baseline) +lora |^ratio|failed:" "$OUT/e2e_$tag.log" | sed "s/^/$tag: /"
done
