#!/usr/bin/env bash
# Context parallelism on one GPU (issue 19), one device call, carry [".whl"] (and the two-call tilelang
# install of gpu_e2e_hybrid.sh for the hybrid preset): `bash benchmarks/gpu_cp.sh [tests] [memory]`.
#   tests   tests/gpu/test_cp_varlen_gpu.py: the allgather mode's varlen path (real varlen kernels, bf16)
#           against the masked SDPA path, forward and gradients
#   memory  activation memory per token at cp=1, the input of the memory model (docs/context_parallel.md):
#           bench_e2e, ours only, LoRA, 4 layers of each preset (PRESETS), selective activation
#           checkpointing, at several sequence lengths (SEQS); peak GiB minus model GiB over the sequence
#           length gives the bytes per token per layer (~5 min on an H200 for both presets)
source benchmarks/gpu_env.sh
parts=${*:-tests memory}
if [[ $parts == *tests* ]]; then
  python -m pytest -q -rs tests/gpu/test_cp_varlen_gpu.py > "$OUT/cp_tests.log" 2>&1
  tail -n 3 "$OUT/cp_tests.log"
fi
if [[ $parts == *memory* ]]; then
  LAYERS=${LAYERS:-4}
  for preset in ${PRESETS:-qwen3-30b-a3b qwen3.5-35b-a3b}; do
    for seq in ${SEQS:-8192 16384 32768}; do
      tag="mem_${preset}_${seq}"
      python -m benchmarks.bench_e2e --preset "$preset" --mode lora --layers "$LAYERS" --seq "$seq" --steps 2 \
        --warmup 1 --no-baseline --set parallelism.activation_checkpoint=selective --tag "$tag" --out "$OUT" \
        > "$OUT/$tag.log" 2>&1
      grep -E "^ours +lora |failed:" "$OUT/$tag.log" | sed "s/^/$preset seq $seq: /"
    done
  done
fi
