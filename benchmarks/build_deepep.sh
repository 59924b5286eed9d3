#!/usr/bin/env bash
# DeepEP for the `deepep` dispatcher (moe/dispatch/deepep.py): intranode kernels only (NVLink, no NVSHMEM),
# sm90, from DeepEP's public source at commit 567632d (2026-02-03: the last `deep_ep_cpp` release before
# EPv2, whose setup.py requires NVSHMEM and NCCL and JIT-compiles at run time). The GPU machines reach no
# network, so the source travels as a carried folder and the wheel comes back through $OUT.
#
#   here (CPU side, from the project's root; needs a DeepEP git mirror, e.g. from the `fetch` tool):
#     bash benchmarks/build_deepep.sh prepare [MIRROR]   # -> .whl-deepep-src/DeepEP (~0.7 MB, git-ignored)
#   on a GPU machine (one device call, any kind; carry [".whl-deepep-src"]):
#     bash benchmarks/build_deepep.sh build              # -> $OUT/deep_ep-*.whl, $OUT/build_deepep.log
#   here, after that call (files_at: the folder the call's files came back to):
#     mkdir -p .whl-deepep && cp FILES_AT/deep_ep-*.whl .whl-deepep/
#   on a machine of 2-4 GPUs (carry [".whl", ".whl-deepep", ".whl-deepep-src"]; the source only for DeepEP's test):
#     bash benchmarks/build_deepep.sh test               # our GPU tests, DeepEP's test_intranode, verify ep 2/4
#     bash benchmarks/build_deepep.sh bench              # bench_ep with each dispatcher (DEEPEP_SMS=20,24,32: a sweep)
#
# The build (setup.py at 567632d, patched on a copy):
#   - NVSHMEM off: setup.py turns it off only when NVSHMEM_DIR is unset and the `nvidia.nvshmem` module is
#     missing, but the GPU image has nvidia-nvshmem-cu13; the patch adds DISABLE_NVSHMEM=1 to force it off.
#   - deep_ep.cpp's three shrink-mode mask calls (internode_ll.cu, not compiled without NVSHMEM) are guarded:
#     unguarded at 567632d, they leave undefined symbols (internode_ll::update_mask_buffer) in the extension.
#   - no -rdc=true without NVSHMEM: setup.py compiles relocatable device code but device-links only with
#     NVSHMEM, so an intranode-only build imports with "undefined symbol __cudaRegisterLinkedBinary_..."
#     (DeepEP issue #429); the intranode sources have no cross-file device symbols, so rdc is dropped.
#   - TORCH_CUDA_ARCH_LIST=9.0 (H100/H200), DISABLE_AGGRESSIVE_PTX_INSTRS=1 (setup.py's default).
#   - Needs nvcc (13.0 on the image), torch's headers, setuptools + wheel, and libcuda for -lcuda (the
#     toolkit's stubs are put on LIBRARY_PATH in case the driver's library has no unversioned name).
set -euo pipefail
root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$root"
REV=567632dd59810d77b3cc05553df953cc0f779799
SRC=.whl-deepep-src
WHL=.whl-deepep
LIMIT=$((16 * 1024 * 1024))  # one file back from $OUT

die() { echo "build_deepep.sh: $*" >&2; exit 1; }

