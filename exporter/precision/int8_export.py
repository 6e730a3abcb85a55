"""``elx export --precision int8``, after the passes: which layers stay fp32 (``int8_layers.py``), the
conversion (``int8.py``: the rule), and the agreement with HF fp32 measured and recorded under
``verification.int8`` (``int8_check.py``: what is measured and how ``elx compare`` holds an export to it)."""
from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path

from elx.runners.backends.ort import OrtBackend
from elx.runners.generate import Generator, Model
from elx.runners.manifest import Manifest

from elx.exporter.memory import release_memory
from elx.exporter.verification.compare import compare_loaded
from elx.exporter.passes.rewrite import drop_unused_files
from elx.exporter.precision.int8 import LM_HEAD, convert_folder
from elx.exporter.precision.int8_check import DRAW, SEARCHES, random_inputs_error, summarize
from elx.exporter.precision.int8_layers import measure_and_convert
from elx.exporter.progress import WEIGHTS


def finish(torch_model, folder: Path, manifest: Manifest, progress) -> dict:
    """Measure each layer's error quantized alone (``exporter/precision/int8_layers.py``: the layers out of line
    stay fp32), convert the verified fp32 export in ``folder`` to int8 in place (``manifest`` updated, fp32 graph
    files removed), then measure and record what int8 changes (``verification.int8``); one progress stage each."""
    with progress.stage("int8 per-layer error (which layers stay fp32)", WEIGHTS["fp16"]) as stage:
        layers, after = measure_and_convert(torch_model, manifest, Path(folder),  # every layer on int8, in place
                                            _every_few_layers(progress, stage))
        kept = layers["kept_fp32"]
        stage.detail = (f"{len(layers['max_abs_logits_diff'])} layers quantized one at a time, median max abs "
                        f"logits diff {layers['median_max_abs_logits_diff']:.3g}; kept fp32: {', '.join(kept) or 'none'}")
    with progress.stage("int8 conversion", WEIGHTS["fp16"]) as stage:
        before = manifest.copy()
        if kept:  # converted again, those layers left fp32 (the same files rewritten)
            after = convert_folder(manifest, Path(folder), keep_lm_head=LM_HEAD in kept, keep_layers=frozenset(kept))
        after.data["int8"]["layers"] = layers
        manifest.data.clear()
        manifest.data.update(after.data)
        drop_unused_files(Path(folder), before, manifest)
        counts = Counter()
        for graph in manifest.data["int8"]["graphs"].values():
            counts.update({k.partition(":")[0]: v for k, v in graph.items() if not k.endswith("activation")})
        stage.detail = f"{counts['int8']} MatMuls on int8 weights, {counts['fp32']} weight MatMuls kept fp32"
    with progress.stage("int8 agreement with HF fp32 (recorded)", WEIGHTS["fp16"]) as stage:
        found = manifest.data["verification"]["int8"] = record(torch_model, manifest)
        greedy, beam = found["searches"]["greedy"], found["searches"]["beam4"]
        stage.detail = (f"sequences identical to HF fp32: greedy {greedy['identical_share']:.0%}, beam 4 "
                        f"{beam['identical_share']:.0%}; top-1 along HF's tokens {greedy['top1_agreement']:.1%}; "
                        f"max abs logits diff {found['random_inputs']['max_abs_logits_diff']:.3g} (random inputs)")
    return found


def _every_few_layers(progress, stage):
    """A line per ~10% of the layers measured, with the time so far and an ETA (a long model's int8 stage is
    minutes: one graph copy and one check per layer)."""
    def report(layer: str, done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            spent = time.perf_counter() - stage.started
            progress.say(f"{progress.title}: int8 per-layer error: {layer} ({done}/{total} layers, {spent:.1f} s, "
                         f"ETA {spent / done * (total - done):.0f} s)")
    return report


def record(torch_model, manifest: Manifest, draw: dict | None = None) -> dict:
    """``verification.int8`` for the int8 export ``manifest`` describes (see the module doc)."""
    draw = dict(draw or DRAW)
    random_inputs = random_inputs_error(torch_model, manifest, packed=True)  # the kernels the runtime runs
    release_memory()  # each part's freed memory back before the next allocates (the export's peak is here)
    # the packed kernels the runtime uses (unpacked, MatMulNBits computes otherwise: other recorded figures), without
    # the arena (a few runs of several shapes, held beside HF's model: the export's peak), one session in memory at
    # a time (each holds its own packed copy of the int8 weights)
    generator = Generator(Model(manifest, OrtBackend(manifest, arena=False, one_session=True)))
    searches = {}
    for name, beams in SEARCHES.items():
        report = compare_loaded(generator, torch_model, batch_size=draw["batch_size"],
                                input_length=draw["input_length"], seed=draw["seed"], atol=math.inf,
                                num_beams=beams, max_new_tokens=draw["max_new_tokens"])
        searches[name] = {"num_beams": beams, **summarize(report)}
        release_memory()
    return {"draw": draw, "random_inputs": random_inputs, "searches": searches}
