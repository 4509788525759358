#!/usr/bin/env bash
# Session 13 call 4: the count selection (cluster_select, radix select over (row, chunk) programs) timed beside the
# chunk-sorted order it replaced (commit 2a8aa25: bash run.sh OUT 2a8aa25 from a tree holding it).
set -x
OUT=$1; C=$2
mkdir -p $OUT
timeout 240 python3 benchmarks/retroinfer_kernel_probe.py > $OUT/probe.txt 2>&1; cat $OUT/probe.txt | tail -60
