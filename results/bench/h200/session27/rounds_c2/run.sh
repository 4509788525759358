#!/usr/bin/env bash
# Session 27 call 2 (issue 15): where a decode-time eviction round of SnapKV-8192 goes at dense's batch (5) and at a
# large batch (64), 128K prompts: every step synchronized and timed, round 3 under cProfile, round 4 under
# torch.profiler (roundwrap.py).
OUT=$1; C=$2
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/clocks.txt
SNAP=(--sparse-method snapkv --sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512 --decode-eviction-interval 256)
for B in 5 64; do
  PROF_OUT=$OUT/b$B timeout 200 python3 roundwrap.py bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048 \
    --max-num-seqs $B --batch-size $B --timed-steps 1100 --out $OUT/logs/bench$B "${SNAP[@]}" > $OUT/logs/b$B.txt 2>&1
  tail -3 $OUT/logs/b$B.txt
  python3 -c "
import json,sys; d=json.load(open('$OUT/b$B.steps.json')); r=d['rounds']; s=d['steps_ms']
print('batch $B rounds', r); print(' round ms', [s[i] for i in r if i < len(s)], 'next', [s[i+1] for i in r if i+1 < len(s)])
m=sorted(s[5:]); print(' median step', m[len(m)//2])"
  head -45 $OUT/b$B.host.txt | cut -c1-200
  head -40 $OUT/b$B.dev.txt | cut -c1-200
done
(cd $OUT && tar czf logs.tgz logs && rm -rf logs)
