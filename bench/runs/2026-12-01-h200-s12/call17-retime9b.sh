#!/bin/bash
# GPU call: audit retime of a synthetic-9b fast-serial stream with the process-tree stop and the
# wait-for-a-CPU check (session 11); prints each prompt's waits. ~3 min.
set -u
python -m pip install -q --no-deps --no-index .whl/*.whl >/dev/null 2>&1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R; L=$OUT
{ hostname; nvidia-smi -L; date -u; } > $L/host.txt
step() { local name=$1 t=$2; shift 2; local s=$SECONDS; timeout $t "$@" > $R/$name.log 2>&1; local rc=$?
  printf '%-14s rc=%-3s %4d s\n' $name $rc $((SECONDS - s)) | tee -a $L/steps.txt; }
step fs 200 python -m harness time --model synthetic-9b --prompts random-512 --limit 4 -n 128 --legs 2 --force --decoder fast-serial --out $R/fs
step retime 300 python -m audit retime $R/fs/stream.jsonl --prompts 4
cp $R/fs/stream.jsonl $R/fs/retime.json $R/*.log $L/ 2>/dev/null
cat $L/steps.txt
tail -22 $R/retime.log
python - $R/fs/retime.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for e in d["prompts"]:
    print(e["id"], round(e["ratio"], 3), "waited", {k: round(v, 3) for k, v in e["waited"].items() if v is not None},
          "others", {k: round(v, 2) for k, v in e["others_load"].items() if v is not None})
print("findings", [f["check"] for f in d["findings"]], "second_look", d["second_look"])
PY
