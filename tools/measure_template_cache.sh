#!/bin/bash
# Issue 41: an export with the template cache cold, then warm, then warm with --pass unpad, and onnxruntime-genai's
# builder beside, one run each (wall clock and peak RSS from /usr/bin/time -v); then cmp of the cold and warm
# folders' graphs and weights.  Usage: tools/measure_template_cache.sh HF_FOLDER TAG (docs/measurements/
# export_speed_2026-11-29.md).  Empties $ELX_CACHE_DIR (default /tmp/tcm) first.
set -u
export ELX_CACHE_DIR=${ELX_CACHE_DIR:-/tmp/tcm}
M=${1:-/work/real/smollm2-hf}; T=${2:-135}
rm -rf "$ELX_CACHE_DIR" /tmp/m-$T-* /tmp/g-$T
run() { local tag=$1; shift; /usr/bin/time -v "$@" > /tmp/m.log 2>&1; echo "$tag wall=$(grep Elapsed /tmp/m.log | awk '{print $NF}') rss_kb=$(grep Maximum /tmp/m.log | awk '{print $NF}') rc=$(grep "Exit status" /tmp/m.log | awk '{print $NF}')"; grep "from the cache\|traced a\|wrote" /tmp/m.log | sed 's/^/    /'; }
run "$T elx cold" elx export --model $M --output /tmp/m-$T-cold
run "$T elx warm" elx export --model $M --output /tmp/m-$T-warm
run "$T elx warm --pass unpad" elx export --model $M --output /tmp/m-$T-unpad --pass unpad
run "$T genai fp32" python -m onnxruntime_genai.models.builder -i $M -o /tmp/g-$T -p fp32 -e cpu
cmp /tmp/m-$T-cold/decoder.onnx /tmp/m-$T-warm/decoder.onnx && cmp /tmp/m-$T-cold/prefill.onnx /tmp/m-$T-warm/prefill.onnx && cmp /tmp/m-$T-cold/weights.data /tmp/m-$T-warm/weights.data && echo "$T cold and warm folders: graphs and weights identical"
du -sh "$ELX_CACHE_DIR/templates"
