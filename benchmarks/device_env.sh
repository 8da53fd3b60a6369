# Sourced by the benchmarks/run_*_device.sh scripts: the device machine's Python environment.
# Carried wheels go to /tmp/site (.whl holds everything incl. bitsandbytes; .whl-tw the service
# wheels only), the repo and generated stubs go on PYTHONPATH, and NVLink multicast stays off
# (shared hosts: see the device README).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for wheels in .whl .whl-tw; do
  if ls $wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site $wheels/*.whl && export PYTHONPATH=/tmp/site
    break
  fi
done
export PYTHONPATH=".:gen/python:${PYTHONPATH:-}"
