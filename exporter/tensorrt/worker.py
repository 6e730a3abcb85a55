"""Build one TensorRT engine from one ONNX graph, in a process of its own.

    python -m elx.exporter.tensorrt.worker < job.json        (the last stdout line is the JSON result)

``exporter/tensorrt/build.py`` starts one per graph, for three reasons: a TensorRT failure that ends
in ``std::terminate`` (the parser does that on some errors) kills only this process and becomes a
one-line error in the parent; ``LD_LIBRARY_PATH`` (needed by TensorRT for RTX's plugin import, see
``runners/backends/tensorrt_runtime.py``) only takes effect for a process started with it; and the builder's
memory is returned to the system when the process ends.

Job: ``runtime`` (module name), ``onnx``, ``engine`` (where to write the plan), ``profiles`` (input
name → list of [min, opt, max] shapes, one per optimization profile), ``compute_capabilities``
(["8.0", ...]; TensorRT for RTX only: NVIDIA's TensorRT builds for the GPU it runs on), ``plugin``
(null, ``{"kind": "python"}`` for the Python NGramRepeatBlock, ``{"kind": "library", "path": ...}`` for a
C++ plugin library).  The network is strongly typed (TensorRT for RTX supports nothing else): every
layer runs in the type of its ONNX tensors, so precision is decided in the graph
(the rule of ``exporter/precision/fp16.py``); TF32 is switched off so that fp32 means fp32.

Result: ``ok``, ``seconds`` (parse + build), ``bytes``, ``inputs`` / ``outputs`` as the network
reports them (dtype, shape with -1 for dynamic dims, and for inputs the profile shapes read back from
the optimization profile), ``log`` (TensorRT's warnings and errors); or ``ok: false`` with ``error``
(``stage``: parse / profile / build, and for parse errors the ``node``, ``op`` and ``desc``).
"""
from __future__ import annotations

import importlib
import json
import sys
import time

import numpy as np


def _dtype(trt, dt) -> str:
    try:
        return np.dtype(trt.nptype(dt)).name
    except TypeError:
        return str(dt).split(".")[-1].lower()


def _logger(trt, log: list):
    class Collect(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR, trt.ILogger.WARNING):
                log.append(f"{str(severity).split('.')[-1]}: {msg}")

    return Collect()


def _fail(stage: str, log: list, **error) -> dict:
    return {"ok": False, "error": {"stage": stage, **error}, "log": log[-20:]}


def build(job: dict) -> dict:
    trt = importlib.import_module(job["runtime"])
    log: list[str] = []
    logger = _logger(trt, log)
    start = time.perf_counter()
    builder = trt.Builder(logger)
    plugin = job.get("plugin") or {}
    if plugin.get("kind") == "python":
        from elx.runners.backends.tensorrt_ngram import register

        register(trt, builder.get_plugin_registry())
    elif plugin.get("kind") == "library":
        builder.get_plugin_registry().load_library(plugin["path"])
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(job["onnx"]):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        first = errors[0] if errors else None
        if first is None:
            return _fail("parse", log, desc=(log[-1] if log else "unknown parser error"))
        return _fail("parse", log, node=first.node_name(), op=first.node_operator(), desc=first.desc(),
                     code=str(first.code()).split(".")[-1])

    config = builder.create_builder_config()
    if config.get_flag(trt.BuilderFlag.TF32):
        config.clear_flag(trt.BuilderFlag.TF32)
    capabilities = job.get("compute_capabilities") or []
    if capabilities and hasattr(config, "set_compute_capability"):
        config.num_compute_capabilities = len(capabilities)
        for i, cc in enumerate(capabilities):
            config.set_compute_capability(getattr(trt.ComputeCapability, "SM" + cc.replace(".", "")), i)

    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    missing = [t.name for t in inputs if t.name not in job["profiles"]]
    if missing:
        return _fail("profile", log, desc=f"no profile for network input(s) {', '.join(missing)}")
    count = len(next(iter(job["profiles"].values()))) if job["profiles"] else 1
    profiles = []
    for index in range(count):
        profile = builder.create_optimization_profile()
        for tensor in inputs:
            low, opt, high = job["profiles"][tensor.name][index]
            dims = list(tensor.shape)
            if len(dims) != len(low) or any(d >= 0 and not lo == o == hi == d
                                             for d, lo, o, hi in zip(dims, low, opt, high)):
                return _fail("profile", log, desc=f"input {tensor.name!r} has shape {dims} in the graph, the manifest "
                                                  f"ranges are {low}..{high}")
            profile.set_shape(tensor.name, low, opt, high)
        config.add_optimization_profile(profile)
        profiles.append(profile)

    plan = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if plan is None:
        errors = [line for line in log if line.startswith(("ERROR", "INTERNAL_ERROR"))]
        return _fail("build", log, desc=(errors[-1] if errors else "the builder returned no engine"))
    with open(job["engine"], "wb") as f:
        f.write(plan)
    described_in = {}
    for tensor in inputs:
        shapes = [[list(s) for s in p.get_shape(tensor.name)] for p in profiles]
        described_in[tensor.name] = {"dtype": _dtype(trt, tensor.dtype), "shape": list(tensor.shape),
                                     "profiles": shapes}
    described_out = {}
    for i in range(network.num_outputs):
        tensor = network.get_output(i)
        described_out[tensor.name] = {"dtype": _dtype(trt, tensor.dtype), "shape": list(tensor.shape)}
    return {"ok": True, "seconds": seconds, "bytes": plan.nbytes, "inputs": described_in, "outputs": described_out,
            "log": log[-20:]}


def main() -> int:
    job = json.loads(sys.stdin.read())
    result = build(job)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0 if result["ok"] else 3


if __name__ == "__main__":
    sys.exit(main())
