#!/usr/bin/env bash
# Collects what the GPU-side checks need into one self-contained folder for a machine that has a
# GPU driver and CUDA but no Open MPI, HDF5, yaml-cpp or oneDNN (the device machine):
#   bin/       fp8moe, test_kernels, test_nccl, bench_gemm_cuda (RPATH $ORIGIN/../lib)
#   lib/       every shared library they load that is not glibc, the GPU driver, cuBLASLt or NCCL
#              (RPATH $ORIGIN); cuBLASLt (~540 MB) and NCCL (~220 MB) are too large to carry and are
#              found on the target by env.sh (CUDA's lib64 or the nvidia-* Python wheels)
#   ompi/      Open MPI's runtime at its relocated prefix (OPAL_PREFIX): components, help texts,
#              orted and mpirun, for a singleton or a local `mpirun`; pmix/ likewise (PMIX_INSTALL_PREFIX)
#   env.sh     sets the paths; source it before running anything from bin/
# The folder is packed as OUT/fp8moe-bundle.tar.xz (the device tool carries at most 64 MiB).
#
# usage: scripts/bundle.sh [BUILD_DIR=build] [OUT_DIR=bundle]
set -euo pipefail
build=${1:-build} out=${2:-bundle}
for tool in patchelf ldd xz; do command -v $tool >/dev/null || { echo "bundle.sh: needs $tool (scripts/setup.sh installs it)" >&2; exit 2; }; done
bins=("$build/fp8moe" "$build/tests/test_kernels" "$build/tests/test_nccl" "$build/bench/bench_gemm_cuda")
for b in "${bins[@]}"; do
  [[ -x $b ]] || { echo "bundle.sh: $b not built (a CUDA build: cmake --preset cuda, or FP8MOE_CUDA=ON)" >&2; exit 2; }
done
stage=$(mktemp -d /tmp/fp8moe-bundle-XXXXXX)
trap 'rm -rf "$stage"' EXIT
root=$stage/fp8moe-bundle
mkdir -p "$root/bin" "$root/lib"

ompi_lib=$(dirname "$(readlink -f "$(ldd "$build/fp8moe" | awk '/libmpi\.so/ {print $3; exit}')")")
ompi_pkglib=$(ompi_info --path pkglibdir --parsable 2>/dev/null | sed -n 's/^path:pkglibdir://p')
ompi_prefix=$(ompi_info --path prefix --parsable 2>/dev/null | sed -n 's/^path:prefix://p')
ompi_data=$(ompi_info --path pkgdatadir --parsable 2>/dev/null | sed -n 's/^path:pkgdatadir://p')
[[ -n $ompi_pkglib && -d $ompi_pkglib ]] || { echo "bundle.sh: cannot find Open MPI's components (ompi_info)" >&2; exit 2; }
# PMIx: linked by Open MPI's library or its pmix component (Debian: an external PMIx).
pmix_lib=$(for f in "$ompi_lib"/libopen-pal.so.* "$ompi_pkglib"/mca_pmix_*.so; do ldd "$f" 2>/dev/null; done |
           awk '/libpmix\.so/ {print $3; exit}')

# What the target provides: glibc, the GPU driver, and the two libraries too large to carry.
skip='^(ld-linux.*|libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl|libcuda|libnvidia-.*|libcublasLt|libcublas|libnccl)\.so'
copy_deps() {  # the non-target libraries $1 loads, into lib/
  ldd "$1" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r so; do
    name=$(basename "$so")
    [[ $name =~ $skip ]] && continue
    [[ -e $root/lib/$name ]] || cp -L "$so" "$root/lib/$name"
  done
}
for b in "${bins[@]}"; do
  cp -L "$b" "$root/bin/"
  copy_deps "$b"
done

