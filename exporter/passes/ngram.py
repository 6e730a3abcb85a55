"""``--pass ngram=N``: log-softmax and n-gram blocking become nodes of the decoder graph.

FastSeq (seed 001, §4.2, Algorithm 1) found host-side n-gram blocking cost 25% of generation
time.  After this pass the decoder step has a second output beside its plain ``logits``:

    log_probs = NGramRepeatBlock_N(history, LogSoftmax(logits))

where ``history`` [rows, cur_len] is the decoder tokens so far (start token included, as HF's
processors see them) and NGramRepeatBlock_N sets −inf on every token that would repeat an
n-gram of the row (``runners/search/ngram_reference.py`` holds the definition).  HF's beam search
applies its processors after ``log_softmax``; a run that asks for ``no_repeat_ngram_size`` = N
reads ``log_probs`` and the searches skip their own log-softmax and n-gram processor.  A run
asking for anything else (0 included) reads the plain ``logits`` and gets exactly what it asked
(``runners/plan.py``, ``RunPlan.reads_blocked``): the graph never blocks silently.  The manifest
says what the graph does: ``graphs.decoder.blocked = {"output": "log_probs", "ngram_size": N,
"log_softmax": true}``.

Pattern: the decoder's ``logits`` output.  Rewrite: append LogSoftmax and the ONNX Runtime node
``com.microsoft.NGramRepeatBlock``; add the ``decoder_input_ids_history`` input and the
``log_probs`` output.  A sibling graph with the TensorRT plugin node (op ``NGramRepeatBlock``,
``plugin_version`` "1") is written for TensorRT (``tensorrt_file`` in the manifest).
Verification: on random histories with planted repeats, ``log_probs`` equals the reference
blocking applied to the old graph's log-softmaxed logits (same −inf positions; max abs diff of
the rest ≤ 1e-4), and ``logits`` equals the old graph's logits.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from elx.runners.manifest import Manifest
from elx.runners.search.ngram_reference import block_ngrams

from elx.exporter.plugins.ngram import ort_node, tensorrt_node
from elx.exporter.verification.verify import RuntimeSide
from elx.exporter.passes import catalog
from elx.exporter.passes.rewrite import Builder, commit, load_graph, pass_file, refuse_twice, save_graph

SPEC = catalog.NGRAM  # name, order (last: it consumes the final logits), argument, refusals (decoder-only)
NAME, parse_argument = SPEC.name, SPEC.parse
HISTORY_INPUT = "decoder_input_ids_history"
OUTPUT = "log_probs"


def _append_blocking(graph: gs.Graph, logits_name: str, spec) -> None:
    logits = next(t for t in graph.outputs if t.name == logits_name)
    build = Builder(graph, "ngram")
    history = gs.Variable(HISTORY_INPUT, dtype=np.int64, shape=["rows", "history_length"])
    log_probs = build.op("LogSoftmax", [logits], "log_softmax", axis=-1)
    blocked = gs.Variable(OUTPUT, dtype=np.float32, shape=logits.shape)
    graph.nodes.append(gs.Node(spec.op_type, "ngram/block", attrs=dict(spec.attrs), inputs=[history, log_probs],
                               outputs=[blocked], domain=spec.domain))
    graph.inputs.append(history)
    graph.outputs = [blocked, *graph.outputs]
    if spec.domain and not any(getattr(d, "domain", None) == spec.domain for d in graph.import_domains or []):
        import onnx

        graph.import_domains = list(graph.import_domains or []) + [onnx.helper.make_opsetid(spec.domain, 1)]


def log_softmax_blocked(n: int):
    """``expect`` for the verification: what ``log_probs`` must be, from the old graph's logits."""

    def expect(logits: np.ndarray, case) -> np.ndarray:
        shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
        log_probs = (shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))).astype(np.float32)
        return block_ngrams(case.history, log_probs, n)

    return expect


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    n = parse_argument(argument)
    refuse_twice(manifest, NAME)
    before = manifest.copy()
    step = manifest.graphs[manifest.step]
    logits_name = step.get("logits", "logits")
    graph, trt_graph = load_graph(manifest, manifest.step), load_graph(manifest, manifest.step)
    _append_blocking(graph, logits_name, ort_node(n))
    _append_blocking(trt_graph, logits_name, tensorrt_node(n))
    ort_file = pass_file(step["file"], NAME)
    trt_file = pass_file(ort_file, "tensorrt")
    step["external_data"] = save_graph(graph, folder, ort_file)
    save_graph(trt_graph, folder, trt_file)
    step["file"], step["tensorrt_file"] = ort_file, trt_file
    step["inputs"][HISTORY_INPUT] = {"dtype": "int64", "shape": ["rows", "history_length"], "from": "step:history"}
    step["outputs"] = {OUTPUT: dict(step["outputs"][logits_name]), **step["outputs"]}
    step["blocked"] = {"output": OUTPUT, "ngram_size": n, "log_softmax": True}
    reference = RuntimeSide(before)
    report = commit(folder, before, manifest, f"pass ngram ({OUTPUT})", expect=log_softmax_blocked(n),
                    no_repeat_ngram_size=n, reference=reference)
    plain = commit(folder, before, manifest, f"pass ngram ({logits_name})", reference=reference)
    return {"name": NAME, "ngram_size": n, "ort_op": "com.microsoft.NGramRepeatBlock",
            "tensorrt_op": "NGramRepeatBlock (plugin_version 1)", "plain_logits_diff": plain["max_abs_logits_diff"],
            **report}
