"""ONNX Runtime backend: one InferenceSession per graph named in the manifest."""
from __future__ import annotations

import numpy as np

from runners.errors import ElxError

from .backend import Backend, DecoderCache, EncoderState
from .manifest import Manifest

_DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32, "float16": np.float16}


def session_options(threads: int | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # no busy-waiting between steps: the host work of the search (and any other system timed in the
    # same process) gets the cores instead of ORT's idle pool threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class OrtBackend(Backend):
    def __init__(self, manifest: Manifest, threads: int | None = None, providers=None):
        import onnxruntime as ort

        self.manifest = manifest
        self.providers = providers or ["CPUExecutionProvider"]
        self.sessions = {}
        for name in [*manifest.stages, manifest.step]:
            path = manifest.graph_path(name)
            try:
                self.sessions[name] = ort.InferenceSession(str(path), session_options(threads), providers=self.providers)
            except Exception as err:  # ORT raises several types for unreadable graphs
                first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
                raise ElxError(f"ONNX Runtime cannot load {path} ({first}); re-run 'elx export' for this folder")
        step = manifest.graphs[manifest.step]
        self._step_inputs = step["inputs"]
        self._cache_map = {e["input"]: e["output"] for e in manifest.cache_entries}
        self._cache_specs = {e["input"]: e for e in manifest.cache_entries}
        self._logits = step.get("logits", "logits")
        self._step_outputs = [self._logits] + [self._cache_map[k] for k in self._cache_map]
        self._token_input = next(n for n, s in self._step_inputs.items() if s["from"] == "step:input_ids")
        self._history_input = next((n for n, s in self._step_inputs.items() if s["from"] == "step:history"), None)
        self.needs_history = self._history_input is not None
        self.returns_log_probs = step.get("logits_kind") == "log_probs"
        self._constant_inputs = {n: s["from"] for n, s in self._step_inputs.items()
                                 if not s["from"].startswith(("step:", "cache:"))}

    # -- once per input -------------------------------------------------------------------
    def encode(self, inputs: dict) -> EncoderState:
        available = {f"input:{role}": np.ascontiguousarray(a) for role, a in inputs.items()}
        for name in self.manifest.stages:
            graph = self.manifest.graphs[name]
            feeds = {inp: self._resolve(spec["from"], available, name) for inp, spec in graph["inputs"].items()}
            outputs = list(graph["outputs"])
            for out_name, value in zip(outputs, self._run_graph(name, feeds, outputs)):
                available[f"{name}:{out_name}"] = value
        feeds = {inp: self._hold(self._resolve(src, available, self.manifest.step))
                 for inp, src in self._constant_inputs.items()}
        batch = int(next(iter(inputs.values())).shape[0])
        extras = {key: self._to_host(available[key]) for key in ("encoder:last_hidden_state",) if key in available}
        return EncoderState(feeds, batch, extras)

    def _run_graph(self, name: str, feeds: dict, outputs: list) -> list:
        return self.sessions[name].run(outputs, feeds)

    def _hold(self, value):
        """How per-input state is kept between steps (host arrays here; device buffers with IOBinding)."""
        return value

    @staticmethod
    def _to_host(value):
        return value

    @staticmethod
    def _resolve(source: str, available: dict, graph: str):
        if source not in available:
            role = source.partition(":")[2]
            raise ElxError(f"graph {graph!r} needs {source!r}; provide the encoder input {role!r}")
        return available[source]

    # -- per step -------------------------------------------------------------------------
    def empty_cache(self, rows: int) -> DecoderCache:
        arrays = {}
        for name, spec in self._cache_specs.items():
            shape = [rows if d == "rows" else (0 if i == spec["seq_axis"] else d) for i, d in enumerate(spec["shape"])]
            arrays[name] = np.zeros(shape, dtype=_DTYPES[spec.get("dtype", "float32")])
        return DecoderCache(arrays, rows)

    def step(self, input_ids, state: EncoderState, cache: DecoderCache, history=None):
        feeds = dict(state.feeds)
        feeds.update(cache.arrays)
        feeds[self._token_input] = input_ids
        if self._history_input is not None:
            if history is None:
                raise ElxError("this decoder blocks n-grams in the graph and needs the token history")
            feeds[self._history_input] = np.ascontiguousarray(history, dtype=np.int64)
        logits, *presents = self.sessions[self.manifest.step].run(self._step_outputs, feeds)
        return logits, DecoderCache(dict(zip(self._cache_map, presents)), cache.rows)
