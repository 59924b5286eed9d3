#!/usr/bin/env bash
# One-GPU topic scripts side by side, one per card of a multi-GPU machine, in one device call: a machine of
# several GPUs counts its time once, however many of its cards work, so one-GPU parts cost less here than on
# one-GPU machines, one after another (and pay one start). Timings of a part stay comparable within the part
# (each script measures its sides on its own card, in its own call order).
#   bash benchmarks/gpu_cards.sh "gpu_fp8.sh tests bench" "PEERS_LAYERS=12 gpu_e2e.sh peers" "gpu_fp8.sh e2e" ...
# Each argument: optional VAR=value words, a script of benchmarks/, its parts. Job i runs on card i with
# OUT=$OUT/card<i>; the carried wheels (.whl, plus what the scripts need: .whl-unsloth for peers) are installed
# once, before the jobs start. Each job's log is $OUT/card<i>/run.log; every card's folder is packed into
# $OUT/card<i>.tgz; the end of each job's log (its summary) comes last.
source benchmarks/gpu_env.sh
cards=$(nvidia-smi -L | wc -l)
(( $# <= cards )) || { echo "$# jobs for $cards cards: give at most one job per card"; exit 2; }
pids=()
i=0
for job in "$@"; do
  read -r -a words <<< "$job"
  assignments=()
  while [[ ${words[0]} == *=* ]]; do
    assignments+=("${words[0]}")
    words=("${words[@]:1}")
  done
  mkdir -p "$OUT/card$i"
  env CUDA_VISIBLE_DEVICES=$i OUT="$OUT/card$i" "${assignments[@]}" bash "benchmarks/${words[0]}" "${words[@]:1}" \
    > "$OUT/card$i/run.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
jobs_list=("$@")
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  echo "== card $i (${jobs_list[$i]}): exit code $?"
done
for i in "${!pids[@]}"; do
  echo "== card $i summary"
  grep -vE "register_constant|Failed to load" "$OUT/card$i/run.log" | tail -n 30
  (cd "$OUT" && tar czf "card$i.tgz" "card$i" && rm -rf "card$i")
done
