#!/usr/bin/env bash
# Whole training steps on one GPU, ours vs transformers(+PEFT) (benchmarks/bench_e2e.py): Qwen3-30B-A3B dims,
# one packed row of 8192 tokens, random init, no activation checkpointing, bf16 autocast, 2 warmup + 5 steps.
#   lora  12 layers, ours vs baseline, and the top CUDA kernels of our step (--profile; the timed steps run
#         before the profiled ones) with its chrome trace
#   full  8 layers, ours with fp32 masters vs baseline (bf16 parameters), then ours with bf16 masters and
#         its top CUDA kernels; COMPILE=1 compiles ours (compile.enabled)
#   step1 time to step 1 of the 12-layer LoRA model: one run fills the caches, a second measures it with
#         warm caches (the target's measure)
#   recompiles  the training loop (runtime.launch), 8-layer full fine-tune, compile.enabled, 12 steps on the
#         bundled chat data packed into 8192-token rows (the document count and the longest document change
#         every step): per step its seconds, documents and the recompile count of metrics.jsonl, dynamo's
#         reasons (TORCH_LOGS=recompiles), and PASS when the run recompiled at most twice
#   against  ours only, this tree against an older one carried as OLD=<ignored folder> (`git archive REV | tar x -C
#         old`, carry [".whl", "old"]): LoRA 12 layers and full 8 layers (bf16 masters), old then new then old
#         again, so drift between the runs shows
# One device call, carry [".whl"] (pydantic and the rest the image lacks): `bash benchmarks/gpu_e2e.sh`
# (~1 min per side: imports, build, 7 steps).
# Parts: `bash benchmarks/gpu_e2e.sh [lora] [full] [step1] [recompiles]`.
# Memory: 8 full layers are 5.6 G parameters; fp32 masters + grads + AdamW states take 16 B each, ~90 GB:
# over an 80 GB H100 (that row then reads OutOfMemoryError), within an H200. FULL_LAYERS=4 fits either.
# Logs per run in $OUT/e2e_<tag>.log, rows in $OUT/bench_e2e_<tag>.json; the summary table comes last.
source benchmarks/gpu_env.sh
parts=${*:-lora full}
FULL_LAYERS=${FULL_LAYERS:-8}
compile=${COMPILE:+--compile}

tags=()
e2e() {  # tag, then bench flags
  local tag=$1
  shift
  tags+=("$tag")
  python -m benchmarks.bench_e2e --steps 5 --warmup 2 --tag "$tag" --out "$OUT" "$@" > "$OUT/e2e_$tag.log" 2>&1
  grep -E "^== |^ +[0-9.]+ ms +[0-9.]+%|failed:" "$OUT/e2e_$tag.log"
}

if [[ $parts == *lora* ]]; then
  e2e lora --mode lora --layers 12 --profile
fi
if [[ $parts == *full* ]]; then
  e2e full_fp32 --mode full --layers "$FULL_LAYERS" --master-dtype fp32 $compile
  e2e full_bf16 --mode full --layers "$FULL_LAYERS" --master-dtype bf16 --no-baseline --profile $compile
fi
if [[ $parts == *step1* ]]; then
  e2e lora_cold --mode lora --layers 12 --no-baseline
  e2e lora_warm --mode lora --layers 12 --no-baseline
fi
if [[ $parts == *recompiles* ]]; then
  run_dir=$OUT/recompiles_run
  config=benchmarks/configs/qwen3-30b-a3b-random.yaml
  echo "== recompiles: $config, ${FULL_LAYERS} layers, full fine-tune, compile.enabled, 12 steps"
  TORCH_LOGS=recompiles torchrun --standalone --nproc_per_node 1 -m runtime.launch "$config" --max-steps 12 \
    --output-dir "$run_dir" --set model.num_layers_override="$FULL_LAYERS" --set compile.enabled=true \
    > "$OUT/e2e_recompiles.log" 2>&1 || { echo "run failed:"; tail -n 20 "$OUT/e2e_recompiles.log"; }
  grep -E "Recompiling function|guard failure|^.*- [0-9]+/[0-9]+: " "$OUT/e2e_recompiles.log" | sed "s/^.*__recompiles\] */  /"
  python -m benchmarks.recompiles "$config" "$run_dir/metrics.jsonl"
fi
if [[ $parts == *against* ]]; then
  for round in old1 new old2; do
    tree=$PWD
    [[ $round == old* ]] && tree=$PWD/${OLD:?OLD names the older tree}
    for mode in lora full; do
      tags+=("$mode-$round")
      masters=()
      [ "$mode" = full ] && masters=(--master-dtype bf16)
      (cd "$tree" && PYTHONPATH=/tmp/site:$tree python -m benchmarks.bench_e2e --steps 5 --warmup 2 --mode $mode \
        "${masters[@]}" --no-baseline --tag "$mode-$round" --out "$OUT") > "$OUT/e2e_$mode-$round.log" 2>&1
    done
  done
fi
echo "== summary (tag: side mode ms/step tokens/s MFU peak-GiB model-GiB step-1-s loss1 note)"
for tag in "${tags[@]}"; do
  grep -E "^\w.*\[.*torch|^(ours|baseline) +(lora|full) |^ratio" "$OUT/e2e_$tag.log" | sed "s/^/$tag: /"
done
