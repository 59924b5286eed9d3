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
#         reasons (TORCH_LOGS=recompiles), and PASS when the run recompiled at most twice; the mean step after the
#         first against the median. RECOMPILE_STEPS=100 RECOMPILE_LORA=1: issue 43's 100-step LoRA run (mean within
#         5% of the median); RECOMPILE_EP=N: on N GPUs at ep=N (random routing: the all_gather bound may grow)
#   against  ours only, this tree against an older one carried as OLD=<ignored folder> (`git archive REV | tar x -C
#         old`, carry [".whl", "old"]): LoRA 12 layers and full 8 layers (bf16 masters), old then new then old
#         again, so drift between the runs shows. Both trees run this tree's bench_e2e.py (copied into OLD), so
#         both have its columns (back-to-back ms); OLD must have runtime.step's queued step (9493972 or later)
#   sync  the sync-free step's GPU tests: no host sync in a steady step (tests/gpu/test_step_sync_gpu.py), a
#         non-finite step skipped on the device (tests/unit/test_step.py, test_optim.py: CUDA cases), the one-node
#         LoRALinear under CUDA autocast (tests/unit/test_lora.py: CUDA case), train.graph_step's replayed steps
#         against eager ones (tests/gpu/test_graph_step_gpu.py)
#   kernels  issue 43's profile: ours (eager, then compiled) and Unsloth at PEERS_LAYERS (8) layers, 2 traced steps
#         each after 3 warmup + 3 timed, benchmarks/kernel_split.py's table of kernel classes (forward / backward)
#         and each side's largest kernels (carry [".whl", ".whl-unsloth"], as peers)
#   peers  issue 43's LoRA peers at PEERS_LAYERS (8) layers, in this order in one call: ours (default config) and
#         transformers+PEFT (bench_e2e, as `lora` but 3 warmup + 9 timed steps, no profile), then Unsloth on the same
#         work (benchmarks/peers/unsloth/run_unsloth.sh: wheels, a random-init checkpoint ~11 GB at 8 layers, ~1 min,
#         step 1 compiles ~50 s), then benchmarks/peers_table.py's markdown table (ratios, issue 43's targets). Run
#         it alone: it budgets the call's 600 s (bench_e2e at most 300 s, Unsloth what is left up to 580 s from the
#         start). Same on all three: dims, the 8192 token ids (bench_e2e.token_ids), bf16 base, LoRA r=16 alpha=32
#         on q,k,v,o + experts, micro-batch 1, no AC, bf16 autocast, grad clip 1.0, fused AdamW lr 1e-5 betas
#         (0.9, 0.95), 3 warmup + 9 steps each between CUDA events from an idle GPU, their median (steps 4-12),
#         peak = max allocated over the whole process. Differences: Unsloth loads a seed-0 bf16 checkpoint (ours
#         and PEFT init in place, so the random weights differ); Unsloth gives the fused gate_up rank 2r (r for gate,
#         r for up: seen through its CPU fallback) where ours and PEFT give it r, so it trains more (the table's
#         `trains M` column); the LoRA dtypes are each side's own (notes). Needs .whl-unsloth, made where PyPI is
#         reachable by `bash benchmarks/peers/unsloth/wheels.sh`; carry [".whl", ".whl-unsloth"].
# One device call, carry [".whl"] (pydantic and the rest the image lacks): `bash benchmarks/gpu_e2e.sh`
# (~1 min per side: imports, build, 7 steps).
# Parts: `bash benchmarks/gpu_e2e.sh [lora] [full] [step1] [recompiles] [against] [peers] [kernels] [sync]`.
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
  ep=${RECOMPILE_EP:-1}
  echo "== recompiles: $config, ${FULL_LAYERS} layers, ${RECOMPILE_LORA:+LoRA}${RECOMPILE_LORA:-full fine-tune}, compile.enabled, ${RECOMPILE_STEPS:-12} steps, ep $ep"
  TORCH_LOGS=recompiles torchrun --standalone --nproc_per_node "$ep" -m runtime.launch "$config" --ep "$ep" \
    --max-steps "${RECOMPILE_STEPS:-12}" ${RECOMPILE_LORA:+--set lora.enabled=true --set optim.master_dtype=fp32} \
    --output-dir "$run_dir" --set model.num_layers_override="$FULL_LAYERS" --set compile.enabled=true \
    > "$OUT/e2e_recompiles.log" 2>&1 || { echo "run failed:"; tail -n 20 "$OUT/e2e_recompiles.log"; }
  grep -E "Recompiling function|guard failure|^.*- [0-9]+/[0-9]+: " "$OUT/e2e_recompiles.log" | sed "s/^.*__recompiles\] */  /"
  grep -E "gather_capacity" "$OUT/e2e_recompiles.log" | head -n 4  # a bounded all_gather grown (EP)
  python -m benchmarks.recompiles "$config" "$run_dir/metrics.jsonl" --dp-world "$ep"