install_wheel() {  # into /tmp/deepep-site; exports PYTHONPATH
  local whl
  whl=$(ls "$WHL"/deep_ep-*.whl 2>/dev/null | head -n 1) || true
  [ -n "$whl" ] || die "no wheel in $WHL/: build it first (see the header) and carry $WHL"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/deepep-site "$whl"
  export PYTHONPATH=/tmp/deepep-site:$root${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import deep_ep; print('deep_ep', deep_ep.__file__, 'sm90:', deep_ep.Buffer.is_sm90_compiled())"
}

case "${1:-}" in
prepare)
  mirror=${2:-${DEEPEP_MIRROR:-/work/.mirror/deepseek-ai+DeepEP/repo}}
  git -C "$mirror" rev-parse --verify -q "$REV^{commit}" >/dev/null || die "$mirror has no commit $REV"
  rm -rf "$SRC"
  mkdir -p "$SRC/DeepEP"
  git -C "$mirror" archive --format=tar "$REV" -- . ':(exclude)figures' | tar -x -C "$SRC/DeepEP"
  git -C "$mirror" rev-parse "$REV" > "$SRC/DeepEP/REVISION"
  bytes=$(du -sb "$SRC" | cut -f1)
  [ "$bytes" -lt $((8 * 1024 * 1024)) ] || die "$SRC is $bytes bytes: expected well under 64 MiB"
  git check-ignore -q "$SRC" || echo "warning: $SRC is not git-ignored; add /.whl*/ to .gitignore"
  echo "$SRC/DeepEP: $(cat "$SRC/DeepEP/REVISION"), $bytes bytes"
  echo "next: device run, carry [\"$SRC\"], command: bash benchmarks/build_deepep.sh build"
  ;;
build)
  [ -f "$SRC/DeepEP/setup.py" ] || die "$SRC/DeepEP is missing: run \`prepare\` on the CPU side and carry $SRC"
  export OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  work=/tmp/deepep-build
  rm -rf "$work"
  cp -r "$SRC/DeepEP" "$work"
  python3 - "$work/setup.py" <<'EOF'
import sys
path = sys.argv[1]
s = open(path).read()
patches = [
    ("    if nvshmem_dir is None:\n        try:",
     "    if int(os.getenv('DISABLE_NVSHMEM', '0')):\n        disable_nvshmem = True\n"
     "    elif nvshmem_dir is None:\n        try:"),
    ("nvcc_flags.extend(['-rdc=true', '--ptxas-options=--register-usage-level=10'])",
     "nvcc_flags.extend(([] if disable_nvshmem else ['-rdc=true']) + ['--ptxas-options=--register-usage-level=10'])"),
]
for old, new in patches:
    assert s.count(old) == 1, f"setup.py changed: {old!r} not found once"
    s = s.replace(old, new)
open(path, "w").write(s)
print("setup.py patched: DISABLE_NVSHMEM honored, no -rdc without NVSHMEM")
# deep_ep.cpp calls three shrink-mode kernels of internode_ll.cu (not compiled without NVSHMEM) outside any
# DISABLE_NVSHMEM guard: the import fails on their undefined symbols. Guard them; without NVSHMEM their
# mask buffer is null and the assertion before each call already refuses.
cpp_path = path.replace("setup.py", "csrc/deep_ep.cpp")
cpp = open(cpp_path).read()
for call in ("internode_ll::update_mask_buffer(", "internode_ll::query_mask_buffer(", "internode_ll::clean_mask_buffer("):
    assert cpp.count("    " + call) == 1, f"deep_ep.cpp changed: {call} not found once"
    start = cpp.index("    " + call)
    end = cpp.index(";\n", start) + 2
    cpp = cpp[:start] + "#ifndef DISABLE_NVSHMEM\n" + cpp[start:end] + "#endif\n" + cpp[end:]
