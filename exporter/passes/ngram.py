"""``--pass ngram=N``: log-softmax and n-gram blocking become nodes of the decoder graph.

FastSeq (seed 001, §4.2, Algorithm 1) found host-side n-gram blocking cost 25% of generation
time.  After this pass the decoder step returns blocked log-probabilities

    log_probs = NGramRepeatBlock_N(history, LogSoftmax(logits))

where ``history`` [rows, cur_len] is the decoder tokens so far (start token included, as HF's
processors see them) and NGramRepeatBlock_N sets −inf on every token that would repeat an
n-gram of the row (``exporter/plugins/ngram_reference.py`` holds the definition).  HF's beam
search applies its processors after ``log_softmax``; the searches skip their own log-softmax and
n-gram processor when the manifest says the graph does both.

Pattern: the decoder's ``logits`` output.  Rewrite: append LogSoftmax and the ONNX Runtime node
``com.microsoft.NGramRepeatBlock``; add the ``decoder_input_ids_history`` input.  A sibling graph
with the TensorRT plugin node (op ``NGramRepeatBlock``, ``plugin_version`` "1") is written for
TensorRT users (``tensorrt_file`` in the manifest).  Verification: on random histories with
planted repeats, the new graph's output equals the reference blocking applied to the old graph's
log-softmaxed logits (same −inf positions; max abs diff of the rest ≤ 1e-4).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from runners.backend import DecoderCache
from runners.inputs import random_inputs
from runners.manifest import Manifest
from runners.ort_backend import OrtBackend

from runners.errors import ElxError
from ..plugins.ngram import ort_node, tensorrt_node
from runners.ngram_reference import block_ngrams
from ..verify import SHAPES, TOLERANCE, _random_step, require_within_tolerance
from .rewrite import Builder, load_graph, refuse_twice, save_graph

NAME = "ngram"
ORDER = 90  # last: it consumes the final logits
CONFLICTS: dict = {}
HISTORY_INPUT = "decoder_input_ids_history"
OUTPUT = "log_probs"


def parse_argument(argument: str | None) -> int:
    try:
        n = int(argument)
    except (TypeError, ValueError):
        raise ElxError(f"pass ngram needs the n-gram size, e.g. --pass ngram=3 (got {argument!r})")
    if n < 1:
        raise ElxError(f"pass ngram needs an n-gram size >= 1 (got {n})")
    return n


def _append_blocking(graph: gs.Graph, logits_name: str, spec) -> None:
    logits = next(t for t in graph.outputs if t.name == logits_name)
    build = Builder(graph, "ngram")
    history = gs.Variable(HISTORY_INPUT, dtype=np.int64, shape=["rows", "history_length"])
    log_probs = build.op("LogSoftmax", [logits], "log_softmax", axis=-1)
    blocked = gs.Variable(OUTPUT, dtype=np.float32, shape=logits.shape)
    graph.nodes.append(gs.Node(spec.op_type, "ngram/block", attrs=dict(spec.attrs), inputs=[history, log_probs],
                               outputs=[blocked], domain=spec.domain))
    graph.inputs.append(history)
    graph.outputs = [blocked if t is logits else t for t in graph.outputs]
    if spec.domain and not any(getattr(d, "domain", None) == spec.domain for d in graph.import_domains or []):
        import onnx

        graph.import_domains = list(graph.import_domains or []) + [onnx.helper.make_opsetid(spec.domain, 1)]


def _histories(rows: int, length: int, vocab: int, rng) -> np.ndarray:
    """Token histories with planted repeats (a three-token alphabet), start token first."""
    history = rng.integers(3, min(vocab, 6), size=(rows, length), dtype=np.int64)
    history[:, 0] = 0
    return history


def _verify(before: Manifest, after: Manifest, n: int) -> dict:
    old, new = OrtBackend(before), OrtBackend(after)
    worst, per_shape = 0.0, []
    for shape in SHAPES:
        rng = np.random.default_rng(0)
        inputs = random_inputs(before, shape.batch, shape.source, rng)
        tokens, past = _random_step(before, shape, rng)
        rows = shape.batch * shape.beams
        history = _histories(rows, shape.past + shape.step + 10, before.dims["vocab_size"], rng)
        logits, _ = old.step(tokens, old.encode(inputs), DecoderCache(past, rows))
        logits = logits - logits.max(axis=1, keepdims=True)
        expected = block_ngrams(history, logits - np.log(np.exp(logits).sum(axis=1, keepdims=True)), n)
        got, _ = new.step(tokens, new.encode(inputs), DecoderCache(past, rows), history=history)
        same_bans = bool(np.array_equal(np.isneginf(got), np.isneginf(expected)))
        finite = np.isfinite(expected)
        diff = float(np.abs(got[finite] - expected[finite]).max()) if same_bans else float("inf")
        worst = max(worst, diff)
        per_shape.append({**shape.as_dict(), "max_abs_logprob_diff": diff,
                          "banned": int(np.isneginf(expected).sum())})
    return {"max_abs_logits_diff": worst, "shapes": per_shape, "tolerance": TOLERANCE}


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    n = parse_argument(argument)
    refuse_twice(manifest, NAME)
    before = manifest.copy()
    step = manifest.graphs[manifest.step]
    logits_name = step.get("logits", "logits")
    graph = load_graph(manifest, manifest.step)
    trt_graph = load_graph(manifest, manifest.step)
    _append_blocking(graph, logits_name, ort_node(n))
    _append_blocking(trt_graph, logits_name, tensorrt_node(n))
    stem = step["file"][: -len(".onnx")]
    ort_file, trt_file = f"{stem}.{NAME}.onnx", f"{stem}.{NAME}.tensorrt.onnx"
    step["external_data"] = save_graph(graph, folder, ort_file)
    save_graph(trt_graph, folder, trt_file)
    step["file"], step["tensorrt_file"] = ort_file, trt_file
    step["inputs"][HISTORY_INPUT] = {"dtype": "int64", "shape": ["rows", "history_length"], "from": "step:history"}
    out_spec = step["outputs"].pop(logits_name)
    step["outputs"] = {OUTPUT: out_spec, **step["outputs"]}
    step["logits"], step["logits_kind"] = OUTPUT, "log_probs"
    report = _verify(before, manifest, n)
    require_within_tolerance(report, "pass ngram")
    for file in set(before.graph_files()) - set(manifest.graph_files()) - {trt_file}:
        (Path(folder) / file).unlink(missing_ok=True)
    return {"name": NAME, "ngram_size": n, "blocks_ngrams": n, "ort_op": "com.microsoft.NGramRepeatBlock",
            "tensorrt_op": "NGramRepeatBlock (plugin_version 1)", **report}
