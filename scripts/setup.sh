#!/usr/bin/env bash
# Idempotent set-up on Debian 12: installs the Debian packages the build and the tests need (only
# those missing), then configures and builds build/ in Release (CUDA code too when nvcc exists).
# Safe to run again: a second run installs nothing and rebuilds only what changed.
#   --hf  also Hugging Face transformers with PyTorch into build/venv-hf (scripts/requirements-hf.txt:
#         about 2.9 GB to download, 5.6 GB installed), for the hf_transformers test (ctest -R hf_),
#         which reports SKIPPED without it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
with_hf=0
for arg in "$@"; do
  case $arg in
    --hf) with_hf=1 ;;
    *) echo "setup: unknown option $arg (known: --hf)" >&2; exit 2 ;;
  esac
done

packages=(
  build-essential cmake ninja-build ccache pkg-config git    # toolchain
  libopenmpi-dev openmpi-bin                                  # MPI
  libhdf5-openmpi-dev hdf5-tools                              # parallel HDF5 (checkpoints)
  libyaml-cpp-dev libcli11-dev nlohmann-json3-dev             # config, command line, the metrics log
  libdnnl-dev                                                 # oneDNN: the CPU backend's GEMMs (FP32 and BF16)
  libsleef-dev                                                # SLEEF: the CPU ops' vectorized exponentials
  ocl-icd-opencl-dev                                          # oneDNN's CMake package requires OpenCL (libdnnl-dev only recommends it)
  libgtest-dev libgmock-dev libbenchmark-dev                  # tests, benchmarks
  python3 python3-venv                                        # the JAX reference of the model tests
  fortunes                                                    # the demo's corpus (/usr/share/games/fortunes)
  slurm-wlm bc                                                # the Slurm test starts its own single-node Slurm
  patchelf bubblewrap xz-utils                                # scripts/bundle.sh and its sandboxed check
)
# Python packages, in build/venv (not the system Python), at the exact versions of
# scripts/requirements.txt (every package pinned, dependencies included), so that a new release
# on the package index cannot change a fresh set-up.
requirements=scripts/requirements.txt

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  as_root=()
  if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null; then
      echo "setup: missing Debian packages and not root (and no sudo); run as root:" >&2
      echo "  apt-get update && apt-get install -y ${missing[*]}" >&2
      exit 1
    fi
    as_root=(sudo)
  fi
  echo "setup: installing ${#missing[@]} Debian packages: ${missing[*]}"
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all ${#packages[@]} Debian packages are installed"
fi

# The CUDA toolkit is not a Debian package here; use it where it is installed.
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
if command -v nvcc >/dev/null || [[ -n ${CUDACXX:-} ]]; then
  echo "setup: nvcc found: the CUDA backend is compiled too (sm_90a)"
else
  echo "setup: no nvcc: building the CPU backend only"
fi

# A virtual environment VENV with the exact packages of REQUIREMENTS, (re)installed when the file
# differs from what it was made from or a module of IMPORTS does not import.
python_venv() {
  local venv=$1 requirements=$2 imports=$3 note=${4:-}
  if ! cmp -s "$requirements" "$venv/requirements.txt" || ! "$venv/bin/python3" -c "import $imports" 2>/dev/null; then
    echo "setup: installing $requirements from PyPI into $venv$note"
    mkdir -p build
    [[ -x $venv/bin/python3 ]] || python3 -m venv "$venv"
    "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check --no-input -r "$requirements"
    cp "$requirements" "$venv/requirements.txt"
  else
    echo "setup: $venv matches $requirements"
  fi
}

# The reference model (tests/reference/model_ref.py, JAX), the checkpoint reader (h5py), the plots
# (matplotlib), the tokenizer (scripts/tokenize-data.py, tokenizers) and Hugging Face's safetensors
# reader (tests/app/hf_interop.py) run from build/venv.
venv=build/venv
python_venv "$venv" "$requirements" "jax, numpy, ml_dtypes, matplotlib, h5py, tokenizers, safetensors"

# Hugging Face transformers and PyTorch (the reference of fp8moe export / import), only when asked.
if ((with_hf)); then
  python_venv build/venv-hf scripts/requirements-hf.txt "torch, transformers, safetensors" " (about 2.9 GB to download)"
fi

# The CUDA backend's header-only libraries (cuDNN frontend, CUTLASS), pinned, into build/third_party.
if command -v nvcc >/dev/null || [[ -n ${CUDACXX:-} ]]; then
  scripts/fetch-headers.sh
fi

echo "setup: configuring build/ (cmake --preset release)"
cmake --preset release -DFP8MOE_PYTHON="$PWD/$venv/bin/python3" >/dev/null
echo "setup: building build/ (cmake --build --preset release)"
cmake --build --preset release
echo "setup: done: build/fp8moe"
