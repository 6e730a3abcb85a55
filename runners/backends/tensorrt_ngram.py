"""NGramRepeatBlock as a Python IPluginV3 for TensorRT for RTX (the C++ plugin in plugins_cuda/ is NVIDIA TensorRT's).

The node ``--pass ngram=N`` writes into ``decoder.ngram.tensorrt.onnx`` (op ``NGramRepeatBlock``,
``plugin_version`` "1", empty namespace, int field ``ngram_size``) maps to this plugin when its creator is
registered in the process: the engine builder registers it before parsing, the TensorRT backend before
deserializing (the engine stores the plugin's name, version and ``ngram_size``, not its code).

The plugin's work on the device is the CUDA kernel of ``plugins_cuda/ngram_repeat_block.cu``, compiled
ahead of time by nvcc into ``libelx_ngram_kernel.so`` (C launcher ``ngramRepeatBlockLaunch``; no TensorRT
headers needed) that the builder ships next to the engines.  ``enqueue`` copies the log-probabilities into
the output (``cuMemcpyDtoDAsync`` of the driver library) and launches the kernel on TensorRT's stream;
nothing is synchronised and no tensor visits the host.  Semantics: ``runners/search/ngram_reference.py``.

Why Python and not the C++ plugin: the IPluginV3 classes of the ``tensorrt_rtx`` bindings are compiled
against TensorRT for RTX's own headers, which ship in no wheel, so the ABI is right by construction.
(``tensorrt_rtx.plugin``, the decorator API with ahead-of-time kernels, is absent from the 1.7.1.116
bindings wheel: ``import tensorrt_rtx.plugin`` fails with ``No module named 'tensorrt_rtx_bindings.plugin'``.)
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from elx.runners.errors import ElxError

OP_TYPE = "NGramRepeatBlock"
VERSION = "1"
NAMESPACE = ""
FIELD = "ngram_size"
KERNEL_LIBRARY = "libelx_ngram_kernel.so"

_kernel = None  # ctypes library with ngramRepeatBlockLaunch, once loaded
_driver = None
_classes: dict = {}  # TensorRT module name → (plugin class, creator class)
_registered: dict = {}  # TensorRT module name → creator instance (kept alive: the registry holds a raw pointer)


def load_kernel(path) -> None:
    """Load the kernel library the plugin launches (needed to run engines, not to build them)."""
    global _kernel, _driver
    path = Path(path)
    try:
        lib = ctypes.CDLL(str(path))
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise ElxError(f"cannot load the n-gram kernel {path} ({err}); rebuild the engines with elx build-engine "
                       "on a machine with nvcc, or build them with --ngram host")
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.ngramRepeatBlockLaunch.restype = ctypes.c_int
    lib.ngramRepeatBlockLaunch.argtypes = [vp, ctypes.c_int, vp, ctypes.c_int, i64, i64, i64, ctypes.c_int32, vp]
    driver.cuMemcpyDtoDAsync_v2.restype = ctypes.c_int
    driver.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, vp]
    _kernel, _driver = lib, driver


def _int_field(fields, name: str) -> int | None:
    for field in fields:
        if field.name == name:
            return int(np.asarray(field.data).reshape(-1)[0])
    return None


def _define(trt):
    """Plugin and creator classes bound to one TensorRT module (``tensorrt`` or ``tensorrt_rtx``)."""
    dt = trt.DataType
    token_types = {dt.INT64: (0, 8), dt.INT32: (1, 4)}
    score_types = {dt.FLOAT: (0, 4), dt.HALF: (1, 2)}

    class NGramPlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        def __init__(self, ngram_size: int):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.ngram_size = int(ngram_size)
            self.num_outputs = 1
            self.plugin_namespace = NAMESPACE
            self.plugin_name = OP_TYPE
            self.plugin_version = VERSION

        def get_capability_interface(self, type):
            return self

        def clone(self):
            return NGramPlugin(self.ngram_size)

        # -- build ---------------------------------------------------------------------------
        def get_output_data_types(self, input_types):
            return [input_types[1]]

        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            return [inputs[1]]

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            if pos == 0:
                return desc.type in token_types
            if pos == 1:
                return desc.type in score_types
            return desc.type == in_out[1].desc.type

        def configure_plugin(self, inputs, outputs):
            pass

        def get_workspace_size(self, inputs, outputs):
            return 0

        def get_valid_tactics(self):
            return []

        # -- runtime -------------------------------------------------------------------------
        def set_tactic(self, tactic):
            pass

        def on_shape_change(self, inputs, outputs):
            pass

        def attach_to_context(self, context):
            return self.clone()

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection([
                trt.PluginField(FIELD, np.array([self.ngram_size], dtype=np.int32), trt.PluginFieldType.INT32)])

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            if _kernel is None:
                raise RuntimeError("NGramRepeatBlock: no kernel library loaded (elx.runners.backends.tensorrt_ngram.load_kernel)")
            history, scores = input_desc
            rows, cur_len = (int(d) for d in history.dims)
            vocab = int(scores.dims[1])
            token_type, _ = token_types[history.type]
            score_type, itemsize = score_types[scores.type]
            if outputs[0] != inputs[1] and rows * vocab:
                err = _driver.cuMemcpyDtoDAsync_v2(outputs[0], inputs[1], rows * vocab * itemsize, stream)
                if err:
                    raise RuntimeError(f"NGramRepeatBlock: cuMemcpyDtoDAsync failed (CUresult {err})")
            err = _kernel.ngramRepeatBlockLaunch(inputs[0], token_type, outputs[0], score_type, rows, cur_len, vocab,
                                                 self.ngram_size, stream)
            if err:
                raise RuntimeError(f"NGramRepeatBlock: kernel launch failed (cudaError {err})")

    class NGramCreator(trt.IPluginCreatorV3One):
        def __init__(self):
            trt.IPluginCreatorV3One.__init__(self)
            self.name = OP_TYPE
            self.plugin_namespace = NAMESPACE
            self.plugin_version = VERSION
            self.field_names = trt.PluginFieldCollection([
                trt.PluginField(FIELD, np.array([], dtype=np.int32), trt.PluginFieldType.INT32)])

        def create_plugin(self, name, field_collection, phase):
            n = _int_field(field_collection, FIELD)
            if n is None or n < 1:
                raise ValueError(f"NGramRepeatBlock node {name!r} needs an integer attribute ngram_size >= 1")
            return NGramPlugin(n)

    return NGramPlugin, NGramCreator


def plugin_classes(trt):
    if trt.__name__ not in _classes:
        _classes[trt.__name__] = _define(trt)
    return _classes[trt.__name__]


def register(trt, registry=None) -> None:
    """Register the NGramRepeatBlock creator with ``registry`` (default: the module's global registry), once."""
    if trt.__name__ in _registered:
        return
    registry = registry or trt.get_plugin_registry()
    creator = plugin_classes(trt)[1]()
    if not registry.register_creator(creator, NAMESPACE):
        raise ElxError(f"{trt.__name__} refused to register the Python NGramRepeatBlock plugin; another creator "
                       "with that name is registered in this process (was the C++ plugin library loaded?)")
    _registered[trt.__name__] = creator
