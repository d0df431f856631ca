#!/bin/bash
# Session 6, call 3 (issue 7): sequence-level unlikelihood fine-tunes of the v2 model (dropout 0.2,
# weight decay 0.3; trained in call 1, carried in runs/v2), three settings run concurrently
# (update-count based, so sharing the GPU changes only wall time). Choose on dev figures only.
set -u
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
{ hostname; nvidia-smi -L; date -u; } > $L/host.txt
run() {  # NAME FLAGS...
  name=$1; shift
  timeout 540 python -m fixtures.train_small --out $OUT/$name --init-from runs/v2 "$@" > $L/$name.log 2>&1
  tar -czf $OUT/$name.tgz -C $OUT $name && rm -rf $OUT/$name
}
run u100 --unloop-steps 100 --unloop-lr 1e-4 &
run u300 --unloop-steps 300 --unloop-lr 1e-4 &
run u300hi --unloop-steps 300 --unloop-lr 3e-4 &
wait
for n in u100 u300 u300hi; do
  echo "== $n"; grep -E "unloop [0-9]+/|after|held-out:|spec \(|wrote" $L/$n.log | tail -6
  tar -xzOf $OUT/$n.tgz $n/quality.json | python -c "
import json,sys; q=json.load(sys.stdin)
print('$n dev ntp', round(q['dev']['ntp_loss'],4), 'dev loops', q['dev_repetition']['looping_fraction'],
      '| held-out ntp', round(q['heldout']['ntp_loss'],4), 'held-out loops', q['repetition']['looping_fraction'],
      'distinct4', round(q['repetition']['distinct_4gram_mean'],3))"
done
