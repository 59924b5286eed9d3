#!/usr/bin/env bash
# Multi-GPU runs of issue 22 on one node of 2-8 GPUs (NCCL), in one device call per part, carry [".whl"]
# (the hybrid verify runs GDN on the torch op set: the carried fla needs tilelang on Hopper, see gpu_e2e_hybrid.sh):
#   bash benchmarks/gpu_multi.sh [verify] [throughput] [scaling] [bandwidth] [gathers] [ceiling] [profile] [hostbound] [epbench] [graphstep] [deepep]
#   verify      runtime.verify (bf16 bounds, calibrated by an fp32 run) on the tiny example: ep=N; dp_shard=N x ep=2; LoRA on and off
#               (at ep=N also on a bf16 base: the layout without any FSDP unit);
#               cp=2; cp=2 x ep=2 (Ulysses too); a Qwen3.5-MoE hybrid at cp=2 (GDN heads, GDN state); FP4 and FP8
#               experts at ep=2 (LoRA), FP8 training at ep=2 (experts+dense); --exact (fp32, plain kernels, fp32 bounds) at ep=2, ep=N and for the hybrids;
#               then a resume on another ep (ep=2 -> ep=N); ONLY=REGEX keeps the verify cases (and `resume`) and the
#               training rows of every part whose tag matches (e.g. ONLY="mxfp4|lora-ep4-compiled")
#   throughput  Qwen3-30B-A3B real dims, all 48 layers, random init, rows of 8192, ep=N, full (bf16 masters,
#               selective AC) and LoRA (no AC; eager and compiled): tokens/s/GPU, MFU, peak GiB from metrics.jsonl
#               (median of steps 4-12); on cards of
#               >= 120 GiB also full without activation checkpointing (estimated 94 GiB per rank at ep=4)
#   scaling     the same model at 8 layers, ep = 1, 2, 4, ... N on as many GPUs, one row per GPU: weak scaling
#               (SCALING_EPS="2 4": those only), without activation checkpointing (SCALING_AC=selective: with),
#               eager (SCALING_COMPILE=1: compiled)
#   bandwidth   bench_ep: dispatch+combine against NCCL all_to_all bus bandwidth in the same run
#   gathers     FSDP's fp32 gathers against bf16 (parallelism.fsdp_param_dtype): 8 layers, full, fp32 masters, ep=2 and
#               dp_shard=2, on 2 GPUs
#   ceiling     the per-GPU ceiling of ep=N: the model at ep=1 with 4 and 8 layers, full and LoRA, no checkpointing,
#               side by side (one GPU each); the step's slope per layer extrapolates ep=1 to all 48 layers
#   profile     the model at 8 layers, full fine-tune, no checkpointing, ep=1 and ep=N (PROFILE_EPS), step 6 traced
#               (profiling.steps): rank 0's summary (wall, kernel share, host syncs, the compute stream's idle
#               gaps by cause: runtime.timeline), every rank's gap summary and who waited for whom at the
#               collectives (runtime.timeline --skew); traces under $OUT/profile-*/profile
#   hostbound   issue 17 item 6 under EP: the model at 8 layers, no checkpointing, ep=N, full and LoRA
#               (HOSTBOUND_MODES), eager / compiled; HOSTBOUND_GRAPHS=1: LoRA also with inductor's CUDA graphs
#               (the regions of static shape around the token exchange)
#   epbench     issue 42's table: 8 layers (EPBENCH_LAYERS), no checkpointing, compile.enabled auto (LoRA
#               compiled at ep1 and at ep = N on all_gather, the rest eager), ep=1 against ep=N on the same
#               machine in one call, each with forced-balanced routing (model.router_force_balanced) and the random-init router; modes
#               EPBENCH_MODES (default "full-fp32 lora"; also full-bf16, and "<mode>-compiled", "<mode>-eager",
#               "<mode>-graphs": compiled with inductor's CUDA graphs, "<mode>-graphstep": compiled, the whole step
#               replayed from CUDA graphs, train.graph_step); EPBENCH_EPS (default 1 2 4 .. N);
#               EPBENCH_ROUTING (default "balanced random"); EPBENCH_DISPATCHERS (default auto; e.g.
#               "all_to_all all_gather": a row per dispatcher at every ep > 1); EPBENCH_OLD=<ignored folder
#               holding an older tree, carried>: every ep > 1 run also from that tree, as `<mode>+old` (its
#               ratio against this tree's ep1); runs are packed side by side onto free GPUs in order; every run
#               traces step 6: per layer the experts' kernels, the exchange, the host gaps and idle GPU (runtime.timeline)
#   graphstep   issue 42's probe (benchmarks/bench_graph_step.py): the 8-layer LoRA step (forced-balanced, no
#               checkpointing) queued as the trainer queues it against the same step captured whole in one CUDA
#               graph, eager and compiled, at ep=1 (side by side) and ep=N: how much of the EP step is host work
#               (GRAPHSTEP_LIMIT: seconds per run, default 240; GRAPHSTEP_DATA=config: the config's first packed
#               row of chat data instead of one random document)
#   deepep      the 8-layer full fine-tune step at ep=N, no checkpointing, on DeepEP's dispatcher, and verify at ep=N
#               with it (carry .whl-deepep)
# CUDA_VISIBLE_DEVICES=2,3: the call uses those cards only (N = their count), other parts may run on the rest.
# COMPILED_LIMIT: the compiled LoRA row's own limit in seconds (default 360; RUN_LIMIT for the others).
# SETS="key=value ...": config overrides for every training run of the call (e.g. SETS="train.max_steps=30
# train.gc_every_n_steps=0"); the rows are the median of steps 4 to the end.
# Logs under $OUT, packed at the end into $OUT/gpu_multi_<parts>.tgz; the summary table comes last.
source benchmarks/gpu_env.sh
# the cards this call may use: CUDA_VISIBLE_DEVICES's (so a call can run other parts on the rest), else all
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a CARDS <<< "$CUDA_VISIBLE_DEVICES"
else mapfile -t CARDS < <(seq 0 $(($(nvidia-smi -L | wc -l) - 1))); fi
N=${#CARDS[@]}
cards() { local IFS=,; echo "${CARDS[*]:$1:$2}"; }  # first, count: those cards, as CUDA_VISIBLE_DEVICES
parts=${*:-verify throughput scaling bandwidth}
TINY=examples/tiny-qwen3-moe.yaml
BIG=benchmarks/configs/qwen3-30b-a3b-random.yaml
summary=()

verify() {  # tag, world, then runtime.verify flags
  local tag=$1 world=$2
  shift 2
  [ "$world" -le "$N" ] || { summary+=("verify $tag: skipped (needs $world GPUs)"); return; }
  [[ $tag =~ ${ONLY:-.} ]] || return 0
  timeout 240 torchrun --standalone --nproc_per_node "$world" -m runtime.verify "$@" --steps 3 > "$OUT/verify_$tag.log" 2>&1
  local rc=$?
  summary+=("verify $tag: $(grep -Eo 'PASS|FAIL' "$OUT/verify_$tag.log" | tail -n 1) (rc $rc)")
}

tokens_row() {  # tag, world, run dir: median tok/s/GPU, MFU, EP load imbalance and host skew; peak GiB over steps 4..
  python - "$1" "$2" "$3" <<'PY'
import json, statistics, sys
tag, world, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"loss"' in l]
steady = [r for r in rows if r["step"] >= 4] or rows
tps = statistics.median(r["tok_s"] for r in steady) / world
mfu = statistics.median(r.get("mfu") or 0 for r in steady)
peak = max(r.get("peak_mem_gib") or 0 for r in rows)
imbalance = [r["ep_imbalance"] for r in steady if r.get("ep_imbalance")]
busiest = f"  EP busiest/mean {statistics.median(imbalance):.2f}" if imbalance else ""
skew = [(r["ep_host_skew_s"], r["ep_slowest_host"]) for r in steady if "ep_host_skew_s" in r]
if skew:  # the hosts ahead waited this long per step for the one behind (moe/dispatch/load.py)
    step_s = statistics.median(r["step_s"] for r in steady)
    slowest = statistics.mode(rank for _, rank in skew)
    busiest += (f"  host skew {statistics.median(s for s, _ in skew) * 1e3:.0f} ms of {step_s * 1e3:.0f}"
                f" (slowest host: EP rank {slowest})")
print(f"{tag}: {tps:,.0f} tok/s/GPU  MFU {mfu:.3f}  peak {peak:.1f} GiB{busiest}  ({len(rows)} steps)")
PY
}

launch_run() {  # tag, world, then runtime.launch flags (then SETS' overrides): the run into $OUT/tag, its log
  local tag=$1 world=$2 override
  shift 2
  rm -rf "$OUT/$tag"
  for override in ${SETS:-}; do set -- "$@" --set "$override"; done
  timeout "${RUN_LIMIT:-300}" torchrun --standalone --nproc_per_node "$world" -m runtime.launch "$BIG" --output-dir "$OUT/$tag" "$@" \
    > "$OUT/$tag.log" 2>&1
}

train_run() {  # tag, world, then runtime.launch flags: launch_run, then its row in the summary
  local tag=$1 world=$2
  [[ $tag =~ ${ONLY:-.} ]] || return 0
  [ "$world" -le "$N" ] || { summary+=("$tag: skipped (needs $world GPUs)"); return; }
  launch_run "$@" && summary+=("$(tokens_row "$tag" "$world" "$OUT/$tag")") \
    || summary+=("$tag: failed, see $tag.log: $(grep -E '^error' "$OUT/$tag.log" | head -n 1)")
}

if [[ $parts == *verify* ]]; then
  verify "ep$N" "$N" --ep "$N" "$TINY"
  [ "$N" -gt 2 ] && verify ep2 2 --ep 2 "$TINY"
  verify "ep$N-lora" "$N" --ep "$N" "$TINY" --set lora.enabled=true
  # a bf16 base: at ep = world no FSDP unit at all (the tiny example's fp32 base gets expert units, cast to bf16)
  verify "ep$N-lora-bf16base" "$N" --ep "$N" "$TINY" --set lora.enabled=true --set model.dtype=bfloat16
  verify "fsdp$N-ep2" "$N" --ep 2 "$TINY"
  verify "fsdp$N-ep2-lora" "$N" --ep 2 "$TINY" --set lora.enabled=true
  verify cp2 2 --cp 2 "$TINY"
  verify cp2-ep2 4 --cp 2 --ep 2 "$TINY"
  verify cp2-ep2-ulysses 4 --cp 2 --ep 2 "$TINY" --set parallelism.cp_attention=ulysses
  hybrid="model.config={model_type: qwen3_5_moe_text, vocab_size: 520, hidden_size: 64, num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, moe_intermediate_size: 32, shared_expert_intermediate_size: 48, num_experts: 8, num_experts_per_tok: 2, linear_num_key_heads: 2, linear_num_value_heads: 4, linear_key_head_dim: 16, linear_value_head_dim: 16, linear_conv_kernel_dim: 4, max_position_embeddings: 256, layer_types: [linear_attention, full_attention, linear_attention, full_attention]}"
  verify hybrid-cp2 2 --cp 2 "$TINY" --set model.gdn_op_set=torch --set "$hybrid"
  verify hybrid-cp2-state 2 --cp 2 "$TINY" --set model.gdn_op_set=torch --set parallelism.cp_gdn=state --set "$hybrid"
  # --exact: both runs in fp32 on the plain kernels, fp32 bounds: the parallelism alone, apart from bf16 rounding
  verify ep2-exact 2 --ep 2 "$TINY" --exact
  verify "ep$N-exact" "$N" --ep "$N" "$TINY" --exact
  verify hybrid-cp2-exact 2 --cp 2 "$TINY" --set "$hybrid" --exact
  verify hybrid-cp2-state-exact 2 --cp 2 "$TINY" --set parallelism.cp_gdn=state --set "$hybrid" --exact
  # FSDP's gathers (parallelism.fsdp_param_dtype): bf16 under EP (auto there is fp32), fp32 at cp=2 (auto: bf16)
  verify ep2-bf16gathers 2 --ep 2 "$TINY" --set parallelism.fsdp_param_dtype=bf16
  fp32=(--set parallelism.fsdp_param_dtype=fp32)
  verify hybrid-cp2-fp32gathers 2 --cp 2 "$TINY" --set model.gdn_op_set=torch --set "$hybrid" "${fp32[@]}"
  verify hybrid-cp2-state-fp32gathers 2 --cp 2 "$TINY" --set model.gdn_op_set=torch --set parallelism.cp_gdn=state \
    --set "$hybrid" "${fp32[@]}"
  verify nvfp4-ep2 2 --ep 2 "$TINY" --set lora.enabled=true --set quant.base_weights=nvfp4
  verify mxfp4-ep2 2 --ep 2 "$TINY" --set lora.enabled=true --set quant.base_weights=mxfp4
  verify fp8-ep2 2 --ep 2 "$TINY" --set lora.enabled=true --set quant.base_weights=fp8
  verify fp8train-ep2 2 --ep 2 "$TINY" --set quant.train_fp8=experts+dense
  # resume on another ep: 2 steps at ep=2, then resume the same run folder at ep=N
  if [[ resume =~ ${ONLY:-.} ]]; then
    rm -rf "$OUT/reshard"
    short=(--set optim.warmup_steps=1)
    timeout 180 torchrun --standalone --nproc_per_node 2 -m runtime.launch --ep 2 "$TINY" --max-steps 2 "${short[@]}" \
      --output-dir "$OUT/reshard" > "$OUT/reshard_a.log" 2>&1
    timeout 180 torchrun --standalone --nproc_per_node "$N" -m runtime.launch --ep "$N" "$TINY" --max-steps 4 --resume \
      "${short[@]}" --output-dir "$OUT/reshard" > "$OUT/reshard_b.log" 2>&1
    summary+=("resume ep2 -> ep$N: rc $? $(grep -c '"loss"' "$OUT/reshard/metrics.jsonl") steps logged")
  fi
fi
if [[ $parts == *throughput* ]]; then
  train_run "full-ep$N" "$N" --ep "$N"
  # LoRA without checkpointing (estimated 62 GiB per rank at ep=4): selective costs 1.3-1.6x (docs/benchmarks.md)
  train_run "lora-ep$N" "$N" --ep "$N" --set lora.enabled=true --set optim.master_dtype=fp32 \
    --set parallelism.activation_checkpoint=none
  # the LoRA step under EP is host-bound (its layer enqueues longer than it computes): compile took it 1.18x at ep2
  # Inductor's first compile of 48 layers takes over 140 s on a fresh machine (cut there on 2026-11-27)
  RUN_LIMIT=${COMPILED_LIMIT:-360} train_run "lora-ep$N-compiled" "$N" --ep "$N" --set lora.enabled=true \
    --set optim.master_dtype=fp32 --set parallelism.activation_checkpoint=none --set compile.enabled=true
  gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
  [ "$gib" -ge $((120 * 1024)) ] && train_run "full-ep$N-noac" "$N" --ep "$N" \
    --set parallelism.activation_checkpoint=none
fi
if [[ $parts == *scaling* ]]; then
  for ep in ${SCALING_EPS:-1 2 4 8}; do
    [ "$ep" -le "$N" ] && train_run "scaling-ep$ep${SCALING_COMPILE:+-compiled}" "$ep" --ep "$ep" \
      --set model.num_layers_override=8 --set "parallelism.activation_checkpoint=${SCALING_AC:-none}" \
      ${SCALING_COMPILE:+--set compile.enabled=true}
  done
fi
if [[ $parts == *bandwidth* ]]; then
  torchrun --standalone --nproc_per_node "$N" -m benchmarks.bench_ep --out "$OUT" > "$OUT/bench_ep.log" 2>&1
  summary+=("bench_ep: $(tail -n 3 "$OUT/bench_ep.log" | tr '\n' ' ')")
fi
if [[ $parts == *gathers* ]]; then
  # the cost of fp32 gathers (parallelism.fsdp_param_dtype): 8 layers, full fine-tune with fp32 masters, no
  # checkpointing, ep=2 and plain FSDP (dp_shard=2: the experts join each block's unit), bf16 then fp32 gathers
  for mesh in ep2 fsdp2; do
    flags=(--set model.num_layers_override=8 --set parallelism.activation_checkpoint=none --set optim.master_dtype=fp32)
    [ "$mesh" = ep2 ] && flags+=(--ep 2)
    for gathers in bf16 fp32; do
      train_run "gathers-$mesh-$gathers" 2 "${flags[@]}" --set "parallelism.fsdp_param_dtype=$gathers"
    done
  done
fi
if [[ $parts == *ceiling* ]]; then
  # at ep=N each rank computes as many expert slots as at ep=1, so ep=1's step, extrapolated to 48 layers, bounds
  # the tok/s/GPU of ep=N; the step is a + b x layers: the 4- and 8-layer runs give both
  runs=0
  for mode in full lora; do
    for layers in 4 8; do
      tag=ceiling-$mode-L$layers
      [[ $tag =~ ${ONLY:-.} ]] || continue
      (( runs > 0 && runs % N == 0 )) && wait  # one run per GPU at a time
      extra=()
      [ "$mode" = lora ] && extra=(--set lora.enabled=true --set optim.master_dtype=fp32)
      CUDA_VISIBLE_DEVICES=$(cards $((runs % N)) 1) launch_run "$tag" 1 --set model.num_layers_override=$layers \
        --set parallelism.activation_checkpoint=none "${extra[@]}" &
      runs=$((runs + 1))
    done
  done
  wait
  summary+=("$(python - "$OUT" <<'PY'
import json, statistics, sys
def steady(tag):  # median step seconds and tokens per step over steps 4.., or None
    try:
        rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{tag}/metrics.jsonl") if '"loss"' in l]
    except OSError:
        return None, None
    rows = [r for r in rows if r["step"] >= 4]
    if not rows:
        return None, None
    return statistics.median(r["step_s"] for r in rows), statistics.median(r["tok_s"] * r["step_s"] for r in rows)
for mode in ("full", "lora"):
    (s4, tokens), (s8, _) = steady(f"ceiling-{mode}-L4"), steady(f"ceiling-{mode}-L8")
    if s4 is None or s8 is None:
        print(f"ceiling {mode}: a run failed, see ceiling-{mode}-L*.log")
        continue
    per_layer = (s8 - s4) / 4
    s48 = s4 + 44 * per_layer
    print(f"ceiling {mode} ep1: {s4 * 1e3:.0f} / {s8 * 1e3:.0f} ms at 4 / 8 layers, {per_layer * 1e3:.1f} ms per layer,"
          f" 48 layers {s48 * 1e3:.0f} ms = {tokens / s48:,.0f} tok/s/GPU")
PY
)")
fi
if [[ $parts == *profile* ]]; then
  # the 8-layer model, full fine-tune, no checkpointing, at ep=1 and ep=N: where the ep=N step loses its time
  traced=(--set model.num_layers_override=8 --set parallelism.activation_checkpoint=none --set "profiling.steps=[6]"
          --set train.max_steps=8)
  mkdir -p /tmp/traces
  for ep in ${PROFILE_EPS:-1 $N}; do
    train_run "profile-full8-ep$ep" "$ep" --ep "$ep" "${traced[@]}"
  done
  for ep in ${PROFILE_EPS:-1 $N}; do
    folder=$OUT/profile-full8-ep$ep/profile
    for rank in $(seq 0 $((ep - 1))); do
      head -n 3 "$folder/step6_rank$rank.txt" 2>/dev/null | cut -c1-200 | sed "s/^/rank $rank: /"
      cp "$folder/step6_rank$rank.json.gz" "/tmp/traces/trace-full8-ep$ep-rank$rank.json.gz" 2>/dev/null
    done
    [ "$ep" -gt 1 ] && python -m runtime.timeline --skew "$folder"/step6_rank*.json.gz
  done
fi
if [[ $parts == *hostbound* ]]; then
  eight=(--ep "$N" --set model.num_layers_override=8 --set parallelism.activation_checkpoint=none)
  lora=(--set lora.enabled=true --set optim.master_dtype=fp32)
  for mode in ${HOSTBOUND_MODES:-full lora}; do
    extra=()
    [ "$mode" = lora ] && extra=("${lora[@]}")
    train_run "${mode}8-ep$N-eager" "$N" "${eight[@]}" "${extra[@]}"
    train_run "${mode}8-ep$N-compiled" "$N" "${eight[@]}" "${extra[@]}" --set compile.enabled=true
  done
  [ -n "${HOSTBOUND_GRAPHS:-}" ] && train_run "lora8-ep$N-cudagraphs" "$N" "${eight[@]}" "${lora[@]}" \
    --set compile.enabled=true --set "compile.inductor_options={triton.cudagraphs: true}"
fi
if [[ $parts == *epbench* ]]; then
  layers=${EPBENCH_LAYERS:-8}
  eps=${EPBENCH_EPS:-$(for ((ep = 1; ep <= N; ep *= 2)); do echo $ep; done)}
  queue=()  # "world<TAB>tag<TAB>tree<TAB>flags" of every run, packed onto the GPUs below
  for mode in ${EPBENCH_MODES:-full-fp32 lora}; do
    flags="--set model.num_layers_override=$layers --set parallelism.activation_checkpoint=none"
    flags+=" --set train.max_steps=${EPBENCH_STEPS:-16} --set profiling.steps=[6]"
    case $mode in
      full-bf16*) flags+=" --set optim.master_dtype=bf16" ;;
      full-fp32*) flags+=" --set optim.master_dtype=fp32" ;;
      lora*) flags+=" --set lora.enabled=true --set optim.master_dtype=fp32" ;;
    esac
    [[ $mode == *-compiled ]] && flags+=" --set compile.enabled=true"
    [[ $mode == *-eager ]] && flags+=" --set compile.enabled=false"  # auto compiles LoRA (runtime.plan.auto_compile)
    # inductor's CUDA graphs: the benchmark's rows are one document each, so every compiled region keeps its shapes
    [[ $mode == *-graphs ]] && flags+=' --set compile.enabled=true --set compile.inductor_options={"triton.cudagraphs":true}'
    [[ $mode == *-graphstep ]] && flags+=" --set compile.enabled=true --set train.graph_step=true"  # runtime.graph_step
    [[ ep-$mode =~ ${ONLY:-.} ]] || continue
    for ep in $eps; do
      for routing in ${EPBENCH_ROUTING:-balanced random}; do
        route=""
        [ "$routing" = balanced ] && route=" --set model.router_force_balanced=true"
        if [ "$ep" = 1 ]; then queue+=("1	ep-$mode-L$layers-ep1-$routing	.	$flags$route"); continue; fi
        for disp in ${EPBENCH_DISPATCHERS:-auto}; do
          name=$mode; [ "$disp" = auto ] || name=$mode+$disp  # ep_table compares a +dispatcher to its mode's ep1
          queue+=("$ep	ep-$name-L$layers-ep$ep-$routing	.	$flags$route --ep $ep --set parallelism.dispatcher=$disp")
          [ -n "${EPBENCH_OLD:-}" ] && queue+=("$ep	ep-$name+old-L$layers-ep$ep-$routing	$EPBENCH_OLD	$flags$route --ep $ep --set parallelism.dispatcher=$disp")
        done
      done
    done
  done
  # first fit, the one-GPU runs first (they pair up side by side), then queue order: runs start while GPUs are
  # free, side by side (one host, separate GPUs)
  mapfile -t queue < <(printf '%s\n' "${queue[@]}" | sort -s -t $'\t' -k1,1n)
  free=0
  root=$PWD
  for job in "${queue[@]}"; do
    IFS=$'\t' read -r world tag tree jflags <<< "$job"
    if ((free + world > N)); then wait; free=0; fi
    # the flags split into words, unglobbed (profiling.steps=[6]); the run imports its own tree
    (set -f; cd "$tree" && export PYTHONPATH=${PYTHONPATH/$root/$PWD}
     CUDA_VISIBLE_DEVICES=$(cards $free "$world") launch_run "$tag" "$world" $jflags) &
    free=$((free + world))
  done
  wait
  summary+=("$(python -m benchmarks.ep_table "$OUT" --layers "$layers" --eps $eps)")
  for log in "$OUT"/ep-*graphstep*.log; do  # train.graph_step's runs: the graphs captured, the buckets left eager
    [ -f "$log" ] && summary+=("$(basename "$log" .log): $(grep 'captured bucket' "$log" | tail -n 1 | sed 's/.*captured //');\
 $(grep -c 'runs eagerly' "$log") eager-bucket warnings")
  done
