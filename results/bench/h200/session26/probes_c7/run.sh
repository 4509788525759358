#!/usr/bin/env bash
# Session 26 call 7 (probes for the next change to the prefill): torch's cuDNN varlen attention (causal alignment,
# plan keys, paged K/V, speed) and the prefill GEMM shapes under cuBLAS and cuBLASLt.
OUT=$1
mkdir -p $OUT
timeout 90 python3 $(dirname $0)/varlen_probe.py > $OUT/varlen.txt 2>&1; cat $OUT/varlen.txt | cut -c1-400
timeout 40 python3 $(dirname $0)/gemm_probe.py > $OUT/gemm.txt 2>&1; cat $OUT/gemm.txt
