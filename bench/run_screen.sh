#!/usr/bin/env bash
# The runs behind BENCHMARKS.md's first screen: the commands of the targets, as
# a user runs them, one after another on a quiet machine (about 15 minutes on
# 2 cores; needs root). Every command writes its JSON under OUT and its output
# goes to OUT/run.log.
# Usage: sudo bash bench/run_screen.sh [OUT] [PART...]
#   PART: ddp, cpu, demo, train (default: these four), and fsdp, overlap (the
#   targets of the torch.distributed backend and of overlap mode, about 8
#   minutes more), congested (DDP steps beside background traffic, 1 minute)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/screen}
shift || true
PARTS=${*:-ddp cpu demo train}
mkdir -p "$OUT"
LOG="$OUT/run.log"
DLCP=${DLCP:-dlcp}
T0=$(date +%s)

run() {  # run NAME CMD...: the command, its output and its time in the log
    local name=$1
    shift
    echo "== $(date +%T) +$(($(date +%s) - T0))s $name: $*" | tee -a "$LOG"
    "$@" 2>&1 | grep -v '^dlcp bench \[' | tee -a "$LOG" || echo "== $name failed: $?" | tee -a "$LOG"
}

git log --oneline -1 | tee -a "$LOG"
for part in $PARTS; do
    case $part in
    ddp)
        # DDP steps through the hook against DDP's own hooks, 3 hosts at 200 Mbit/s
        for codec in fp32 fp16 thc8; do
            run "ddp-clean-$codec" $DLCP bench ddp --hosts 3 --rate 200mbit --grad-size 10MB \
                --steps 30 --codec "$codec" --loss-bound 0.01 --backends dlcp,gloo,gloo-fp16 \
                --no-progress --json "$OUT/ddp-clean-$codec.json"
        done
        for codec in fp32 fp16; do
            run "ddp-loss5-$codec" $DLCP bench ddp --hosts 3 --rate 200mbit --grad-size 10MB \
                --steps 30 --codec "$codec" --loss-bound 0.01 --backends dlcp,gloo,gloo-fp16 \
                --scenario loss --loss 5 --no-progress --json "$OUT/ddp-loss5-$codec.json"
        done
        ;;
    cpu)
        # unshaped 2 hosts: the CPU is the question here (the records say cpu_bound)
        for mtu in 1500 9000; do
            run "unshaped-mtu$mtu" $DLCP bench allreduce --hosts 2 --rate none --size 100MB \
                --iters 10 --backends dlcp,gloo --mtu "$mtu" --no-progress \
                --json "$OUT/unshaped-mtu$mtu.json"
        done
        ;;
    demo)
        run demo $DLCP demo --out "$OUT/demo" --no-progress
        ;;
    train)
        for codec in fp16 thc8; do
            run "train-loss5-$codec" $DLCP bench train --hosts 3 --rate 200mbit --scenario loss \
                --loss 5 --target-acc 0.90 --codec "$codec" --backends dlcp,gloo,gloo-fp16 \
                --no-progress --json "$OUT/train-loss5-$codec.json"
        done
        ;;
    fsdp)
        # FSDP2 through dlcp's torch.distributed backend against Gloo's
        run fsdp-clean $DLCP bench train --model gpt --fsdp --hosts 3 --rate 200mbit \
            --backends dlcp,gloo --steps 50 --no-progress --json "$OUT/fsdp-clean.json"
        run fsdp-loss5 $DLCP bench train --model gpt --fsdp --hosts 3 --rate 200mbit \
            --backends dlcp,gloo --steps 50 --scenario loss --loss 5 --no-progress \
            --json "$OUT/fsdp-loss5.json"
        ;;
    overlap)
        # overlap mode against the same codec without it, and DDP's own hooks
        run overlap-cnn $DLCP bench train --model cnn --hosts 3 --rate 200mbit --codec thc8 \
            --overlap on --backends dlcp,dlcp-nooverlap,gloo,gloo-fp16 --no-progress \
            --json "$OUT/overlap-cnn.json"
        ;;
    congested)
        # DDP steps behind background TCP and UDP, against Gloo in the top class
        run ddp-congested-fp32 $DLCP bench ddp --hosts 3 --rate 100mbit --scenario congested \
            --grad-size 0.67MB --steps 40 --codec fp32 --backends dlcp,gloo-prio --no-progress \
            --json "$OUT/ddp-congested-fp32.json"
        ;;
    *)
        echo "unknown part $part (ddp, cpu, demo, train, fsdp, overlap, congested)" >&2
        exit 2
        ;;
    esac
done
echo "== done +$(($(date +%s) - T0))s" | tee -a "$LOG"
