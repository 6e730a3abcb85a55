"""int8, per layer: which layers stay fp32, decided by measuring each one's teacher-forced error (issue 28).

Before the folder is converted (``exporter/precision_int8.py``), each layer is quantized *alone*: the fp32
export converted with only that layer's weight MatMuls on int8 weights (``convert_folder(only=layer)``),
then measured against PyTorch fp32 on the seeded random cases the int8 record uses
(``precision_int8_check.random_inputs_error``: teacher-forced max abs logits difference, each side filling
its own cache).  A layer is what ``precision_int8.layer_of`` reads from the module path the ONNX exporter records on each
node, or from the weight's name (``layers.3``, ``decoder.block.1``, GPT-2's ``h.0``), plus the LM head
(``lm_head``); MatMuls that name no layer (nodes a pass wrote) follow the rule without a measurement.

**Out of line**: a layer whose error alone exceeds ``OUT_OF_LINE`` times the median layer's.  Quantizing
any layer changes the logits by roughly the same amount when its weights and activations are of the same
kind; one that changes them several times more (an outlier channel the per-tensor activation scale cannot
resolve, a saturating product) costs more agreement than the bytes it saves, and stays fp32.  The manifest
records every layer's error, the median, the factor and the layers kept (``int8.layers``).

Cost: one conversion and one check per layer (tiny models: a second each; real checkpoints: the
conversion's time per layer).
"""
from __future__ import annotations

import re
import shutil
import statistics
import tempfile
from pathlib import Path

import onnx

from elx.runners.manifest import Manifest

OUT_OF_LINE = 4.0
RULE = (f"a layer stays fp32 when its teacher-forced max abs logits difference, quantized alone, exceeds "
        f"{OUT_OF_LINE:g} x the median layer's")


def measured_layers(manifest: Manifest) -> list[str]:
    """The layers the rule would quantize in the fp32 export ``manifest`` describes, in graph order."""
    from elx.exporter.precision_int8 import _scores_output, layers_of, prepare

    found = []
    for name in [*manifest.stages, manifest.step]:
        model = prepare(onnx.load(str(manifest.graph_path(name))))
        found += [layer for layer in sorted(layers_of(model, _scores_output(manifest, name))) if layer not in found]
    return found


def measure_layers(torch_model, manifest: Manifest, progress=None) -> dict:
    """Every layer's error quantized alone, and the layers out of line (see the module doc)."""
    from elx.exporter.precision_decoder_only import torch_side
    from elx.exporter.precision_int8 import convert_folder
    from elx.exporter.precision_int8_check import random_inputs_error

    reference = torch_side(torch_model, manifest)
    errors = {}
    with tempfile.TemporaryDirectory(prefix="elx-int8-layers-") as work:
        for layer in measured_layers(manifest):
            target = Path(work) / re.sub(r"[^A-Za-z0-9_.-]", "_", layer)
            converted = convert_folder(manifest, target, only=layer)
            errors[layer] = random_inputs_error(torch_model, converted, reference)["max_abs_logits_diff"]
            shutil.rmtree(target, ignore_errors=True)
            if progress is not None:
                progress(layer)
    median = statistics.median(errors.values()) if errors else 0.0
    kept = [layer for layer, error in errors.items() if not error <= OUT_OF_LINE * median]  # NaN: kept
    return {"rule": RULE, "factor": OUT_OF_LINE, "median_max_abs_logits_diff": median,
            "max_abs_logits_diff": errors, "kept_fp32": kept}
