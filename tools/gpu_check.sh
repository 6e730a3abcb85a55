#!/usr/bin/env bash
# The one-call GPU check (issue 26): on a CUDA machine, the GPU tests, the n-gram kernel benchmark and
# `elx bench --device cuda` on t5-base dims, results under gpu_check_results/<UTC timestamp>/ (summary.md,
# results.json, logs).  Without a CUDA device (or with --dry-run) it only prints what it would run, exit 0.
#
#   bash tools/gpu_check.sh [--dry-run] [--out DIR] [--only tests,ngram,search,bench] [--batches 1,8,32,128]
#
# Options: python3 tools/gpu_check.py --help.  PYTHON=... picks the interpreter.  Wheels the machine lacks:
# tools/wheel_pieces.sh (README, "GPU check").
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
