#!/usr/bin/env bash
# The simulated runs behind BENCHMARKS.md's "Round time against hosts" table and
# its plot, and the issue's 64-host target command with one measured round:
# `dlcp simulate` on a 2:1 leaf-spine (4 spines, a quarter of the hosts a leaf,
# 10 Gbit/s), 1 MB rounds, 1 warm-up and 5 measured, seed 0; every mode, clean
# and at 1 % loss (32 hosts clean only), the ring beside transpose. Virtual
# time: the records do not depend on the machine's load (their wall_s does).
# About 15 minutes of CPU on 2 cores.
# Usage: bash bench/run_sim_scale.sh [OUT]   (default bench/results/sim)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/sim}
mkdir -p "$OUT"
DLCP=${DLCP:-dlcp}

sim() {  # sim FILE ARGS...: one run, its records in OUT/FILE
    local file=$1
    shift
    echo "== $(date +%T) $file: dlcp simulate $*"
    $DLCP simulate "$@" --quiet --json "$OUT/$file"
}

for n in 4 16 32; do
    for scenario in clean loss; do
        [ "$n" = 32 ] && [ "$scenario" = loss ] && continue
        extra=()
        [ "$scenario" = loss ] && extra=(--loss 1)
        for mode in transpose ps switch; do
            backends=dlcp
            [ "$mode" = transpose ] && backends=dlcp,ring
            sim "scale-$n-$mode-$scenario.json" --hosts "$n" --topology leafspine \
                --hosts-per-leaf $((n / 4)) --spines 4 --oversub 2 --rate 10gbit --size 1MB \
                --iters 5 --warmup 1 --mode "$mode" --scenario "$scenario" "${extra[@]}" \
                --backends "$backends"
        done
    done
done
for scenario in clean loss; do
    extra=()
    backends=dlcp
    [ "$scenario" = loss ] && extra=(--loss 1) && backends=dlcp,ring
    sim "scale-64-target-$scenario-1round.json" --hosts 64 --topology leafspine --oversub 2 \
        --rate 10gbit --size 10MB --scenario "$scenario" "${extra[@]}" --backends "$backends" \
        --iters 1 --warmup 1
done
python3 - "$OUT" <<'EOF'
import glob, json, sys
from pathlib import Path
from dlcp.sim.plots import scaling

out = Path(sys.argv[1])
rows = [r for f in sorted(glob.glob(str(out / "scale-[0-9]*-*-*.json")))
        if "target" not in f for r in json.load(open(f))]
scaling(rows, out / "scale-p50.png")
for r in sorted(rows, key=lambda r: (r["scenario"], r["mode"], r["hosts"])):
    drops = ",".join(str(x) for x in r["drops_per_class"])
    print(f"| {r['scenario']} | {r['mode']} | {r['hosts']} | {r['p50_s']:.4f} | "
          f"{r['p99_s']:.4f} | {r['loss_frac']:.2%} | {drops} |")
EOF
