#!/usr/bin/env bash
# Packs, HERE (not on the device), vLLM 0.26.0 and exactly the wheels its offline and served paths
# need beyond the GPU machine's image, for benchmarks/run_vllm_device.sh (issue 44 item 3: vLLM as
# a side-by-side row of the harness). The GPU machine has no network and takes at most 64 MiB of
# carried files a call, so the set is trimmed, xz'ed and split into pieces under .vllm-pack/pN/
# (git-ignored), one folder per device call. See benchmarks/VLLM_SIDE_BY_SIDE.md.
#
# Why 0.26.0: the newest vLLM whose wheel pins torch==2.11.0 (the device's torch). Its other
# requirements were checked against the device image's package list (KINDS.md, "Python packages
# already there"), a static import closure of vLLM's offline, served, engine-core, GPU-worker,
# Llama and FlashAttention modules, and an import check of those modules here (Python 3.11,
# CPU torch: VLLM_SIDE_BY_SIDE.md): only what they import and the device lacks is packed.
# Left out (imported lazily, only on paths this benchmark never takes): flashinfer, tilelang,
# cutlass-dsl, quack, humming/tokenspeed kernels, llguidance / outlines / lm-format-enforcer,
# mistral_common, compressed-tensors, anthropic, mcp, torchcodec, PyNvVideoCodec,
# fastsafetensors, opentelemetry. Trimmed: benchmarks/wheel_trim.py (FA2, the Rust front end,
# Blackwell-only sources, xgrammar's static library).
#
# Dependency versions: resolved by pip with --uploaded-prior-to the day after vLLM 0.26.0's
# release, i.e. the versions vLLM was released against (openai 3.x, say, may postdate it).
# Usage: bash benchmarks/vllm_pack.sh  (~5 min download, then xz -9e on one core at nice 19)
set -eu
cd "$(dirname "$0")/.."
pack=.vllm-pack
piece_mib=${VLLM_PACK_PIECE_MIB:-50}   # + the ~10 MB work tree + .whl-tw stays < 64 MiB a call
released=2026-07-26T00:00:00Z          # vLLM 0.26.0's wheel is dated 2026-07-25
py=${PYTHON:-python3}
mkdir -p $pack/dl/deps $pack/stage
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_35_x86_64)
$py -m pip download -q --no-deps "${plat[@]}" -d $pack/dl vllm==0.26.0
# vLLM's own pins where it has them (fastapi, lark, depyf, nvtx, openai-harmony); the rest as
# resolved on its release day. Their dependencies come too, then those the device has go.
$py -m pip download -q "${plat[@]}" --uploaded-prior-to $released -d $pack/dl/deps \
  'fastapi>=0.133.0,<0.137.0' 'starlette>=1.0.1' uvicorn 'pydantic>=2.12.0' 'openai>=2.0.0' \
  'openai-harmony>=0.0.3' cachetools cbor2 partial-json-parser pybase64 msgspec 'pyzmq>=25.0.0' \
  watchfiles blake3 setproctitle 'prometheus-fastapi-instrumentator>=8.0.0' \
  'model-hosting-container-standards>=0.1.14,<1.0.0' depyf==0.20.0 python-json-logger ijson \
  lark==1.2.2 'jsonschema>=4.23.0' python-multipart nvtx==0.2.15
# On the device already (KINDS.md's list): keep theirs. typing_extensions stays packed: pydantic
# >= 2.12 needs >= 4.14.1 and the image's version is not on record (a newer one is compatible).
for have in annotated_doc anyio attrs certifi click h11 httpcore httpx idna prometheus_client \
            setuptools six requests urllib3 charset_normalizer numpy packaging pyyaml tqdm \
            filelock psutil regex; do
  rm -f $pack/dl/deps/${have}-[0-9]*.whl
done
ls $pack/dl/deps
# xgrammar: vLLM's structured-output module evaluates `xgr.GrammarMatcher` when it is imported
# (class annotations), so the engine core does not import without it, structured output or not
# (seen in the local import check, VLLM_SIDE_BY_SIDE.md). apache-tvm-ffi is its one missing need.
$py -m pip download -q --no-deps "${plat[@]}" -d $pack/dl/deps xgrammar==0.2.3 apache-tvm-ffi==0.1.10
# vLLM and xgrammar trimmed and stored (benchmarks/wheel_trim.py says what goes), the rest as is.
rm -rf $pack/stage && mkdir -p $pack/stage/wheels
$py benchmarks/wheel_trim.py $pack/stage/wheels $pack/dl/vllm-0.26.0-*.whl $pack/dl/deps/xgrammar-*.whl
for w in $pack/dl/deps/*.whl; do
  case $(basename $w) in xgrammar-*) ;; *) cp $w $pack/stage/wheels/ ;; esac
done
du -sh $pack/stage/wheels
rm -rf $pack/p[0-9]* && mkdir -p $pack/parts
tar -C $pack/stage -cf - wheels | nice -n 19 xz -9e -T1 -c > $pack/parts/vllm-0.26.0.tar.xz
(cd $pack/parts && sha256sum vllm-0.26.0.tar.xz > vllm-0.26.0.tar.xz.sha256 &&
 split -b ${piece_mib}M -d -a 1 vllm-0.26.0.tar.xz vllm-0.26.0.tar.xz.part)
n=0
for part in $pack/parts/vllm-0.26.0.tar.xz.part*; do
  n=$((n + 1)); mkdir -p $pack/p$n; mv "$part" $pack/p$n/
done
cp $pack/parts/vllm-0.26.0.tar.xz.sha256 $pack/p$n/   # the last piece checks the whole
rm -f $pack/parts/vllm-0.26.0.tar.xz
du -sh $pack/p*; echo "pieces: $n (carry one .vllm-pack/pN per device call; see VLLM_SIDE_BY_SIDE.md)"
