"""A trial, not an export path: ONNX Runtime's 8-bit ``MatMulNBits`` on an elx fp32 decoder-only export.

    python3 tools/int8_nbits_trial.py FP32_EXPORT OUT [BLOCK]

Each graph's constant ``Transpose`` of a 2-D weight (the tied LM head reads ``Transpose(embedding)``) is folded
into an initializer first, so the head is quantized too; then ``MatMulNBitsQuantizer(bits=8, block_size=BLOCK
(32), is_symmetric=True, accuracy_level=4)``: 8-bit weights per block of 32 along K, activations quantized to
int8 per block at run time (what onnxruntime-genai's int8 builds run on the CPU).  OUT is an elx folder (its
manifest points at each graph's own ``.data``) that ``elx generate`` and ``tools/measure_real_llm.py --elx-int8
OUT`` read.  Not verified or recorded as an ``--precision int8`` export is: a measurement aid for issue 39
(``docs/measurements/real_smollm2_2026-11-27.md``, "MatMulNBits").
"""
from __future__ import annotations

import collections
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper


def fold_weight_transposes(graph: onnx.GraphProto) -> int:
    """Replace each Transpose of a 2-D initializer by the transposed initializer; returns how many."""
    inits = {i.name: i for i in graph.initializer}
    folded = 0
    for node in list(graph.node):
        if node.op_type == "Transpose" and node.input[0] in inits and len(inits[node.input[0]].dims) == 2:
            perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
            weight = numpy_helper.to_array(inits[node.input[0]])
            weight = np.ascontiguousarray(weight.transpose(*perm[0]) if perm else weight.T)
            graph.initializer.append(numpy_helper.from_array(weight, node.output[0]))
            graph.node.remove(node)
            folded += 1
    return folded


def main(argv: list[str]) -> int:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    src, dst, block = Path(argv[0]), Path(argv[1]), int(argv[2]) if len(argv) == 3 else 32
    manifest = json.loads((src / "manifest.json").read_text())
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    if (src / "tokenizer").is_dir():
        shutil.copytree(src / "tokenizer", dst / "tokenizer")
    for spec in manifest["graphs"].values():
        started = time.perf_counter()
        model = onnx.load(str(src / spec["file"]))
        folded = fold_weight_transposes(model.graph)
        quantizer = MatMulNBitsQuantizer(model, bits=8, block_size=block, is_symmetric=True, accuracy_level=4)
        quantizer.process()
        out = quantizer.model.model
        onnx.save_model(out, str(dst / spec["file"]), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=spec["file"] + ".data", size_threshold=1024)
        spec["external_data"] = [spec["file"] + ".data"]
        ops = collections.Counter(n.op_type for n in out.graph.node)
        print(f"{spec['file']}: {folded} transposes folded, {ops['MatMulNBits']} MatMulNBits "
              f"({time.perf_counter() - started:.1f} s)")
    manifest.pop("weights", None)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
