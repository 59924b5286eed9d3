#!/usr/bin/env bash
# Whole training steps of the hybrid Qwen3.5-35B-A3B (Gated DeltaNet + gated attention 3:1, 256 experts +
# shared expert) on one GPU, ours vs transformers(+PEFT) (benchmarks/bench_e2e.py): one packed row of 8192
# tokens, random init, no activation checkpointing, bf16 autocast, 2 warmup + 5 steps. LoRA 8 layers by
# default (LAYERS=N for another count); MODES="lora full" adds full fine-tuning (8 layers, fp32 masters vs bf16 parameters). Both sides run
# the fla GDN kernels: ours its fla op set, transformers fla's chunk_gated_delta_rule when fla imports (the
# row's note says which ran; without causal_conv1d its conv is torch's).
#
# The fla kernels need the two-call install of ../shared/gpu/wheels.sh (on Hopper with Triton 3.6, FLA 0.6
# runs its gated backward through TileLang, and tilelang's wheels exceed one carry). Prepare the wheels
# here once with `bash ../shared/gpu/wheels.sh --gdn`, then back to back:
#   call 1, carry [".whl-gdn1"]: python3 -m pip install -q --no-index --no-deps --no-compile \
#       --no-cache-dir --target /tmp/site .whl-gdn1/*.whl && echo ok
#   call 2, carry [".whl", ".whl-gdn2"]: bash benchmarks/gpu_e2e_hybrid.sh
# If call 2 reports warm: false, /tmp/site is gone (this script then stops): repeat call 1 first.
# TileLang compiles each fla kernel shape on first use, inside step 1 (the step-1 column); its cache makes
# the second side's compile shorter.
source benchmarks/gpu_env_gdn.sh
for mode in ${MODES:-lora}; do
  python -m benchmarks.bench_e2e --preset qwen3.5-35b-a3b --mode "$mode" --layers "${LAYERS:-8}" --steps 5 --warmup 2 \
    --tag "hybrid_$mode" --out "$OUT" > "$OUT/e2e_hybrid_$mode.log" 2>&1
  grep -E "failed:" "$OUT/e2e_hybrid_$mode.log"
done
echo "== summary (side mode ms/step b2b-ms tokens/s MFU peak-GiB model-GiB step-1-s loss1 note)"
for mode in ${MODES:-lora}; do
  grep -E "^\w.*\[.*torch|^(ours|baseline) +(lora|full) |^ratio" "$OUT/e2e_hybrid_$mode.log"
done
