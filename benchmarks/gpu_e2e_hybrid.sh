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
# q,k,v,o and the routed experts. `peers`: ours and transformers+PEFT (bench_e2e, 3 warmup + 9 timed steps), its
# JSON kept in /tmp/hybrid-peers for the next part. `unsloth`: Unsloth on the same work
# (benchmarks/peers/unsloth/run_unsloth.sh, MODEL=qwen3.5-35b-a3b: a ~15 GB checkpoint at 8 layers; its GDN layers
# run fla from /tmp/site-fla, which holds fla and TileLang alone, so that Unsloth sees what it sees in the
# Qwen3-30B-A3B rows and not our /tmp/site's torchao, liger and cut-cross-entropy), then benchmarks/peers_table.py.
# Step 1 compiles for minutes on each side (TileLang, inductor), so the two parts may not fit one 600 s call: run
# them in two calls back to back on the same warm machine (same card), or together where they fit. The Unsloth wheels
# join the carry, so the GDN wheels come one call each, installed by part `install` into both folders:
#   call 1, carry [".whl-gdn1"]: bash benchmarks/gpu_e2e_hybrid.sh install
#   call 2, carry [".whl-gdn2"]: bash benchmarks/gpu_e2e_hybrid.sh install
#   call 3, carry [".whl", ".whl-unsloth"]: bash benchmarks/gpu_e2e_hybrid.sh peers
#   call 4, carry [".whl", ".whl-unsloth"]: bash benchmarks/gpu_e2e_hybrid.sh unsloth
FLA_SITE=/tmp/site-fla
if [ "${1:-}" = install ]; then
  for d in .whl-gdn1 .whl-gdn2; do
    [ -d "$d" ] || continue
    for site in /tmp/site "$FLA_SITE"; do
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$d"/*.whl || exit 1
    done
    echo "installed $d into /tmp/site and $FLA_SITE"
  done
  exit 0
fi
source benchmarks/gpu_env_gdn.sh
PEERS_DIR=/tmp/hybrid-peers  # survives between calls while the machine stays warm ($OUT is emptied)
L=${PEERS_LAYERS:-8}
if [[ " $* " == *" peers "* ]]; then
  echo "== peers: hybrid, $L layers LoRA: ours and transformers+PEFT (bench_e2e)"
  mkdir -p "$PEERS_DIR"
  budget=$(( 570 - SECONDS ))
  [[ " $* " == *" unsloth "* ]] && budget=300  # leave Unsloth the rest of the call
  timeout "$budget" python -m benchmarks.bench_e2e --preset qwen3.5-35b-a3b --mode lora --layers "$L" \
    --warmup 3 --steps 9 --tag hybrid_peers --out "$OUT" > "$OUT/e2e_hybrid_peers.log" 2>&1 ||
    echo "bench_e2e exit code $? (124: past the call's time)"
  grep -E "^(ours|baseline) +lora |^ratio|failed:" "$OUT/e2e_hybrid_peers.log"
  cp "$OUT/bench_e2e_hybrid_peers.json" "$PEERS_DIR/" 2>/dev/null
  echo "[bench_e2e done at $SECONDS s]"
fi
if [[ " $* " == *" unsloth "* ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$FLA_SITE" \
    .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl || exit 1
  ls -d "$FLA_SITE"/tilelang* "$FLA_SITE"/z3* >/dev/null 2>&1 ||
    { echo "error: $FLA_SITE lacks TileLang or z3: run calls 1 and 2 of part install (see header)"; exit 1; }
  echo "== unsloth: hybrid, $L layers LoRA, then the table"
  MODEL=qwen3.5-35b-a3b FLA_SITE=$FLA_SITE T=$(( 580 - SECONDS )) bash benchmarks/peers/unsloth/run_unsloth.sh "$L" \
    experts | tee "$OUT/unsloth_peers.txt"
  python -m benchmarks.peers_table --e2e "$PEERS_DIR/bench_e2e_hybrid_peers.json" --unsloth "$OUT/unsloth_peers.txt"
fi
[[ " $* " == *" peers "* || " $* " == *" unsloth "* ]] && exit 0
for mode in ${MODES:-lora}; do
  python -m benchmarks.bench_e2e --preset qwen3.5-35b-a3b --mode "$mode" --layers "${LAYERS:-8}" --steps 5 --warmup 2 \
    --tag "hybrid_$mode" --out "$OUT" > "$OUT/e2e_hybrid_$mode.log" 2>&1
  grep -E "failed:" "$OUT/e2e_hybrid_$mode.log"
done
echo "== summary (side mode ms/step b2b-ms tokens/s MFU peak-GiB model-GiB step-1-s loss1 note)"
for mode in ${MODES:-lora}; do
  grep -E "^\w.*\[.*torch|^(ours|baseline) +(lora|full) |^ratio" "$OUT/e2e_hybrid_$mode.log"
done