open(cpp_path, "w").write(cpp)
print("deep_ep.cpp patched: the shrink-mode mask calls only with NVSHMEM")
EOF
  export DISABLE_NVSHMEM=1 TORCH_CUDA_ARCH_LIST=9.0 DISABLE_AGGRESSIVE_PTX_INSTRS=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
  unset NVSHMEM_DIR
  # torch's own guess (CUDA_HOME, else where nvcc is), which its extension builder uses anyway
  cuda_home=${CUDA_HOME:-$(python3 -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or '')")}
  export CUDA_HOME=${cuda_home:-/usr/local/cuda}
  cuda_home=$CUDA_HOME
  stubs=$cuda_home/lib64/stubs:$cuda_home/targets/x86_64-linux/lib/stubs
  export LIBRARY_PATH=$stubs:$cuda_home/lib64:$cuda_home/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  { echo "CUDA_HOME=$CUDA_HOME"; nvcc --version | tail -n 2
    python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
    nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | head -n 1 || true; } 2>&1 | tee "$OUT/build_deepep.log"
  t0=$(date +%s)
  set -o pipefail
  (cd "$work" && python3 setup.py bdist_wheel) >> "$OUT/build_deepep.log" 2>&1 \
    || { tail -n 60 "$OUT/build_deepep.log"; die "the build failed (log: \$OUT/build_deepep.log)"; }
  echo "built in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build_deepep.log"
  grep -E "Build summary| > (Sources|Arch list|NVSHMEM path)" "$OUT/build_deepep.log" || true
  whl=$(ls "$work"/dist/deep_ep-*.whl | head -n 1)
  mkdir -p "$WHL"
  cp "$whl" "$WHL/"
  install_wheel
  so=$(ls /tmp/deepep-site/deep_ep_cpp*.so)
  if nm -D --undefined-only "$so" | grep -q __cudaRegisterLinkedBinary; then
    die "$so has undefined __cudaRegisterLinkedBinary symbols: relocatable device code was not device-linked"
  fi
  cuobjdump --list-elf "$so" 2>/dev/null | head -n 5 || true
  size=$(stat -c %s "$whl")
  if [ "$size" -le "$LIMIT" ]; then
    cp "$whl" "$OUT/"
  else  # too big for one file back: parts, joined again with cat
    split -b $((15 * 1024 * 1024)) -d "$whl" "$OUT/$(basename "$whl").part"
  fi
  ls -l "$OUT"
  echo
  echo "next (CPU side): mkdir -p $WHL && cp FILES_AT/$(basename "$whl") $WHL/"
  [ "$size" -le "$LIMIT" ] || echo "   (it came back in parts: cat FILES_AT/$(basename "$whl").part* > $WHL/$(basename "$whl"))"
  echo "then on 2-4 GPUs, carry [\"$WHL\", \"$SRC\"]: bash benchmarks/build_deepep.sh test"
  ;;
test)
  source benchmarks/gpu_env.sh  # the carried wheels (pydantic, ...) and $OUT
  install_wheel
  n=$(nvidia-smi -L | wc -l)
  set -o pipefail
  set +e
  timeout 300 python3 -m pytest -q -s tests/gpu/test_deepep_gpu.py 2>&1 | tee "$OUT/test_deepep.log" | tail -n 40
  if [ -f "$SRC/DeepEP/tests/test_intranode.py" ]; then  # DeepEP's own check of its kernels, smaller shapes
    (cd "$SRC/DeepEP/tests" && timeout 120 python3 test_intranode.py --num-processes "$n" --num-tokens 1024 \
      --hidden 2048 --num-topk 8 --num-experts 128) > "$OUT/deepep_test_intranode.log" 2>&1
    echo "DeepEP test_intranode rc=$?"; grep -E "passed|Best|Error|error" "$OUT/deepep_test_intranode.log" | tail -n 12
  fi
  for ep in 2 4; do
    [ "$ep" -le "$n" ] || continue
    timeout 180 torchrun --standalone --nproc_per_node "$ep" -m runtime.verify --ep "$ep" --set parallelism.dispatcher=deepep \
      examples/tiny-qwen3-moe.yaml --steps 3 2>&1 | tee "$OUT/verify_deepep_ep$ep.log" | grep -vE "^\s*$|Warning|warn" \
      | tail -n 8
  done
  ;;
bench)
  source benchmarks/gpu_env.sh
  install_wheel
  n=$(nvidia-smi -L | wc -l)
  # all_to_all, then DeepEP at the SM counts DEEPEP_SMS lists, else its default (its own tuning found 24 best)
  for d in all_to_all deepep; do
    sms=()
    [ "$d" = deepep ] && [ -n "${DEEPEP_SMS:-}" ] && sms=(--deepep-sms "$DEEPEP_SMS")
    timeout 240 torchrun --standalone --nproc_per_node "$n" -m benchmarks.bench_ep --dispatcher "$d" "${sms[@]}" \
      --out "$OUT/bench_ep_$d" 2>&1 | tee "$OUT/bench_ep_$d.log" | tail -n 8
  done
  ;;
*)
  sed -n '2,26p' "$0"
  exit 2
  ;;
esac
