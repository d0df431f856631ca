#!/bin/bash
# Session 2, GPU call 1, on nvidia-h200-x2. Two lanes at once, one GPU each:
#   GPU 1: the draft shortlist for synthetic-9b (from random-512-offline, never the benchmark
#          prompts), then training the built-in small model (issue 7);
#   GPU 0: spec benchmark configurations fast-serial and spec-naive, timed only (audited
#          together with the others in a later call).
# Everything comes back as two archives plus logs ($OUT keeps at most 8 files).
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L runs/specbench
nvidia-smi --query-gpu=index,name,memory.used --format=csv > $L/gpus.txt
(
  CUDA_VISIBLE_DEVICES=1 timeout 120 python -m decoders.shortlist --model synthetic-9b \
      --prompts random-512-offline -n 64 --size 32768 --out runs/sl.json > $L/shortlist.log 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 450 python -m fixtures.train_small --out /tmp/small --minutes 5.5 \
      2>&1 | grep -v "falling back" > $L/train_small.log
  echo "train rc ${PIPESTATUS[0]}" >> $L/train_small.log
) &
lane1=$!
B="python bench/spec_bench.py --out runs/specbench --shortlist runs/sl.json --no-audit"
CUDA_VISIBLE_DEVICES=0 timeout 150 $B --configs fast-serial > $L/bench_gpu0.log 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 390 $B --configs spec-naive >> $L/bench_gpu0.log 2>&1
wait $lane1
[ -d /tmp/small ] && tar -C /tmp -cf - small | split -b 15M -d - $OUT/small.tar.
tar -czf $OUT/runs.tgz runs
grep -h '"type": "end"' runs/specbench/*/stream.jsonl | cut -c1-300
tail -5 $L/train_small.log; ls -la $OUT
