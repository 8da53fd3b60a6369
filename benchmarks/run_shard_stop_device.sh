#!/usr/bin/env bash
# Issue 43, part 3: how long `tokenwire launch --num-shard N` takes to stop on SIGTERM on GPUs
# (NCCL process groups, symmetric-memory all-reduce), in one device call (~2 min): a tiny llama
# is made on the device, served with N = 2 (and 4 when the host has 4 GPUs), stopped once ready;
# prints the seconds from SIGTERM to the launcher's exit and the shards' "stop:" log lines (gRPC
# server stopped, process group torn down or given up) and any "did not stop in time" kill.
# Call: bash benchmarks/run_shard_stop_device.sh   (carry .whl-tw). Outputs: $OUT/stop_*.log
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
OUT=${OUT:?set OUT}
model=/tmp/tw_stop_tiny
[ -d $model ] || python3 -m service.app.cli make-tiny-model $model --arch llama > /dev/null
gpus=$(nvidia-smi -L | grep -c "^GPU")
for n in 2 4; do
  (( n > gpus )) && continue
  log=$OUT/stop_tp$n.log
  python3 -m service.app.cli launch --model-id $model --num-shard $n --port $((40000 + n)) \
    --max-total-tokens 256 > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do grep -q "launch: ready in" "$log" && break; sleep 0.5; done
  t0=$(date +%s.%N); kill -TERM $pid; wait $pid; rc=$?
  secs=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
  echo "TP=$n: $(grep -o 'ready in [0-9.]*s' "$log" | head -1); stopped ${secs} s after SIGTERM (exit $rc)"
  grep -E "stop:|did not stop|launch: stopped" "$log" | sed 's/^/    /'
done
