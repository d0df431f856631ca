#!/bin/bash
# GPU call: audit retime's GpuWatch on the H200. (1) an honest 9B fast-serial retime: expect
# gpu_processes samples > 0, foreign [], PASS. (2) the same stream retimed while an outside python
# process holds a GPU context and runs matmuls: expect gpu-shared FAIL naming its pid. Then the suite.
set -u
python -m pip install -q --no-deps --no-index .whl/*.whl >/dev/null 2>&1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R; L=$OUT
{ hostname; nvidia-smi -L; date -u; } > $L/host.txt
step() { local name=$1 t=$2; shift 2; local s=$SECONDS; timeout $t "$@" > $R/$name.log 2>&1; local rc=$?
  printf '%-14s rc=%-3s %4d s\n' $name $rc $((SECONDS - s)) >> $L/steps.txt; }
step fs 150 python -m harness time --model synthetic-9b --prompts random-512 --limit 2 -n 64 --legs 2 --force --decoder fast-serial --out $R/fs
step honest 150 python -m audit retime $R/fs/stream.jsonl --prompts 2 --out $R/honest.json
python -c "
import torch, time
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)
end = time.time() + 170
while time.time() < end:
    a @ a; torch.cuda.synchronize(); time.sleep(0.05)
" & OUTSIDER=$!
sleep 15
step outsider 150 python -m audit retime $R/fs/stream.jsonl --prompts 2 --out $R/outsider.json
kill $OUTSIDER 2>/dev/null
cp $R/honest.json $R/outsider.json $R/*.log $L/ 2>/dev/null
cat $L/steps.txt; echo "outsider pid $OUTSIDER"
for f in honest outsider; do python - $R/$f.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1], d["verdict"], d["gpu_processes"], [f["check"] for f in d["findings"]])
PY
done
