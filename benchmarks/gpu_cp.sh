#!/usr/bin/env bash
# Context parallelism on one GPU (issue 19), one device call, carry [".whl"] (and the two-call tilelang
# install of gpu_e2e_hybrid.sh for the hybrid preset and for gdnstate): `bash benchmarks/gpu_cp.sh [tests] [memory]
# [gdnstate]` (tests and memory when none is named).
#   tests   tests/gpu/test_cp_varlen_gpu.py: the allgather mode's varlen path (real varlen kernels, bf16)
#           against the masked SDPA path, forward and gradients
#   memory  activation memory per token at cp=1, the input of the memory model (docs/context_parallel.md):
#           bench_e2e, ours only, LoRA, 4 layers of each preset (PRESETS), selective activation
#           checkpointing, at several sequence lengths (SEQS); peak GiB minus model GiB over the sequence
#           length gives the bytes per token per layer (~5 min on an H200 for both presets)
#   gdnstate  GDN state passing on the fla op set: tests/gpu/test_cp_gdn_gpu.py (the pieces' delta rule and conv,
#           the layer's state path at cp size 1, compile, initial state vs FLA's public function) and
#           tests/gpu/test_gdn_gpu.py (the op set, opcheck of the new op signatures), then bench_hybrid
#           --gdn-state (per-piece state-passing delta rule vs a plain one, 16384 tokens, Qwen3.5 GDN dims).
#           FLA's gated backward needs TileLang on Hopper (Triton 3.6): two calls back to back, prepared once here
#           with `bash ../shared/gpu/wheels.sh --gdn`:
#             call 1, carry [".whl-gdn1"]: python3 -m pip install -q --no-index --no-deps --no-compile \
#                 --no-cache-dir --target /tmp/site .whl-gdn1/*.whl && echo ok
#             call 2, carry [".whl", ".whl-gdn2"]: bash benchmarks/gpu_cp.sh gdnstate
#           (warm: false on call 2 means /tmp/site is gone: repeat call 1)
parts=${*:-tests memory}
if [[ $parts == *gdnstate* ]]; then source benchmarks/gpu_env_gdn.sh; else source benchmarks/gpu_env.sh; fi
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
if [[ $parts == *gdnstate* ]]; then
  # TileLang compiles every kernel shape on first use (the whole test_gdn_gpu.py alone outlasts a 600 s call):
  # the state-passing tests and the opcheck of the new op signatures, each step bounded by DEADLINE (s).
  DEADLINE=${DEADLINE:-560}
  PYTHONUNBUFFERED=1 timeout $((DEADLINE - SECONDS - 60)) python -m pytest -m gpu -v -p no:cacheprovider -rA \
    tests/gpu/test_cp_gdn_gpu.py "tests/gpu/test_gdn_gpu.py::test_opcheck" > "$OUT/cp_gdn_tests.log" 2>&1
  grep -E "^(pieces|conv|layer|initial state) |PASSED|FAILED|ERROR|SKIPPED|^E  " "$OUT/cp_gdn_tests.log" | cut -c1-300
  tail -n 1 "$OUT/cp_gdn_tests.log"
  timeout $((DEADLINE - SECONDS)) python -m benchmarks.bench_hybrid --gdn-state --out "$OUT" \
    > "$OUT/gdn_state_bench.log" 2>&1
  tail -n 7 "$OUT/gdn_state_bench.log"
fi
