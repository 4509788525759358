#!/usr/bin/env bash
# The agent-workload benchmark of results/agent, as run on one H200 (Qwen3-8B shape, dummy bf16
# weights, real prefill). Usage, from the repository root with the packages importable
# (`uv run` here, or PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':') on the GPU box):
#   COMMIT=<sha> bash results/agent/run_h200.sh OUT_DIR [short|long|long256|best]
# short (default): the first run (results/agent/h200, 5 turns, sessions ~13K tokens, ~140 s).
# long: the second run (results/agent/h200/long, 10 turns, sessions ~34-37K tokens, <= 250 s).
# long256: the long workload with 256 generated tokens per turn, dense S=5 and SnapKV S=32, 8 (<= 230 s).
# best: the long workload again (issue 16: after the prefill work), dense S=5,4,6 and SnapKV S=32,16 (<= 300 s).
# Each system runs in its own process (one engine, weights loaded once) over several concurrency
# levels S; --max-seconds skips a run that would not fit the device-time budget (recorded in the
# report), `timeout` is the hard stop (the report is rewritten after every run, so it survives).
# Both runs cap the KV pool at 10240 blocks of 16 tokens (160K tokens, 22.5 GiB; the card would give
# ~49,000 at gpu_memory_utilization 0.9): dense runs out of KV memory at S values and session lengths
# that fit our device time; the full pool moves the same limits to ~4.8x the sessions. Chunk
# (max_num_batched_tokens) 4096. Each engine first runs a small untimed warm-up (2 sessions, 3 turns,
# 8 tokens out: kernels compiled, compression exercised).
set -uo pipefail
OUT=${1:-results/agent/h200}
RUN=${2:-short}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
COMMON=(python3 -m sparse_serve.cli bench-agent --commit "$COMMIT" --out "$OUT"
  --num-kv-blocks 10240 --max-num-batched-tokens 4096 --max-num-seqs 64)
# SnapKV budget 4096 = 64 sink + 3520 scored + 512 recent, window 32 (method defaults otherwise): each
# turn names the session's chain and sends only the tool output. Dense + radix resubmits the history.
SNAPKV=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 3520 --recent-keep-tokens 512)

if [ "$RUN" = short ]; then
  # 5 turns: system prompt (1024, shared by all sessions) + task (512), then 4 tool outputs of
  # 2048-3072 random tokens; 128 generated tokens per turn (ignore_eos). Sessions reach ~13K tokens.
  AGENT=("${COMMON[@]}" --turns 5 --system-tokens 1024 --task-tokens 512 --tool-tokens 2048,3072 --output-tokens 128)
  timeout 110 "${AGENT[@]}" --sessions 8,16,4 --max-seconds 100 2>&1 | grep -v Warning | tee "$OUT/log-dense.txt"
  timeout 130 "${AGENT[@]}" --append --sessions 16,32,8 --max-seconds 120 "${SNAPKV[@]}" 2>&1 | grep -v Warning \
    | tee "$OUT/log-snapkv.txt"
elif [ "$RUN" = long ]; then
  # 10 turns: system 1024 + task 512, then 9 tool outputs of 3072-3840 tokens, 128 generated per turn.
  # Sessions end at ~34-37K tokens: 4 of them fill the capped pool, so dense at S=8 must evict and
  # re-prefill (or preempt), while a SnapKV session holds at most ~8K slots. 128 (not 256) generated
  # tokens per turn keep the six runs inside the device time (decode steps = turns x output tokens).
  # Order: the runs that matter most first; the guard skips the last one of each system if short.
  AGENT=("${COMMON[@]}" --turns 10 --system-tokens 1024 --task-tokens 512 --tool-tokens 3072,3840 --output-tokens 128)
  # Dense at S=8 (matched with SnapKV) first, then 4-6 around its best concurrency.
  timeout 175 "${AGENT[@]}" --sessions 8,4,5,6 --max-seconds 165 2>&1 | grep -v Warning | tee "$OUT/log-dense.txt"
  timeout 150 "${AGENT[@]}" --append --sessions 8,16,32 --max-seconds 140 "${SNAPKV[@]}" 2>&1 | grep -v Warning \
    | tee "$OUT/log-snapkv.txt"
elif [ "$RUN" = long256 ]; then
  # The long workload with 256 generated tokens per turn (the "a few hundred"), each system at
  # its best concurrency from the 128-token run (dense S=5, SnapKV S=32), then SnapKV at S=8.
  AGENT=("${COMMON[@]}" --turns 10 --system-tokens 1024 --task-tokens 512 --tool-tokens 3072,3840 --output-tokens 256)
  timeout 80 "${AGENT[@]}" --sessions 5 --max-seconds 70 2>&1 | grep -v Warning | tee "$OUT/log-dense.txt"
  timeout 150 "${AGENT[@]}" --append --sessions 32,8 --max-seconds 140 "${SNAPKV[@]}" 2>&1 | grep -v Warning \
    | tee "$OUT/log-snapkv.txt"
elif [ "$RUN" = best ]; then
  # Issue 16: the long workload (128 generated tokens per turn, as run 3) re-run with the faster prefill,
  # each system at and around its best concurrency from run 3 (dense S=5, SnapKV S=32).
  AGENT=("${COMMON[@]}" --turns 10 --system-tokens 1024 --task-tokens 512 --tool-tokens 3072,3840 --output-tokens 128)
  timeout 150 "${AGENT[@]}" --sessions 5,4,6 --max-seconds 140 2>&1 | grep -v Warning | tee "$OUT/log-dense.txt"
  timeout 150 "${AGENT[@]}" --append --sessions 32,16 --max-seconds 140 "${SNAPKV[@]}" 2>&1 | grep -v Warning \
    | tee "$OUT/log-snapkv.txt"
else
  echo "unknown run $RUN (short, long, long256 or best)" >&2
  exit 2
fi
