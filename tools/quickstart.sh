#!/usr/bin/env bash
# The main job on an embedded default: export t5-small (preset architecture, seeded random weights:
# no weights can be downloaded here) with the EL-attention pass, generate with ONNX Runtime, and
# compare token by token with HF generate in PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/t5-small-el}
elx export --model t5-small --random-init --pass el --output "$OUT" --force
elx generate "$OUT" --input-ids "37 423 1176 12 8 2324 5; 71 1784 19 3 9" --num-beams 4 --max-new-tokens 12
elx compare "$OUT" --batch-size 4 --input-length 64 --num-beams 4 --no-repeat-ngram-size 3 --max-new-tokens 24
