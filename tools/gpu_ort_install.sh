#!/usr/bin/env bash
# Put onnxruntime-gpu on the lent GPU machine (no package registry there) and check that its CUDA provider
# really loads; meant to be sourced, so the exports reach the commands after it:
#
#   source tools/gpu_ort_install.sh PIECES_DIR [TARGET] [WHEELS_DIR]
#
# PIECES_DIR holds what `tools/wheel_pieces.sh split` made of either the wheel itself or a tar.xz of the
# unpacked wheel (smaller: 203 MB instead of 255.6 MB for 1.31.1 without its TensorRT provider, which
# needs a libnvinfer the machine lacks), carried one piece per device call.  TARGET (default /tmp/site) gets
# the package; WHEELS_DIR's wheels (transformers 5.24, jsonschema, ...) are installed there too.
# Exports PYTHONPATH (TARGET first) and LD_LIBRARY_PATH (the CUDA 13, cuBLAS, cuDNN 9, cuFFT, cuRAND
# libraries of the image's cu130 PyTorch wheels), then creates a one-node session on the CUDA provider:
# ONNX Runtime falls back to the CPU with a log line only when a library is missing.  A failing step ends the
# shell that sources it (a device call's command: nothing after it would mean anything); on success the
# shell's own options are given back.
_saved_options="$(set +o)"
set -eo pipefail
_pieces="${1:?usage: source tools/gpu_ort_install.sh PIECES_DIR [TARGET] [WHEELS_DIR]}"
_target="${2:-/tmp/site}"
_wheels="${3:-}"
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$_target" /tmp/ort_joined
_file="$(bash "$_repo/tools/wheel_pieces.sh" join "$_pieces" /tmp/ort_joined)"
case "$_file" in
  *.whl) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$_target" "$_file" ;;
  *.tar.xz) tar -xJf "$_file" -C "$_target" ;;
  *) echo "gpu_ort_install: error: $_file is neither a wheel nor a .tar.xz" >&2; return 2 2>/dev/null || exit 2 ;;
esac
if [ -n "$_wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$_target" "$_wheels"/*.whl
fi
export PYTHONPATH="$_target${PYTHONPATH:+:$PYTHONPATH}"
_libs="$(python3 - <<'EOF'
import glob, os, site
dirs = []
for root in site.getsitepackages():
    for d in sorted(glob.glob(os.path.join(root, "nvidia", "**", "lib"), recursive=True)):
        if glob.glob(os.path.join(d, "*.so*")):
            dirs.append(d)
print(":".join(dirs))
EOF
)"
export LD_LIBRARY_PATH="$_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
python3 - <<'EOF'
import torch  # noqa: F401  (cu130: loads the CUDA libraries ORT's provider links against)
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

print("onnxruntime", ort.__version__, "from", ort.__file__)
print("available providers:", ort.get_available_providers())
node = helper.make_node("MatMul", ["a", "b"], ["c"])
graph = helper.make_graph([node], "mm", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 4]),
                                         helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 4])],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4, 4])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
s = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
a = np.arange(16, dtype=np.float32).reshape(4, 4)
print("session providers:", s.get_providers(), "matmul ok:", bool(np.allclose(s.run(None, {"a": a, "b": a})[0], a @ a)))
if "CUDAExecutionProvider" not in s.get_providers():
    raise SystemExit("gpu_ort_install: error: the CUDA provider did not load (see ONNX Runtime's log above)")
EOF
eval "$_saved_options"
