#!/bin/bash
# host-overhead GPU check: dense decode bench, old (89a1260 versions of the host-overhead files) vs new, then CUDA tests
# and the stub-model host timing, inside one 150 s call. Everything under $OUT.
NEW=/tmp/site:$(ls -d packages/*/src | tr '\n' ':')tests
OLD=/tmp/site:$(ls -d .ho_old/packages/*/src | tr '\n' ':')tests
L=$OUT/log.txt
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( 143 - $(el) )); }
nvidia-smi -L >> $L 2>&1
B="python3 -m sparse_serve.cli bench --no-progress --prompt-len 32768,131072 --batch-size 1,max --output-len 64 --timed-steps 40 --profile-steps 3 --max-num-seqs 32"
echo "== bench new (t=$(el))" >> $L
PYTHONPATH=$NEW timeout 62 $B --commit "new:ed7df58+tree" --out $OUT/new >> $L 2>&1; echo "rc=$? t=$(el)" >> $L
echo "== bench old (t=$(el))" >> $L
PYTHONPATH=$OLD timeout 52 $B --commit "old:89a1260-files+tree" --out $OUT/old >> $L 2>&1; echo "rc=$? t=$(el)" >> $L
rm -f $OUT/new/*.png $OUT/old/*.png
echo "== tests + host timing (t=$(el), left $(left))" >> $L
if [ $(left) -gt 8 ]; then
  (PYTHONPATH=$NEW timeout $(( $(left) - 2 )) python3 -m pytest -q -x -p no:cacheprovider packages/sparse-kernels/tests/test_cuda_graph.py packages/sparse-kernels/tests/test_triton_decode.py tests/test_cuda_engine.py > $OUT/tests.txt 2>&1; echo "rc=$? t=$(el)" >> $OUT/tests.txt) &
  for v in NEW OLD; do
    echo "-- host_overhead $v (concurrent with the tests: noisy)" >> $OUT/host.txt
    PYTHONPATH=${!v} timeout $(( $(left) / 2 )) python3 benchmarks/host_overhead.py --device cuda --case 23x32768 --steps 15 --warmup 3 >> $OUT/host.txt 2>&1
  done
  wait
fi
echo "done t=$(el)" >> $L
