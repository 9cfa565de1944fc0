#!/usr/bin/env bash
# Set-up + build + every test: scripts/setup.sh, then ctest on build/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
source scripts/mpi-env.sh
echo "test: ctest --test-dir build --output-on-failure -j $(nproc)"
ctest --test-dir build --output-on-failure -j "$(nproc)"
