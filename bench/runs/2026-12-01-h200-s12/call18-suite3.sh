#!/bin/bash
# The whole suite on the H200 in three pytest processes side by side: A (every file but B's),
# B1 = test_cuda then test_retime, B2 = the rest of B. Also: can nvidia-smi see a process's GPU
# context from inside this machine (for a GPU-load check in audit retime)?
set -u
python -m pip install -q --no-deps --no-index .whl/*.whl >/dev/null 2>&1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
L=$OUT; { hostname; nvidia-smi -L; date -u; nproc --all; } > $L/host.txt
B1="tests/test_cuda.py tests/test_retime.py"
B2="tests/test_prefill.py tests/test_runtime.py tests/test_serial.py tests/test_shortlist.py tests/test_spec.py tests/test_timing_integrity.py tests/test_trace.py tests/test_train.py"
A=$(ls tests/test_*.py | grep -v -x -F "$(echo $B1 $B2 | tr ' ' '\n')" | tr '\n' ' ')
{ echo "A: $A"; echo "B1: $B1"; echo "B2: $B2"; ls tests/test_*.py | wc -l; echo $A $B1 $B2 | wc -w; } > $L/parts.txt
s=$SECONDS
run() { local name=$1; shift; timeout 520 python -m pytest -q -rfEs --tb=long -p no:cacheprovider --durations=25 "$@" > $L/suite-$name.log 2>&1; echo "$name rc=$? $((SECONDS - s)) s" >> $L/steps.txt; }
run A $A & run B1 $B1 & run B2 $B2 &
sleep 20
{ echo "pid of a torch process holding a context: see below"; python -c "
import os, subprocess, time, torch
x = torch.ones(1, device='cuda'); torch.cuda.synchronize()
print('own pid', os.getpid())
print(subprocess.run(['nvidia-smi', '--query-compute-apps=pid,process_name,used_memory', '--format=csv,noheader'], capture_output=True, text=True).stdout)
"; } > $L/gpu-apps.txt 2>&1
wait
cat $L/parts.txt $L/steps.txt $L/gpu-apps.txt; for p in A B1 B2; do grep -n "^FAILED\|^ERROR\| passed\| failed" $L/suite-$p.log | tail -5; done
