#!/bin/bash
# Issue 44's checks on an NVIDIA GPU through MLX's CUDA backend (../shared/gpu/README.md):
# copy this over the last transfer's check.sh after `prepare.sh`, then run it as that README
# says. Each step has its own time limit (about 7 minutes in all), so one that hangs leaves
# the others their say; every result lands in $OUT.
set -u
source "$(dirname "$0")/setup.sh"
cd /tmp/proj
step sanity
nvidia-smi -L; python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
P="Repeat this sentence exactly: Speculative decoding drafts several tokens cheaply, and the large model checks them all in one pass."
step "generate: plain, then the default (prompt lookup, adaptive k, weights auto), fresh cache"
for run in plain lookup; do
  args=(); [ $run = plain ] && args=(-p none)
  s=$(date +%s.%N)
  PYTHONFAULTHANDLER=1 timeout -s ABRT 90 mlxspec generate "$P" -n 96 "${args[@]}" --json > $OUT/$run.json 2> $OUT/$run.err
  echo "$run rc=$? whole command $(echo "$(date +%s.%N) - $s" | bc) s"
  grep -v '^  File "/tmp/site' $OUT/$run.err | tail -5
done
python3 - <<'PY'
import json, os
for n in ("plain", "lookup"):
    try:
        r = json.load(open(f"{os.environ['OUT']}/{n}.json"))["record"]
        print(n, {k: r.get(k) for k in ("completion_tokens", "tokens_per_second", "time_to_first_token",
              "estimated_speedup", "accepted", "drafted", "near_ties", "weights", "device", "lossless")})
    except Exception as e: print(n, "no record:", e)
PY
timeout 20 mlxspec models --json 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['models'][0].get('weights_form'))"
cat /root/.cache/mlxspec/calibration.json 2>/dev/null | head -c 1500; echo
step lossless tests
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_lossless.py 2>&1 | grep -E "FAILED|passed|failed|error" | head -20
step "bench -c 8: batched plain and lookup against mlx-lm's batch_generate"
timeout 140 mlxspec bench -c 8 --suite all -n 64 --proposers prompt-lookup --json $OUT/conc.json --markdown $OUT/conc.md > $OUT/conc.log 2>&1; echo rc=$?; tail -14 $OUT/conc.log
step "host work per round: tiny llama, Engine.stream and the scheduler against mlx-lm"
timeout 60 python3 benchmarks/host_overhead.py --part single --repeats 5 2>&1 | tail -6
timeout 50 python3 benchmarks/host_overhead.py --part batch --repeats 3 2>&1 | tail -5
step "synthetic acceptance 0.9, k 4 and 8"
timeout 60 mlxspec bench --synthetic-acceptance 0.9 --k 4 --k 8 --prompts benchmarks/long-answers.jsonl -n 128 --repeats 2 --json $OUT/synthetic.json 2>&1 | tail -5
step "bench quick (every proposer kind of the default model)"
timeout 90 mlxspec bench --suite quick -n 64 --json $OUT/quick.json --markdown $OUT/quick.md > $OUT/quick.log 2>&1; echo rc=$?; tail -16 $OUT/quick.log
step done
