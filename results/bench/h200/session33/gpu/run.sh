#!/usr/bin/env bash
# Session 33 call 6: every default-run test marked `gpu` on the H200 (the server tests left out: the GPU box has no
# openai client), at 9e86b68 (RetroInfer's new defaults). From the repository root, packages importable:
# bash run.sh OUT
OUT=$1; mkdir -p $OUT
timeout 400 python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" -rfE --durations=25 \
  --ignore=tests/test_server.py --ignore=tests/test_server_chains.py --ignore=tests/test_server_openai_surface.py \
  > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
