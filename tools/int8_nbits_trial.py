"""A trial, not an export path: ONNX Runtime's 8-bit ``MatMulNBits`` on an elx fp32 decoder-only export.

    python3 tools/int8_nbits_trial.py FP32_EXPORT OUT

The conversion ``--precision int8`` runs on decoder-only exports (``exporter/precision/int8.py``: ``to_int8``
with ``kernel="nbits"``; the tied head's ``Transpose(embedding)`` folded first, so the head is quantized too),
applied to every weight MatMul without the per-layer rule: ``MatMulNBits`` (bits=8, block 32, symmetric,
``accuracy_level=4``): 8-bit weights per block of 32 along K, activations quantized to
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

import onnx


def main(argv: list[str]) -> int:
    from elx.exporter.precision.int8 import to_int8

    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    src, dst = Path(argv[0]), Path(argv[1])
    manifest = json.loads((src / "manifest.json").read_text())
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    if (src / "tokenizer").is_dir():
        shutil.copytree(src / "tokenizer", dst / "tokenizer")
    for spec in manifest["graphs"].values():
        started = time.perf_counter()
        model = onnx.load(str(src / spec["file"]))
        # the export's own conversion (transposes folded, every weight MatMul chosen), without its per-layer rule
        out, counts = to_int8(model, kernel="nbits")
        onnx.save_model(out, str(dst / spec["file"]), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=spec["file"] + ".data", size_threshold=1024)
        spec["external_data"] = [spec["file"] + ".data"]
        ops = collections.Counter(n.op_type for n in out.graph.node)
        print(f"{spec['file']}: {ops['MatMulNBits']} MatMulNBits {counts} "
              f"({time.perf_counter() - started:.1f} s)")
    manifest.pop("weights", None)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
