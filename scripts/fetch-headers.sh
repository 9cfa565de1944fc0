#!/usr/bin/env bash
# The header-only C++ libraries of the CUDA backend, taken from their wheels on the Python package
# index at pinned versions and checksums, into build/third_party/NAME-VERSION/include:
#   cuDNN frontend 1.32.0   the graph API of cuDNN's fused attention (kernels/cuda/attention_cudnn.cpp)
#   CUTLASS 4.2.0           the grouped FP8 GEMM of the experts (kernels/cuda/grouped_gemm.cu): cutlass/,
#                           cute/ and cutlass/util/ (packed strides)
# Only the wheels' include directories are kept: nothing is installed into a Python environment (the wheels'
# Python parts and their dependencies are not wanted). scripts/setup.sh runs this where nvcc is
# found; CMake builds the fused attention where the headers are there. Idempotent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
pip=${FP8MOE_PIP:-build/venv/bin/pip}
dest=build/third_party

if [[ $(uname -m) != x86_64 ]]; then
  echo "fetch-headers: the pinned wheels are x86_64 builds; on $(uname -m) cuDNN's fused attention is not built"
  exit 0
fi

fetch() {  # wheel-name version sha256-of-the-wheel directory include-directories-in-the-wheel...
  local name=$1 version=$2 sha=$3 dir=$dest/$4
  local prefixes=("${@:5}")
  if [[ -f $dir/.complete ]]; then
    echo "fetch-headers: $dir is there"
    return 0
  fi
  local tmp
  tmp=$(mktemp -d)
  echo "fetch-headers: $name==$version from the Python package index"
  "$pip" download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -d "$tmp" "$name==$version"
  local whl=("$tmp"/*.whl)
  if ! echo "$sha  ${whl[0]}" | sha256sum --check --quiet; then
    echo "fetch-headers: $(basename "${whl[0]}"): sha256 is not the pinned $sha" >&2
    rm -rf "$tmp"
    exit 1
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  python3 - "${whl[0]}" "$dir" "${prefixes[@]}" <<'PY'
import os, sys, zipfile
whl, dest, prefixes = sys.argv[1], sys.argv[2], sys.argv[3:]
n = 0
with zipfile.ZipFile(whl) as z:
    for prefix in prefixes:
        names = [m for m in z.namelist() if m.startswith(prefix) and not m.endswith("/")]
        if not names:
            sys.exit(f"fetch-headers: {whl} has no {prefix}")
        for m in names:  # prefix/x/y.h -> dest/include/x/y.h
            out = os.path.join(dest, "include", m[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(m) as src, open(out, "wb") as dst:
                dst.write(src.read())
        n += len(names)
print(f"fetch-headers: {n} headers into {dest}/include")
PY
  rm -rf "$tmp"
  touch "$dir/.complete"
}

fetch nvidia-cudnn-frontend 1.32.0 c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0 \
  cudnn-frontend-1.32.0 include/
fetch nvidia-cutlass 4.2.0.0 f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6 \
  cutlass-4.2.0 cutlass_library/source/include/ cutlass_library/source/tools/util/include/