fi
if [[ $parts == *graphstep* ]]; then
  graph_step() {  # tag, first card, world, then flags: bench_graph_step's log
    local tag=$1 first=$2 world=$3
    shift 3
    CUDA_VISIBLE_DEVICES=$(cards "$first" "$world") timeout "${GRAPHSTEP_LIMIT:-240}" torchrun --standalone \
      --nproc_per_node "$world" -m benchmarks.bench_graph_step "$BIG" --data "${GRAPHSTEP_DATA:-random}" "$@" \
      > "$OUT/graphstep-$tag.log" 2>&1
  }
  gs=(--set model.num_layers_override=8 --set parallelism.activation_checkpoint=none --set lora.enabled=true
      --set optim.master_dtype=fp32 --set model.router_force_balanced=true)
  graph_step ep1-eager 0 1 "${gs[@]}" --set compile.enabled=false &
  graph_step ep1-compiled $((N > 1 ? 1 : 0)) 1 "${gs[@]}" --set compile.enabled=true &
  wait
  graph_step "ep$N-eager" 0 "$N" --ep "$N" "${gs[@]}" --set compile.enabled=false
  graph_step "ep$N-compiled" 0 "$N" --ep "$N" "${gs[@]}" --set compile.enabled=true
  for log in "$OUT"/graphstep-*.log; do
    summary+=("$(basename "$log" .log): $(grep '^{' "$log" | tail -n 1 || tail -n 1 "$log")")
  done
fi
if [[ $parts == *deepep* ]]; then
  # the 8-layer step at ep=N on DeepEP's dispatcher (its wheel: benchmarks/build_deepep.sh; carry .whl-deepep)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/deepep-site .whl-deepep/deep_ep-*.whl
  PYTHONPATH=/tmp/deepep-site:$PYTHONPATH train_run "full8-ep$N-deepep" "$N" --ep "$N" \
    --set model.num_layers_override=8 --set parallelism.activation_checkpoint=none --set parallelism.dispatcher=deepep
  PYTHONPATH=/tmp/deepep-site:$PYTHONPATH verify "ep$N-deepep" "$N" --ep "$N" "$TINY" --set parallelism.dispatcher=deepep
fi
echo "== summary ($N GPUs)"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
pack_out "gpu_multi_${parts// /_}"
mv /tmp/traces/* "$OUT/" 2>/dev/null || true  # every rank's traces of `profile`, beside the archive (pack_out keeps small files)
