#!/usr/bin/env bash
# Wheel folders for benchmarks/gpu_sonicmoe.sh: candidate (nvidia-cutlass-dsl, quack-kernels, sonic-moe)
# sets for the GPU image (torch 2.11 cu130, Python 3.12, Triton 3.6), downloaded here (CPU side, PyPI).
# Run from the project's root:
#     bash benchmarks/sonicmoe_wheels.sh            # set a (the one that runs)
#     bash benchmarks/sonicmoe_wheels.sh a b        # only those
# Set TAG gets two folders, each under one run's 64 MiB carry (ignored by git: /.whl*/ in .gitignore):
#     .whl-sonic-TAG-1   the first 46 MiB part of the CuTe DSL library wheel (cu13 flavor)
#     .whl-sonic-TAG-2   its other part and the small wheels (DSL base/core, quack-kernels, sonic-moe,
#                        apache-tvm-ffi, torch-c-dlpack-ext)
# so one set travels in two device calls back to back (benchmarks/gpu_sonicmoe.sh `stage`, then `run`).
#
# The sets (evidence in the SonicMoE issue's report; every sonic-moe release declares torch<=2.9.1, so all of
# them run sonic-moe without its declared pins):
#   a  cutlass-dsl 4.8.1 + quack 0.6.5 + sonic-moe 0.1.2.post1: THE SET THAT RUNS (H200, torch 2.11, 2026-11-25:
#      docs/validation.md; pinned in pyproject's sonicmoe extra); the default. Its earlier failure in quack,
#      "epilogue fn depends on <ContextVar _LOC_TRANSFORMS> ... no fail-closed semantic key", was this: that
#      TypeError comes from quack/gemm_runtime/identity.py (quack >= 0.6.2), which fingerprints every
#      function an epilogue reaches unless its file lies under ".../site-packages/" or ".../dist-packages/";
#      unpacked into /tmp/site, cutlass's own functions were fingerprinted and their module globals (the
#      _LOC_TRANSFORMS ContextVar) refused. gpu_sonicmoe.sh unpacks into /tmp/sonic/TAG/site-packages.
#   b  cutlass-dsl 4.4.2 + quack 0.3.11 + sonic-moe 0.1.2.post1: sonic-moe's own pins at its release (its
#      wheel, quack 0.3.11 and nothing newer were built on 2026-04-20; cutlass-dsl 4.4.2 on 2026-03-13);
#      quack 0.3.11 has no fingerprinting layer. 4.4.2's cu13 library wheel (78 MB) holds every file of its
#      base wheel (74 MB, cu12 build) plus a few dialect modules, so it alone is carried.
#   c  cutlass-dsl 4.7.1 + quack 0.6.5 + sonic-moe 0.1.2.post1: quack 0.6.5 (declares cutlass-dsl >= 4.7,
#      built 2026-09-11) with the DSL that was current when it was released (4.8.x came after).
# quack's gemm / gemm_gated / gemm_dgated keep the keyword arguments sonic-moe 0.1.2.post1 passes from 0.3.11
# through 0.6.5 (checked in their sources); quack >= 0.5.1 pins cutlass-dsl 4.6.x, 0.6.5 asks >= 4.7.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
get() { local dir=$1; shift; python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir" "$@" 2>&1 | grep -v '^WARNING: Location' || true; }

declare -A DSL=([a]=4.8.1 [b]=4.4.2 [c]=4.7.1)
declare -A QUACK=([a]=0.6.5 [b]=0.3.11 [c]=0.6.5)
SONIC=0.1.2.post1
LIMIT=$((64 * 1024 * 1024))

tags=("$@")
[ ${#tags[@]} -gt 0 ] || tags=(a)  # b and c: the fallbacks if a later image breaks a
for tag in "${tags[@]}"; do
  [ -n "${DSL[$tag]:-}" ] || { echo "unknown set $tag (known: ${!DSL[*]})"; exit 1; }
  v=${DSL[$tag]} q=${QUACK[$tag]}
  d1=.whl-sonic-$tag-1 d2=.whl-sonic-$tag-2
  rm -rf "$d1" "$d2"
  mkdir -p "$d1" "$d2"
  tmp=$(mktemp -d)
  get "$tmp" "nvidia-cutlass-dsl-libs-cu13==$v"
  big=$(ls "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl)
  name=$(basename "$big")
  split -b 46M "$big" "$tmp/$name.part."
  mv "$tmp/$name.part.aa" "$d1/"
  mv "$tmp/$name".part.a[b-z] "$d2/"
  rm -rf "$tmp"
  small=("nvidia-cutlass-dsl==$v" "quack-kernels==$q" "sonic-moe==$SONIC" "apache-tvm-ffi==0.1.12"
         "torch-c-dlpack-ext==0.1.5")
  if [ "$v" != 4.4.2 ]; then  # from 4.6 the Python DSL is in libs-base / libs-core, the flavors hold the libraries
    small+=("nvidia-cutlass-dsl-libs-base==$v" "nvidia-cutlass-dsl-libs-core==$v")
  fi
  for w in "${small[@]}"; do get "$d2" "$w"; done
  echo "set $tag: cutlass-dsl $v, quack-kernels $q, sonic-moe $SONIC"
  for d in "$d1" "$d2"; do
    bytes=$(du -sb "$d" | cut -f1)
    echo "  $d: $((bytes / 1024 / 1024)) MiB$([ "$bytes" -lt "$LIMIT" ] || echo '  OVER the 64 MiB carry')"
    ls -l "$d" | awk 'NR > 1 {printf "    %10d  %s\n", $5, $9}'
  done
done
