"""n-gram blocking for engines (``--pass ngram=N`` exports): in the engine as a plugin, or on the host.

``engine``: the decoder engine is built from ``decoder.ngram.tensorrt.onnx`` (node ``NGramRepeatBlock``)
with the plugin that fits the runtime, and the code the plugin runs is shipped next to the engines:

* TensorRT for RTX: the Python IPluginV3 of ``runners/tensorrt_ngram.py``; it launches the CUDA kernel
  of ``plugins_cuda/`` compiled by nvcc for the target compute capabilities (``libelx_ngram_kernel.so``).
* NVIDIA TensorRT: the C++ IPluginV3 library of ``plugins_cuda/`` (``libelx_ngram_plugin.so``, needs
  nvcc and TensorRT headers).

``host``: when that cannot be done (no nvcc, no CUDA sources, a build failure) and ``ngram="auto"``,
the decoder engine is built from the same graph with the plugin node removed (``strip_blocking``; the
log-softmax stays), the engine takes no token history, and the manifest's ``engines.ngram`` says
``"blocking": "host"`` with the reason: the runner then blocks n-grams on the host, as HF does.
Never dropped silently.  The stripped graph is verified like a pass: its output with the reference
blocking applied equals the export's own ``decoder.ngram.onnx`` (ORT's NGramRepeatBlock).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import onnx

from runners.errors import ElxError
from runners.manifest import Manifest
from runners.ngram_reference import block_ngrams
from runners.tensorrt_ngram import KERNEL_LIBRARY, OP_TYPE

from .onnx_export import save_model
from .tensorrt_verify import max_abs_diff, step_outputs, with_files

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "tools" / "build_plugin.py"
PLUGIN_LIBRARY = "libelx_ngram_plugin.so"
TOLERANCE = 1e-5  # the stripped graph computes the same log-softmax; only the blocking moves


def ngram_size(manifest: Manifest) -> int | None:
    for record in manifest.passes:
        if record.get("blocks_ngrams"):
            return int(record["blocks_ngrams"])
    return None


def history_inputs(manifest: Manifest) -> list[str]:
    step = manifest.graphs[manifest.step]
    return [name for name, spec in step["inputs"].items() if spec["from"] == "step:history"]


def strip_blocking(source: Path, target: Path) -> Path:
    """``source`` without its NGramRepeatBlock node: the graph output becomes the node's scores input."""
    model = onnx.load(str(source))
    graph = model.graph
    blocks = [n for n in graph.node if n.op_type == OP_TYPE]
    if len(blocks) != 1:
        raise ElxError(f"{source.name} has {len(blocks)} {OP_TYPE} nodes, expected 1; re-run 'elx export'")
    block = blocks[0]
    history, scores = block.input
    output = block.output[0]
    producers = [n for n in graph.node if scores in n.output]
    if len(producers) != 1 or any(scores in n.input for n in graph.node if n is not block):
        raise ElxError(f"{source.name}: the scores of {OP_TYPE} are not a single node's private output")
    producer = producers[0]
    producer.output[list(producer.output).index(scores)] = output
    graph.node.remove(block)
    if not any(history in n.input for n in graph.node):
        kept = [i for i in graph.input if i.name != history]
        del graph.input[:]
        graph.input.extend(kept)
    save_model(model, target)
    return target


def verify_stripped(manifest: Manifest, stripped_ort: Path, n: int) -> dict:
    """``stripped_ort`` (ORT-runnable) + reference blocking on the host == the export's in-graph blocking."""
    expected = step_outputs(manifest)
    host = with_files(manifest, {manifest.step: stripped_ort}, {manifest.step: history_inputs(manifest)})
    got = step_outputs(host)
    diff = max(max_abs_diff(e, block_ngrams(h, g, n)) for (h, e), (_, g) in zip(expected, got))
    if not diff <= TOLERANCE:
        raise ElxError(f"the decoder without in-graph n-gram blocking differs from the export by {diff:.3g}; "
                       "re-run 'elx export'")
    return {"max_abs_logprob_diff": diff, "tolerance": TOLERANCE}


def _cache_dir() -> Path:
    root = os.environ.get("ELX_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                           os.path.expanduser("~/.cache"), "elx")
    return Path(root)


def _build_script():
    if not BUILD_SCRIPT.is_file() or not (REPO / "plugins_cuda").is_dir():
        raise ElxError("the CUDA sources of the n-gram kernel (plugins_cuda/, tools/build_plugin.py) are not part "
                       "of this elx install; use a source checkout")
    spec = importlib.util.spec_from_file_location("elx_build_plugin", BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiled_library(target: str, capabilities: list[str], into: Path) -> Path:
    """nvcc-compile the n-gram ``kernel`` or C++ ``plugin`` library for ``capabilities`` and copy it ``into``.

    Compiled once per architecture set into the cache (``$ELX_CACHE_DIR``, default ~/.cache/elx)."""
    script = _build_script()
    archs = [cc.replace(".", "") for cc in capabilities]
    cache = _cache_dir() / f"ngram-{target}-sm{'_'.join(archs)}"
    try:
        built = script.build(cache, target=target, arch=",".join(archs))
    except script.BuildError as err:
        raise ElxError(f"cannot build the n-gram {target} library: {err}")
    name = KERNEL_LIBRARY if target == "kernel" else PLUGIN_LIBRARY
    shutil.copyfile(built, into / name)
    return into / name
