#!/usr/bin/env bash
# The runs behind BENCHMARKS.md (about 90 minutes on 2 cores; needs root).
# Usage: sudo bash bench/run_all.sh [OUT]   (default OUT: bench/results)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results}
DLCP=${DLCP:-"python -m dlcp"}
# 200 Mbit/s, where the links and not the two cores are the bottleneck (10 MB, the size of the DESIGN.md baseline)
$DLCP bench all --only allreduce --rates 200mbit --size 10MB --iters 20 --out "$OUT" --no-progress
# time to accuracy at 100 Mbit/s, 60 steps, each backend stopped after 150 s at most
$DLCP bench all --only train --train-rate 100mbit --steps 60 --budget 150 --out "$OUT" --no-progress
# the issue's configuration: 32 MB, 20 iterations, 1 Gbit/s links
$DLCP bench all --only allreduce --rates 1gbit --size 32MB --iters 20 --out "$OUT" --no-progress
$DLCP bench report "$OUT" > /dev/null
echo "results in $OUT (summary.md)"
