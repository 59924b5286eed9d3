#!/usr/bin/env bash
# Issue 6 (GDN) on one GPU: tests/gpu/test_gdn_gpu.py (fla vs torch op sets in bf16, opcheck, signature
# guard, compile fullgraph) and a fwd+bwd timing of the layer at Qwen3.5 / Qwen3-Next GDN dimensions.
#
# This is CALL 2 of the two-call install in ../shared/gpu/wheels.sh (its header says why: on Hopper with
# Triton 3.6, FLA 0.6 runs its gated backward through TileLang, and tilelang's wheels exceed one carry).
# Prepare the wheels here once with `bash ../shared/gpu/wheels.sh --gdn`, then back to back:
#   call 1, carry [".whl-gdn1"]: python3 -m pip install -q --no-index --no-deps --no-compile \
#       --no-cache-dir --target /tmp/site .whl-gdn1/*.whl && echo ok
#   call 2, carry [".whl", ".whl-gdn2"]: bash benchmarks/gpu_gdn.sh
# If call 2 reports warm: false, /tmp/site is gone (this script then stops): repeat call 1 first.
set -uo pipefail
if ! ls -d /tmp/site/z3* >/dev/null 2>&1; then
  echo "error: /tmp/site lacks the .whl-gdn1 wheels (z3, tvm-ffi): run call 1 first (see header)"; exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-gdn2/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1
python - <<'EOF' 2>&1 | tee "$OUT/gdn_env.log"
import torch, triton, fla, tilelang
from fla.utils.env import has_usable_nvcc
print(f"torch {torch.__version__} triton {triton.__version__} fla {fla.__version__} "
      f"tilelang {tilelang.__version__} nvcc for tilelang: {has_usable_nvcc()}")
EOF
python -m pytest -m gpu tests/gpu/test_gdn_gpu.py -q -p no:cacheprovider -rA 2>&1 \
  | tee "$OUT/gdn_tests.log" | tail -n 25

# Timing: one GDN layer, 4 rows x 4096 tokens packed with documents of 1000 tokens, bf16, fwd+bwd.
python - <<'EOF' 2>&1 | tee "$OUT/gdn_bench.log"
import torch
from attention.attention import AttnMeta
from attention.gdn import GatedDeltaNet

B, S, dims = 4, 4096, dict(hidden=2048, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                           conv_kernel=4, eps=1e-6)
ends = sorted({*range(0, B * S, 1000), *range(0, B * S + 1, S)})
meta = AttnMeta(cu_seqlens=torch.tensor(ends, dtype=torch.int32, device="cuda"), max_seqlen=1000)
x = torch.randn(B, S, dims["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)

def time_ms(fn, iters=10):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters

print(f"GDN layer fwd+bwd, B={B} S={S} packed (docs <= 1000 tokens), bf16, {torch.cuda.get_device_name()}")
print("| op set | mode | ms |")
print("|---|---|---|")
for op_set, compiled in [("fla", False), ("fla", True), ("torch", False)]:
    torch.manual_seed(0)
    layer = GatedDeltaNet(**dims, op_set=op_set, device="cuda", dtype=torch.bfloat16)
    run = torch.compile(layer, fullgraph=True) if compiled else layer
    ms = time_ms(lambda: run(x, meta).sum().backward())
    print(f"| {op_set} | {'compile' if compiled else 'eager'} | {ms:.2f} |")
EOF

# Issue 6 compile: hybrid decoder compiled with inductor (zero graph breaks, with/without AC) + stack benchmark.
python -m pytest -m gpu tests/gpu/test_compile_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/compile_tests.log" | tail -n 5
python benchmarks/bench_hybrid_compile.py --out "$OUT" 2>&1 | tee "$OUT/bench_hybrid_compile.log" | tail -n 8
