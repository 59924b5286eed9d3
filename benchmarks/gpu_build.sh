#!/usr/bin/env bash
# Time from process start to step 1 on one GPU: a randomly initialized 12-layer model of
# Qwen3-30B-A3B's dims (hidden 2048, 128 experts, top-8, moe_intermediate 768, 32/4 heads x 128,
# vocab 151936), seq 8192, one packed row, LoRA r=16 (bf16 base) and full fine-tuning (fp32 master
# weights, full activation checkpointing, as examples/qwen3-30b-a3b-full.yaml). Each is run twice:
# the second run finds the kernel caches warm.
#     bash benchmarks/gpu_build.sh            # on the GPU machine; rows in $OUT/gpu_build.jsonl
#     MODES=lora bash benchmarks/gpu_build.sh # one of them
# "to_step1_s": launch of torchrun -> step 1's metrics record written; "step1_s": that step alone.
source benchmarks/gpu_env.sh
set -o pipefail
WORK=${WORK:-/tmp/gpu_build}
mkdir -p "$WORK"
python3 - "$WORK" <<'EOF'
import json, random, sys
import yaml
work = sys.argv[1]
rng = random.Random(0)
words = ["the", "model", "expert", "token", "route", "layer", "train", "weight", "data", "step"]
with open(f"{work}/text.jsonl", "w") as f:
    for _ in range(8):  # ~8 x 3000 words: more than one 8192-token row
        f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(3000))}) + "\n")
model = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 12,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
         "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
         "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
common = {"data": {"path": f"{work}/text.jsonl", "kind": "text", "tokenizer": "examples/tiny/tokenizer",
                   "seq_len": 8192},
          "train": {"max_steps": 1, "micro_batch_size": 1},
          "checkpoint": {"save_final": False}, "logging": {"progress_bar": False}}
modes = {"lora": {"model": {"config": model, "dtype": "bfloat16", "expert_backend": "grouped_mm"},
                  "lora": {"enabled": True, "rank": 16, "alpha": 32,
                           "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]},
                  "parallelism": {"activation_checkpoint": "selective"}},
         "full": {"model": {"config": model, "dtype": "float32", "expert_backend": "grouped_mm"},
                  "parallelism": {"activation_checkpoint": "full"}}}
for name, cfg in modes.items():
    # yaml, not json: YAML 1.1 reads json's 1e-06 as a string
    yaml.safe_dump({**common, **cfg}, open(f"{work}/{name}.yaml", "w"), sort_keys=False)
EOF
for mode in ${MODES:-lora full}; do
  for run in 1 2; do
    rm -rf "$WORK/out_$mode"
    t0=$(date +%s.%N)
    torchrun --standalone --nproc_per_node 1 -m runtime.launch "$WORK/$mode.yaml" --output-dir "$WORK/out_$mode" \
      > "$OUT/gpu_build_${mode}_$run.log" 2>&1
    rc=$?
    t_exit=$(date +%s.%N)
    python3 - "$WORK/out_$mode/metrics.jsonl" "$t0" "$t_exit" "$mode" "$run" "$rc" <<'EOF' | tee -a "$OUT/gpu_build.jsonl"
import json, os, sys
path, t0, t_exit, mode, run, rc = sys.argv[1:]
row = {"mode": mode, "run": int(run), "rc": int(rc), "process_s": round(float(t_exit) - float(t0), 2)}
if os.path.exists(path) and os.path.getsize(path):
    rec = json.loads(open(path).readline())
    row.update(to_step1_s=round(os.path.getmtime(path) - float(t0), 2), step1_s=round(rec["step_s"], 2),
               loss=round(rec["loss"], 4), peak_mem_gib=round(rec.get("peak_mem_gib", 0), 1))
print(json.dumps(row))
EOF
    [ "$rc" = 0 ] || tail -n 5 "$OUT/gpu_build_${mode}_$run.log"
  done
done
