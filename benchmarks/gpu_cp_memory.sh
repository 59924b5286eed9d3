#!/usr/bin/env bash
# Activation memory per token at cp=1 on one GPU, the input of the context-parallel memory model
# (docs/context_parallel.md): bench_e2e, ours only, LoRA, 4 layers of each preset, selective activation
# checkpointing, at several sequence lengths; peak GiB minus model GiB over the sequence length gives the
# bytes per token per layer. One device call, carry [".whl"] (and the two-call tilelang install of
# gpu_e2e_hybrid.sh for the hybrid preset): `bash benchmarks/gpu_cp_memory.sh` (~5 min on an H200).
source benchmarks/gpu_env.sh
LAYERS=${LAYERS:-4}
for preset in ${PRESETS:-qwen3-30b-a3b qwen3.5-35b-a3b}; do
  for seq in ${SEQS:-8192 16384 32768}; do
    tag="mem_${preset}_${seq}"
    python -m benchmarks.bench_e2e --preset "$preset" --mode lora --layers "$LAYERS" --seq "$seq" --steps 2 --warmup 1 \
      --no-baseline --set parallelism.activation_checkpoint=selective --tag "$tag" --out "$OUT" > "$OUT/$tag.log" 2>&1
    grep -E "^ours +lora |failed:" "$OUT/$tag.log" | sed "s/^/$preset seq $seq: /"
  done
done
