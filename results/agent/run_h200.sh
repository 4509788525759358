#!/usr/bin/env bash
# The agent-workload benchmark of results/agent, as run on one H200 (Qwen3-8B shape, dummy bf16
# weights, real prefill). Usage, from the repository root with the packages importable
# (`uv run` here, or PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':') on the GPU box):
#   COMMIT=<sha> bash results/agent/run_h200.sh OUT_DIR
# Each system runs in its own process (one engine, weights loaded once) over several concurrency
# levels S; --max-seconds skips a run that would not fit the device-time budget (recorded in the
# report), `timeout` is the hard stop (the report is rewritten after every run, so it survives).
set -uo pipefail
OUT=${1:-results/agent/h200}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
# 5 turns per session: system prompt (1024, shared by all sessions) + task (512), then 4 tool outputs of
# 2048-3072 random tokens; 128 generated tokens per turn (ignore_eos). Sessions reach ~12K tokens.
# KV pool capped at 10240 blocks of 16 tokens (160K tokens, 22.5 GiB) so that dense runs out of KV
# memory at S=16 within the device time we had (see README: with the full ~108 GiB pool the same
# happens at ~4.7x the sessions). Chunk (max_num_batched_tokens) 4096. Each engine first runs a small
# untimed warm-up (2 sessions, 3 turns: kernels compiled, compression exercised).
AGENT=(python3 -m sparse_serve.cli bench-agent --commit "$COMMIT" --out "$OUT"
  --turns 5 --system-tokens 1024 --task-tokens 512 --tool-tokens 2048,3072 --output-tokens 128
  --num-kv-blocks 10240 --max-num-batched-tokens 4096 --max-num-seqs 64)

# 1. dense + radix prefix cache: each turn resubmits the whole history as token ids.
timeout 110 "${AGENT[@]}" --sessions 8,16,4 --max-seconds 100 2>&1 | grep -v Warning | tee "$OUT/log-dense.txt"

# 2. SnapKV + chain, budget 4096 = 64 sink + 3520 scored + 512 recent, window 32 (method defaults
#    otherwise): each turn names the session's chain and sends only the tool output.
timeout 130 "${AGENT[@]}" --append --sessions 16,32,8 --max-seconds 120 --sparse-method snapkv \
  --sink-keep-tokens 64 --decode-keep-tokens 3520 --recent-keep-tokens 512 2>&1 | grep -v Warning \
  | tee "$OUT/log-snapkv.txt"
