#!/usr/bin/env bash
# Set-up + the main job: fp8moe on configs/tiny.yaml over 8 MPI ranks (tensor 2 x pipeline 2 x
# data 2, expert 2). For now it validates the config, builds the process grid and prints both;
# training itself arrives with the later issues.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
source scripts/mpi-env.sh
echo "demo: mpirun -np 8 --oversubscribe build/fp8moe train configs/tiny.yaml"
mpirun -np 8 --oversubscribe build/fp8moe train configs/tiny.yaml
