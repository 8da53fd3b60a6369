#!/usr/bin/env bash
# Issue 44 item 3 on the GPU machine: vLLM 0.26.0 beside tokenwire, same checkpoint, tokenizer and
# 1,000-request workload, one machine. The machine has no network and takes 64 MiB of carried
# files a call, so vLLM arrives in pieces (benchmarks/vllm_pack.sh makes .vllm-pack/p1, p2, ...)
# that are stashed under /tmp (kept while the machine stays warm) one call at a time:
#
#   bash benchmarks/run_vllm_device.sh stash N    carry [".vllm-pack/pN"]: copies piece N to
#                                                  /tmp/vllm-pack (seconds)
#   bash benchmarks/run_vllm_device.sh install    checks and reassembles the pieces, installs the
#       wheels (--no-deps --no-index) into /tmp/vllm-venv (--system-site-packages, plus the
#       image's own site-packages: the image's python3 is itself a venv), checks `import vllm`,
#       its server module and FA3, and writes the harness's checkpoint to /tmp/twb (~2-3 min)
#   bash benchmarks/run_vllm_device.sh run [bench args...]   carry [".whl-tw"]: install if not
#       done yet, then the harness: tokenwire served (overlap on), vLLM offline, vLLM served
#       (~6-7 min on an H100 with the checkpoint written)
#
# Outputs under $OUT: RESULTS.md (the side-by-side table), results.json, bench.log, the servers'
# logs (e2e_server.log, vllm_server.log, vllm_offline.log), install.log, import_check.log. See
# benchmarks/VLLM_SIDE_BY_SIDE.md for the exact call sequence.
set -u
cd "$(dirname "$0")/.."
stash=/tmp/vllm-pack
venv=/tmp/vllm-venv
name=vllm-0.26.0.tar.xz
OUT=${OUT:-/tmp/vllm-out}
mkdir -p "$OUT"

case "${1:-}" in
stash)
  n=${2:?usage: stash N}
  mkdir -p $stash
  cp -v .vllm-pack/p$n/* $stash/ || exit 1
  ls -la $stash; df -h /tmp | tail -1
  exit 0 ;;
install|run)
  step=$1; shift ;;
*)
  echo "usage: $0 stash N | install | run [bench args...]" >&2; exit 2 ;;
esac

source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
if [ ! -f $venv/.installed ]; then
  rm -rf $venv; ls -la $stash
  [ -f $stash/$name.sha256 ] || { echo "the last piece (with $name.sha256) is not stashed"; exit 1; }
  (cd $stash && cat $name.part* > $name && sha256sum -c $name.sha256) || {
    echo "pieces missing or damaged: stash every .vllm-pack/pN in one warm machine"; exit 1; }
  rm -rf $stash/wheels && tar -C $stash -xJf $stash/$name && rm -f $stash/$name
  # The image's python3 is itself a venv (/opt/torch/.venv): a venv made from it with
  # --system-site-packages would see the base interpreter's site-packages, not torch's, so its
  # site-packages go in through a .pth file (after the venv's own: vLLM's pins win).
  # --without-pip: the image's Python may lack ensurepip; the image's pip installs into the venv.
  python3 -m venv --system-site-packages --without-pip $venv || exit 1
  img_site=$(python3 -c "import site; print('\n'.join(site.getsitepackages()))")
  vsite=$($venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$img_site" > "$vsite/_device_image.pth"
  env -u PYTHONPATH python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$vsite" $stash/wheels/*.whl > $OUT/install.log 2>&1 || {
    tail -20 $OUT/install.log; rm -rf $venv; exit 1; }
  touch $venv/.installed
fi
# vLLM's engine imports llguidance at module level (its structured-output backends); the pack
# leaves it out because tokenwire's own device wheels (.whl-tw: carried by `install` and `run`)
# hold it.
vsite=$($venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! env -u PYTHONPATH $venv/bin/python -c "import llguidance" 2>/dev/null; then
  ls .whl-tw/llguidance-*.whl > /dev/null 2>&1 || {
    echo "carry .whl-tw with this call: vLLM needs its llguidance wheel"; exit 1; }
  env -u PYTHONPATH python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$vsite" .whl-tw/llguidance-*.whl || exit 1
fi
env -u PYTHONPATH PYTHONPATH=$PWD $venv/bin/python - <<'EOF' 2>&1 | tail -20 | tee $OUT/import_check.log
import importlib, torch, vllm
print("vllm", vllm.__version__, "torch", torch.__version__, torch.version.cuda)
for m in ("vllm.entrypoints.llm", "vllm.entrypoints.openai.api_server",
          "vllm.v1.attention.backends.flash_attn", "vllm.vllm_flash_attn"):
    importlib.import_module(m)
from vllm.vllm_flash_attn.flash_attn_interface import fa_version_unsupported_reason, is_fa_version_supported
print("FA3 supported:", is_fa_version_supported(3), fa_version_unsupported_reason(3))
EOF
grep -q "^vllm 0.26.0" $OUT/import_check.log || { echo "vLLM does not import"; exit 1; }
if [ $step = install ]; then  # the checkpoint too, so that `run` starts measuring at once
  timeout 300 python3 -c "from pathlib import Path; from shard.testing.checkpoint import write_checkpoint; print(write_checkpoint(Path('/tmp/twb/llama3-8b-shape-32l'), 32, 'llama'))"
  exit $?
fi
timeout ${VLLM_BENCH_TIMEOUT:-520} python3 -m benchmarks.harness --parts e2e,vllm_offline,vllm_served \
  --e2e-overlap on --e2e-profile-from-step none --vllm-python $venv/bin/python --out $OUT \
  --workdir /tmp/twb "$@" 2>&1 \
  | grep -v "^\s*$" | grep -v "Loading weights" > $OUT/bench.log
sed -n '/Side by side with vLLM/,$p' $OUT/RESULTS.md
grep -i "Traceback\|Error" $OUT/bench.log | head
tail -5 $OUT/vllm_server.log $OUT/vllm_offline.log 2>/dev/null
