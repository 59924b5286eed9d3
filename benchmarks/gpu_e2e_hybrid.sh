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
#
# Parts `peers` and `unsloth` (issue 43's hybrid rows against Unsloth, PEERS_LAYERS layers, 8): LoRA r=16 on
# q,k,v,o and the routed experts, 3 warmup + 9 timed steps. `peers`, in call 2 of the install above: ours and
# transformers+PEFT (bench_e2e), its JSON kept in /tmp/hybrid-peers. `unsloth`, in the next call on the same warm
# machine (same card), carry [".whl-unsloth"] (the GDN wheels and Unsloth's exceed one carry together): Unsloth on
# the same work (benchmarks/peers/unsloth/run_unsloth.sh, MODEL=qwen3.5-35b-a3b: a ~15 GB checkpoint at 8 layers;
# its GDN layers run the fla snapshot Unsloth bundles, its default), then benchmarks/peers_table.py:
#   call 2, carry [".whl", ".whl-gdn2"]: bash benchmarks/gpu_e2e_hybrid.sh peers
#   call 3, carry [".whl-unsloth"]: bash benchmarks/gpu_e2e_hybrid.sh unsloth
# Part `against` (call 2 of the install): ours only, this tree against an older one carried as OLD=<ignored folder>
# (`git archive REV | tar x -C old`), LoRA, rounds old / new / old (AGAINST_ROUNDS), eager unless AGAINST_COMPILE=true,
# after the GDN layer rows (bench_hybrid --gdn-layer).
# Part `kernels` (call 2 of the install): ours, default config, 3 warmup + 2 traced steps, and its kernel split
# (benchmarks/kernel_split.py; its trace kept in /tmp/hybrid-peers). Part `unsloth-kernels` (the next call, carry
# [".whl-unsloth"]): Unsloth's 2 traced steps on the same work, then the split of both side by side.
PEERS_DIR=/tmp/hybrid-peers  # survives between calls while the machine stays warm ($OUT is emptied)
L=${PEERS_LAYERS:-8}
if [ "${1:-}" = unsloth-kernels ]; then
  export OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  echo "== unsloth-kernels: hybrid, $L layers LoRA, Unsloth's 2 traced steps, then the split beside ours"
  MODEL=qwen3.5-35b-a3b TRACE=$OUT/unsloth STEPS=3 T=570 bash benchmarks/peers/unsloth/run_unsloth.sh "$L" experts \
    | grep -E '^\{"who"|rc='
  python3 -m benchmarks.kernel_split ours="$PEERS_DIR/bench_e2e_hybrid_kernels_trace.json.gz" \
    unsloth="$OUT/unsloth.experts.json.gz" --steps 2 | tee "$OUT/kernel_split_hybrid.md"
  exit 0
fi
if [ "${1:-}" = unsloth ]; then
  export OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  echo "== unsloth: hybrid, $L layers LoRA, then the table"
  MODEL=qwen3.5-35b-a3b T=570 bash benchmarks/peers/unsloth/run_unsloth.sh "$L" experts | tee "$OUT/unsloth_peers.txt"
  python3 -m benchmarks.peers_table --e2e "$PEERS_DIR/bench_e2e_hybrid_peers.json" --unsloth "$OUT/unsloth_peers.txt"
  exit 0
fi
source benchmarks/gpu_env_gdn.sh
if [ "${1:-}" = against ]; then
  echo "== against: the GDN layer rows, then hybrid $L layers LoRA, ours: ${OLD:?OLD names the older tree} vs this tree"
  python -m benchmarks.bench_hybrid --gdn-layer --out "$OUT" 2>&1 | tee "$OUT/gdn_layer_bench.log" | tail -n 7
  cp benchmarks/bench_e2e.py "$OLD/benchmarks/bench_e2e.py"
  root=$PWD
  for round in ${AGAINST_ROUNDS:-old1 new old2}; do
    tree=$root
    [[ $round == old* ]] && tree=$root/$OLD
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 300 python -m benchmarks.bench_e2e --preset qwen3.5-35b-a3b \
      --mode lora --layers "$L" --warmup 2 --steps 5 --no-baseline --set compile.enabled=${AGAINST_COMPILE:-false} \
      --tag "hybrid_$round" --out "$OUT") > "$OUT/e2e_hybrid_$round.log" 2>&1 || echo "$round: exit code $?"
    echo "$round $(grep -E '^ours +lora ' "$OUT/e2e_hybrid_$round.log")"
  done
  exit 0
fi
if [ "${1:-}" = kernels ]; then
  echo "== kernels: hybrid, $L layers LoRA, ours (default config), 2 traced steps"
  mkdir -p "$PEERS_DIR"
  timeout 570 python -m benchmarks.bench_e2e --preset qwen3.5-35b-a3b --mode lora --layers "$L" --warmup 3 --steps 3 \
    --no-baseline --profile --tag hybrid_kernels --out "$OUT" > "$OUT/e2e_hybrid_kernels.log" 2>&1 \
    || echo "bench_e2e exit code $? (124: past 570 s)"
  grep -E "^ours|GPU busy|failed:" "$OUT/e2e_hybrid_kernels.log"
  cp "$OUT/bench_e2e_hybrid_kernels_trace.json.gz" "$PEERS_DIR/"
  python -m benchmarks.kernel_split ours="$OUT/bench_e2e_hybrid_kernels_trace.json.gz" --steps 2 \
    | tee "$OUT/kernel_split_hybrid.md"
  exit 0
fi
if [ "${1:-}" = peers ]; then
  echo "== peers: hybrid, $L layers LoRA: ours and transformers+PEFT (bench_e2e)"
  mkdir -p "$PEERS_DIR"
  timeout 570 python -m benchmarks.bench_e2e --preset qwen3.5-35b-a3b --mode lora --layers "$L" --warmup 3 --steps 9 \
    --tag hybrid_peers --out "$OUT" > "$OUT/e2e_hybrid_peers.log" 2>&1 || echo "bench_e2e exit code $? (124: past 570 s)"
  grep -E "^(ours|baseline) +lora |^ratio|failed:" "$OUT/e2e_hybrid_peers.log"
  cp "$OUT/bench_e2e_hybrid_peers.json" "$PEERS_DIR/"
  exit 0
fi
for mode in ${MODES:-lora}; do
  python -m benchmarks.bench_e2e --preset qwen3.5-35b-a3b --mode "$mode" --layers "${LAYERS:-8}" --steps 5 --warmup 2 \
    --tag "hybrid_$mode" --out "$OUT" > "$OUT/e2e_hybrid_$mode.log" 2>&1
  grep -E "failed:" "$OUT/e2e_hybrid_$mode.log"
done
echo "== summary (side mode ms/step b2b-ms tokens/s MFU peak-GiB model-GiB step-1-s loss1 note)"
for mode in ${MODES:-lora}; do
  grep -E "^\w.*\[.*torch|^(ours|baseline) +(lora|full) |^ratio" "$OUT/e2e_hybrid_$mode.log"
done