fi
if [[ $parts == *sync* ]]; then
  echo "== sync: the step's GPU tests"
  python -m pytest -q -m gpu tests/gpu/test_step_sync_gpu.py tests/gpu/test_graph_step_gpu.py tests/unit/test_step.py \
    tests/unit/test_optim.py tests/unit/test_lora.py -p no:cacheprovider \
    > "$OUT/e2e_sync.log" 2>&1
  grep -E "passed|failed|^E |^FAILED" "$OUT/e2e_sync.log" | head -30
fi
if [[ $parts == *against* ]]; then
  cp benchmarks/bench_e2e.py "${OLD:?OLD names the older tree}/benchmarks/bench_e2e.py"
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
if [[ $parts == *kernels* ]]; then
  PEERS_LAYERS=${PEERS_LAYERS:-8}
  echo "== kernels: $PEERS_LAYERS layers LoRA, 2 traced steps each: ours eager, ours compiled, Unsloth"
  for c in eager compiled; do
    timeout 200 python -m benchmarks.bench_e2e --mode lora --layers "$PEERS_LAYERS" --warmup 3 --steps 3 --no-baseline \
      --profile --tag "k$c" --out "$OUT" --set compile.enabled=$([ "$c" = compiled ] && echo true || echo false) > "$OUT/e2e_k$c.log" 2>&1
    grep -E "^ours|GPU busy" "$OUT/e2e_k$c.log"
  done
  TRACE=$OUT/unsloth STEPS=3 T=$(( 580 - SECONDS )) bash benchmarks/peers/unsloth/run_unsloth.sh "$PEERS_LAYERS" experts \
    | grep -E '^\{"who"|rc='
  python -m benchmarks.kernel_split ours="$OUT/bench_e2e_keager_trace.json.gz" \
    ours-compiled="$OUT/bench_e2e_kcompiled_trace.json.gz" unsloth="$OUT/unsloth.experts.json.gz" --steps 2 \
    | tee "$OUT/kernel_split.md"
fi
if [[ $parts == *peers* ]]; then
  PEERS_LAYERS=${PEERS_LAYERS:-8}
  echo "== peers: $PEERS_LAYERS layers LoRA: ours and transformers+PEFT (bench_e2e), then Unsloth, then the table"
  tags+=(peers)
  timeout 300 python -m benchmarks.bench_e2e --mode lora --layers "$PEERS_LAYERS" --warmup 3 --steps 9 --tag peers \
    --out "$OUT" > "$OUT/e2e_peers.log" 2>&1 || echo "bench_e2e exit code $? (124: past its 300 s)"
  grep -E "^== |failed:" "$OUT/e2e_peers.log"
  echo "[bench_e2e done at $SECONDS s]"
  T=$(( 580 - SECONDS )) bash benchmarks/peers/unsloth/run_unsloth.sh "$PEERS_LAYERS" experts | tee "$OUT/unsloth_peers.txt"
  python -m benchmarks.peers_table --e2e "$OUT/bench_e2e_peers.json" --unsloth "$OUT/unsloth_peers.txt"
fi
echo "== summary (tag: side mode ms/step b2b-ms tokens/s MFU peak-GiB model-GiB step-1-s loss1 note)"
for tag in "${tags[@]}"; do
  grep -E "^\w.*\[.*torch|^(ours|baseline) +(lora|full) |^ratio" "$OUT/e2e_$tag.log" | sed "s/^/$tag: /"
done
