"""n-gram blocking for engines (``--pass ngram=N`` exports): in the engine as a plugin, or on the host.

``engine``: the decoder engine is built from ``decoder.ngram.tensorrt.onnx`` (node ``NGramRepeatBlock``)
with the plugin that fits the runtime, and the code the plugin runs is shipped next to the engines:

* TensorRT for RTX: the Python IPluginV3 of ``runners/backends/tensorrt_ngram.py``; it launches the CUDA kernel
  of ``plugins_cuda/`` compiled by nvcc for the target compute capabilities (``libelx_ngram_kernel.so``).
* NVIDIA TensorRT: the C++ IPluginV3 library of ``plugins_cuda/`` (``libelx_ngram_plugin.so``, needs
  nvcc and TensorRT headers).

``host``: when that cannot be done (no nvcc, no CUDA sources, a build failure) and ``ngram="auto"``,
the decoder engine is built from the same graph with the blocking branch removed (``strip_blocking``:
the NGramRepeatBlock node, its log-softmax, the ``blocked`` output and the token history input), so
the engine returns the plain ``logits`` only; the manifest's ``engines.ngram`` says ``"blocking":
"host"`` with the reason, and the TensorRT backend tells the run plan that the step graph blocks
nothing (``TensorRTBackend.adapt``): the search then blocks n-grams on the host, as HF does.  Never
dropped silently.  The stripped graph is verified like a pass: its logits equal the export's.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import onnx

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from elx.runners.backends.tensorrt_ngram import KERNEL_LIBRARY, OP_TYPE

from elx.exporter.capture.onnx_export import save_model
from elx.exporter.tensorrt.verify import with_files
from elx.exporter.verification.verify import require_within_tolerance, verify_rewrite

REPO = Path(__file__).resolve().parents[2]  # a source checkout's root (installed: elx/, which has no tools/)
BUILD_SCRIPT = REPO / "tools" / "build_plugin.py"
PLUGIN_LIBRARY = "libelx_ngram_plugin.so"


def ngram_size(manifest: Manifest) -> int | None:
    """The n-gram size the step graph blocks (the ``ngram`` pass), or None."""
    blocked = manifest.graphs[manifest.step].get("blocked") or {}
    return int(blocked["ngram_size"]) if blocked.get("ngram_size") else None


def history_inputs(manifest: Manifest) -> list[str]:
    step = manifest.graphs[manifest.step]
    return [name for name, spec in step["inputs"].items() if spec["from"] == "step:history"]


def strip_blocking(source: Path, target: Path) -> Path:
    """``source`` without its blocking branch: NGramRepeatBlock, the log-softmax feeding only it, the blocked
    output and the history input go; the plain ``logits`` output stays."""
    model = onnx.load(str(source))
    graph = model.graph
    blocks = [n for n in graph.node if n.op_type == OP_TYPE]
    if len(blocks) != 1:
        raise ElxError(f"{source.name} has {len(blocks)} {OP_TYPE} nodes, expected 1; re-run 'elx export'")
    block = blocks[0]
    history, scores = block.input
    blocked = block.output[0]
    graph.node.remove(block)
    for node in [n for n in graph.node if scores in n.output]:
        if not any(scores in n.input for n in graph.node):
            graph.node.remove(node)  # the log-softmax computed only for the blocking
    kept_outputs = [o for o in graph.output if o.name != blocked]
    del graph.output[:]
    graph.output.extend(kept_outputs)
    if not any(history in n.input for n in graph.node):
        kept = [i for i in graph.input if i.name != history]
        del graph.input[:]
        graph.input.extend(kept)
    save_model(model, target)
    return target


def host_manifest(manifest: Manifest, stripped_ort: Path) -> Manifest:
    """The export described with the stripped step graph: plain logits, no history, nothing blocked."""
    step = manifest.graphs[manifest.step]
    host = with_files(manifest, {manifest.step: stripped_ort}, {manifest.step: history_inputs(manifest)},
                      {manifest.step: [step["blocked"]["output"]]})
    host.graphs[host.step].pop("blocked")
    return host


def verify_stripped(manifest: Manifest, stripped_ort: Path, n: int) -> dict:
    """``stripped_ort``'s logits equal the export's (the blocking moves to the host's processor, as HF does)."""
    report = verify_rewrite(manifest, host_manifest(manifest, stripped_ort))
    require_within_tolerance(report, "the decoder without in-graph n-gram blocking")
    return {**report, "ngram_size": n}


def _cache_dir() -> Path:
    from elx.exporter.cache_root import cache_root

    return cache_root()


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
