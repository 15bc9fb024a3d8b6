#!/bin/bash
# Issue 44's checks on an NVIDIA GPU through MLX's CUDA backend (../shared/gpu/README.md):
# copy this over the last transfer's check.sh after `prepare.sh`, then run it as that README
# says. Each step has its own time limit (at most 9 minutes in all, about 5 as a rule), so one that hangs leaves
# the others their say; every result lands in $OUT.
set -u
source "$(dirname "$0")/setup.sh"
cd /tmp/proj
mkdir -p /tmp/o  # $OUT brings back 8 files at most: the rest stays here
step sanity
nvidia-smi -L; python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
P="Repeat this sentence exactly: Speculative decoding drafts several tokens cheaply, and the large model checks them all in one pass."
step "generate: plain, then the default (prompt lookup, adaptive k, weights auto), fresh cache"
for run in plain lookup lookup2; do  # lookup2: the calibration cached
  args=(); [ $run = plain ] && args=(-p none)
  s=$(date +%s%N)
  limit=45; [ $run = lookup ] && limit=75
  PYTHONFAULTHANDLER=1 timeout -s ABRT $limit mlxspec generate "$P" -n 96 "${args[@]}" --json > $OUT/$run.json 2> /tmp/o/$run.err
  echo "$run rc=$? whole command $(( ($(date +%s%N) - s) / 1000000 )) ms"
  grep -v '^  File "/tmp/site' /tmp/o/$run.err | tr '\r' '\n' | tail -8
done
python3 - <<'PY'
import json, os
for n in ("plain", "lookup", "lookup2"):
    try:
        r = json.load(open(f"{os.environ['OUT']}/{n}.json"))["record"]
        print(n, {k: r.get(k) for k in ("completion_tokens", "tokens_per_second", "time_to_first_token",
              "estimated_speedup", "accepted", "drafted", "near_ties", "weights", "device", "lossless")})
    except Exception as e: print(n, "no record:", e)
PY
timeout 20 mlxspec models --json 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['models'][0].get('weights_form'))"
cat /root/.cache/mlxspec/calibration.json 2>/dev/null | head -c 1500; echo
step lossless tests
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_lossless.py 2>&1 | grep -E "FAILED|passed|failed|error" | head -20
step "bench -c 8: batched plain and lookup against mlx-lm's batch_generate"
timeout 120 mlxspec bench -c 8 --suite all -n 64 --proposers prompt-lookup --json /tmp/o/conc.json --markdown /tmp/o/conc.md > $OUT/conc.log 2>&1; echo rc=$?; tail -14 $OUT/conc.log
step "the draft pair on quantized weights (crashed at 6c16009)"
timeout 45 mlxspec generate "$P" -n 64 -p draft-model --json > $OUT/draft.json 2> /tmp/o/draft.err; echo rc=$?; tail -3 /tmp/o/draft.err
python3 -c "import json,os; r=json.load(open(os.environ['OUT']+'/draft.json'))['record']; print({k: r.get(k) for k in ('tokens_per_second','drafted','accepted','weights')})"
step "host work per round: tiny llama, Engine.stream and the scheduler against mlx-lm"
timeout 45 python3 benchmarks/host_overhead.py --part single --repeats 5 2>&1 | tail -6
timeout 40 python3 benchmarks/host_overhead.py --part batch --repeats 3 2>&1 | tail -5
step "synthetic acceptance 0.9, k 4 and 8"
timeout 50 mlxspec bench --synthetic-acceptance 0.9 --k 4 --k 8 --prompts benchmarks/long-answers.jsonl -n 128 --repeats 2 --json $OUT/synthetic.json 2>&1 | tail -5
step done
