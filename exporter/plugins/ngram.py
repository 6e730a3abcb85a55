"""The n-gram blocking node as the graph sees it, for both runtimes.

ONNX Runtime ships ``com.microsoft.NGramRepeatBlock`` (CPU and CUDA kernels): inputs
``input_ids`` int64 [rows, cur_len] and ``scores`` float [rows, vocab], attribute ``ngram_size``;
its semantics equal HF's ``NoRepeatNGramLogitsProcessor`` for every history with cur_len ≥ 1
(``tests/test_ngram_pass.py`` checks it against ``ngram_reference``).

TensorRT's ONNX parser maps an op it does not know to a plugin by ``op_type`` (the domain is
ignored) and reads the optional string attributes ``plugin_version`` and ``plugin_namespace``;
``plugins_cuda/`` builds the ``NGramRepeatBlock`` IPluginV3 with field ``ngram_size``.
"""
from __future__ import annotations

from dataclasses import dataclass

OP_TYPE = "NGramRepeatBlock"
ORT_DOMAIN = "com.microsoft"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = ""


@dataclass(frozen=True)
class NodeSpec:
    op_type: str
    domain: str
    attrs: dict


def ort_node(ngram_size: int) -> NodeSpec:
    return NodeSpec(OP_TYPE, ORT_DOMAIN, {"ngram_size": int(ngram_size)})


def tensorrt_node(ngram_size: int) -> NodeSpec:
    return NodeSpec(OP_TYPE, "", {"ngram_size": int(ngram_size), "plugin_version": PLUGIN_VERSION,
                                  "plugin_namespace": PLUGIN_NAMESPACE})
