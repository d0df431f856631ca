#!/bin/bash
# Session 2, GPU call 2, on nvidia-h200-x2 (carry: runs, holding call 1's streams and shortlist).
#  1. two timing lanes at once, one GPU each: the rest of the spec benchmark (issue 6);
#  2. GPU 0 audits every benchmark stream in one process (each distinct prompt replayed once);
#     GPU 1 meanwhile times `spec` on one GPU for issue 8 and audits it;
#  3. the same run across both GPUs with torchrun, its sharded audit, and a one-GPU audit of that
#     stream (the two verdicts must agree).
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
B="python bench/spec_bench.py --out runs/specbench --shortlist runs/sl.json --no-audit"
CUDA_VISIBLE_DEVICES=1 timeout 300 $B --configs inst-0.95,spec@fs,inst-0.6@fs,inst-0.85@fs,inst-0.95@fs > $L/bench_gpu1.log 2>&1 &
CUDA_VISIBLE_DEVICES=0 timeout 300 $B --configs spec,inst-0.6,inst-0.85 > $L/bench_gpu0.log 2>&1
wait
T="time --model synthetic-9b --decoder spec --prompts random-512 --limit 4 -n 128 --legs 1 --force"
CUDA_VISIBLE_DEVICES=0 timeout 150 python -m audit replay runs/specbench/*/stream.jsonl > $L/audit_bench.log 2>&1 &
( s=$(date +%s%N); CUDA_VISIBLE_DEVICES=1 timeout 100 python -m harness.cli $T --out runs/x1 > $L/x1.log 2>&1
  echo "x1 harness wall $(( ($(date +%s%N) - s) / 1000000 )) ms" >> $L/walls.txt
  s=$(date +%s%N); CUDA_VISIBLE_DEVICES=1 timeout 60 python -m audit replay runs/x1/stream.jsonl > $L/audit_x1.log 2>&1
  echo "x1 audit wall $(( ($(date +%s%N) - s) / 1000000 )) ms" >> $L/walls.txt ) &
wait
R="python -m torch.distributed.run --nproc-per-node 2"
s=$(date +%s%N); timeout 100 $R -m harness $T --out runs/x2 > $L/x2.log 2>&1; rc=$?
echo "x2 harness wall $(( ($(date +%s%N) - s) / 1000000 )) ms rc $rc" >> $L/walls.txt
s=$(date +%s%N); timeout 60 $R -m audit replay runs/x2/stream.jsonl > $L/audit_x2.log 2>&1
echo "x2 audit wall $(( ($(date +%s%N) - s) / 1000000 )) ms" >> $L/walls.txt
CUDA_VISIBLE_DEVICES=0 timeout 60 python -m audit replay runs/x2/stream.jsonl --out runs/x2/audit-1gpu.json > $L/audit_x2_1gpu.log 2>&1
tar -czf $OUT/runs.tgz runs
cat $L/walls.txt; tail -3 $L/audit_bench.log
python bench/spec_bench.py --out runs/specbench --table-only 2>&1 | tail -12
