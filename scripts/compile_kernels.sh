#!/usr/bin/env bash
# Compile every hand-written CUDA kernel (plugins/*/**/kernels/*.cu) with nvcc for sm_90 (Hopper: the H200)
# and sm_120a (Blackwell consumer/workstation), so a kernel that stops compiling fails CI even on machines
# without a GPU. One line per file and arch; exit 1 on any error; exit 0 with a note when nvcc is absent.
# Usage: bash scripts/compile_kernels.sh            (NVCC=/path/to/nvcc, CUDA_INCLUDE=... to override)
set -uo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [ ! -x "$NVCC" ]; then
  echo "compile_kernels: nvcc not found: skipping the CUDA kernel compile check"
  exit 0
fi
CUDA_INCLUDE=${CUDA_INCLUDE:-/usr/local/cuda/include}
ARCHS=(sm_90 sm_120a)

mapfile -t FILES < <(find plugins -path '*/kernels/*.cu' -type f | sort)
if [ "${#FILES[@]}" -eq 0 ]; then
  echo "compile_kernels: no kernels/*.cu files under plugins/"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
for f in "${FILES[@]}"; do
  # files with programmatic dependent launch also build as LUMEN_CUDA_PDL's modes do (lumen_cuda.kernels.PDL_DEFINES:
  # 1, noprefetch, late)
  variants=("")
  grep -q '#include "pdl.cuh"' "$f" && variants+=("-DLUMEN_PDL" "-DLUMEN_PDL -DLUMEN_PDL_NO_PREFETCH"
                                                 "-DLUMEN_PDL -DLUMEN_PDL_NO_PREFETCH -DLUMEN_PDL_NO_TRIGGER")
  for arch in "${ARCHS[@]}"; do
    for def in "${variants[@]}"; do
      log="$TMP/log"
      if "$NVCC" -std=c++17 -I"$CUDA_INCLUDE" $def -arch="$arch" -c -o "$TMP/out.o" "$f" >"$log" 2>&1; then
        printf "ok    %-8s %s %s\n" "$arch" "$f" "$def"
      else
        printf "FAIL  %-8s %s %s\n" "$arch" "$f" "$def"
        sed 's/^/      /' "$log"
        fail=1
      fi
    done
  done
done
[ "$fail" -eq 0 ] && echo "compile_kernels: ${#FILES[@]} file(s) x ${#ARCHS[@]} arch(s) compiled ($("$NVCC" --version | tail -1))"
exit "$fail"
