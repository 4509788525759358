#!/usr/bin/env bash
# Session 9 call 1: where a decode-time eviction round's time goes (real shape), SnapKV interval 256 at b5/max, KVzip 32K prefill profile.
set -x
OUT=$1; C=$2
mkdir -p $OUT
M=packages/sparse-serve/src/sparse_serve/bench/configs/qwen3-8b
E=(python3 benchmarks/eviction_step.py --model $M --device cuda --prompt-len 131072 --budget 64,7616,512 --window 32 --interval 64 --rounds 2 --torch-profile)
timeout 120 "${E[@]}" --batch 5 > $OUT/round_b5.txt 2>&1; tail -3 $OUT/round_b5.txt
timeout 150 "${E[@]}" --batch 91 > $OUT/round_b91.txt 2>&1; tail -3 $OUT/round_b91.txt
B=(python3 -m sparse_serve.cli bench --no-progress --commit "$C" --prompt-len 131072 --output-len 2048)
S=(--sink-keep-tokens 64 --decode-keep-tokens 7616 --recent-keep-tokens 512)
timeout 100 "${B[@]}" --out $OUT/ev --batch-size 5 --timed-steps 256 --max-num-seqs 8 > $OUT/ev_log.txt 2>&1
timeout 120 "${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --decode-eviction-interval 256 --batch-size 5 --timed-steps 600 --max-num-seqs 192 >> $OUT/ev_log.txt 2>&1
timeout 150 "${B[@]}" --out $OUT/ev --append --sparse-method snapkv "${S[@]}" --decode-eviction-interval 256 --batch-size max --timed-steps 600 --profile-steps 3 --max-num-seqs 192 >> $OUT/ev_log.txt 2>&1
tail -n 12 $OUT/ev/bench.md
K=(--prefill real --prompt-len 32768 --output-len 16 --batch-size 1 --max-num-batched-tokens 4096 --max-num-seqs 4 --profile-prefill)
timeout 60 "${B[@]}" --out $OUT/kvzip "${K[@]}" > $OUT/kvzip_log.txt 2>&1
timeout 120 python3 -m cProfile -o $OUT/kvzip.prof -m sparse_serve.cli bench --no-progress --commit $C --out $OUT/kvzip --append "${K[@]}" --sparse-method kvzip --tokenizer packages/sparse-serve/src/sparse_serve/assets/tiny-retrieval >> $OUT/kvzip_log.txt 2>&1
python3 -c "import pstats; pstats.Stats('$OUT/kvzip.prof').sort_stats('cumulative').print_stats(45)" > $OUT/kvzip_prof.txt 2>&1
python3 -c "import pstats; pstats.Stats('$OUT/kvzip.prof').sort_stats('tottime').print_stats(25)" >> $OUT/kvzip_prof.txt 2>&1
rm -f $OUT/kvzip.prof
tail -n 8 $OUT/kvzip/bench.md