# Open MPI's runtime under a relocated prefix that mirrors the installed one.
rel() { echo "${1#"$ompi_prefix"/}"; }
mkdir -p "$root/ompi/$(rel "$ompi_pkglib")" "$root/ompi/$(rel "$ompi_data")" "$root/ompi/bin"
cp -L "$ompi_pkglib"/*.so "$root/ompi/$(rel "$ompi_pkglib")/"
cp -r "$ompi_data"/. "$root/ompi/$(rel "$ompi_data")/"
for t in orted orterun mpirun mpiexec; do
  p=$(command -v $t || true)
  [[ -n $p ]] && cp -L "$p" "$root/ompi/bin/$t"
done
for f in "$root/ompi/$(rel "$ompi_pkglib")"/*.so "$root/ompi/bin"/*; do copy_deps "$f"; done
if [[ -n $pmix_lib ]]; then  # PMIx's own components (Debian: /usr/lib/x86_64-linux-gnu/pmix2/{lib/pmix,share/pmix})
  pmix_prefix=$(dirname "$(dirname "$(readlink -f "$pmix_lib")")")
  if [[ -d $pmix_prefix/lib/pmix ]]; then
    mkdir -p "$root/pmix/lib"
    cp -r "$pmix_prefix/lib/pmix" "$root/pmix/lib/"
    [[ -d $pmix_prefix/share ]] && cp -r "$pmix_prefix/share" "$root/pmix/"
    for f in "$root/pmix/lib/pmix"/*.so; do copy_deps "$f"; done
  fi
fi

# RPATH $ORIGIN: the binaries find lib/, the libraries each other.
for f in "$root/bin"/*; do patchelf --set-rpath '$ORIGIN/../lib' "$f" 2>/dev/null || true; done
for f in "$root/ompi/bin"/*; do patchelf --set-rpath '$ORIGIN/../../lib' "$f" 2>/dev/null || true; done
for f in "$root/lib"/*; do patchelf --set-rpath '$ORIGIN' "$f" 2>/dev/null || true; done

cat >"$root/env.sh" <<'ENV'
# Source me: the bundle's paths, Open MPI relocated to it, and the CUDA libraries of this machine.
B=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH="$B/bin:$B/ompi/bin:$PATH"
export OPAL_PREFIX="$B/ompi" PMIX_INSTALL_PREFIX="$B/pmix" PMIX_MCA_mca_base_component_path="$B/pmix/lib/pmix"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mca_base_component_show_load_errors=0 OMPI_MCA_btl_vader_single_copy_mechanism=none
# cuBLASLt and NCCL, each where it is found first: CUDA's lib64, the system, then the nvidia-*
# wheels of any Python on the machine (site and user site).
dirs=("${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu)
for py in python3 /opt/torch/.venv/bin/python3; do
  site=$("$py" -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null) || continue
  for s in $site; do dirs+=("$s"/nvidia/cu13/lib "$s"/nvidia/cublas/lib "$s"/nvidia/nccl/lib); done
done
cuda_libs=""
for lib in libcublasLt.so.13 libnccl.so.2; do
  for d in "${dirs[@]}"; do
    if [[ -e $d/$lib ]]; then
      [[ ":$cuda_libs:" == *":$d:"* ]] || cuda_libs+=":$d"
      break
    fi
  done
done
export LD_LIBRARY_PATH="$B/lib${cuda_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
missing=$(ldd "$B/bin/fp8moe" | awk '/not found/ {print $1}' | tr '\n' ' ')
[[ -z $missing ]] || echo "env.sh: not found on this machine: $missing(set CUDA_HOME or LD_LIBRARY_PATH)" >&2
ENV

mkdir -p "$out"
rm -f "$out/fp8moe-bundle.tar.xz"
tar -C "$stage" -cf - fp8moe-bundle | xz -T0 -6 >"$out/fp8moe-bundle.tar.xz"
unpacked=$(du -sb "$root" | cut -f1) packed=$(stat -c %s "$out/fp8moe-bundle.tar.xz")
printf 'bundle: %s (%.1f MiB; %.1f MiB unpacked, %d libraries carried)\n' "$out/fp8moe-bundle.tar.xz" \
  "$(echo "$packed / 1048576" | bc -l)" "$(echo "$unpacked / 1048576" | bc -l)" "$(ls "$root/lib" | wc -l)"
if (( packed > 60 * 1048576 )); then echo "bundle.sh: the bundle is over 60 MiB: it would not travel beside the tree" >&2; exit 1; fi
