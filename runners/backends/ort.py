"""ONNX Runtime backend on host numpy arrays: one InferenceSession per graph the manifest runs."""
from __future__ import annotations

import os
from collections.abc import Collection
from contextlib import contextmanager

import numpy as np

from elx.runners.backends.base import Backend
from elx.runners.backends.ort_mapped import MappedWeights
from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from elx.runners.inputs.validation import check_threads


_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
                "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def session_options(threads: int | None = None, prepack: bool = True, arena: bool = True):
    """``prepack=False``: MatMul weights are not repacked into a per-session copy (what lets sessions share
    ``runners/backends/ort_mapped.py``'s one mapping of the weights, as the export's verification does; greedy
    decoding is 1.4x slower without the packing, measured on the real SmolLM2-135M, so the runtime keeps it), and
    no arena.  ``arena=False``: no arena, the packing kept (a generator loaded for a few measured runs: the int8
    export's recorded agreement)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # ONNX Runtime's default: pool threads spin between a run's ops instead of sleeping and waking per op.
    # Measured on the real SmolLM2-135M (2 threads, median of 3): greedy batch 1, 128 tokens 4.98 s with
    # spinning off, 3.83 s on; beam 4 batch 4, 64 tokens 5.74 s off, 5.11 s on.  ELX_ORT_SPINNING=0 turns it
    # off: on a machine whose cores are taken by other work spinning cost 1.7x (``docs/measurements/
    # cpu_profile.md``, load ~4 on 2 cores).  The top-k session keeps it off
    # (``runners/search/topk.py``: two spinning pools on two cores slowed beam 4 by 9%).
    if os.environ.get("ELX_ORT_SPINNING", "1").strip().lower() in ("0", "false", "no", "off"):
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if not (prepack and arena):
        # no arena: it grows by powers of two and keeps its largest size, so a verification's cases of several
        # shapes held up to twice their largest run (whisper-base's 30 s cases: the export's peak)
        options.enable_cpu_mem_arena = False
    return options


@contextmanager
def allocation_failures(graph: str):
    """ONNX Runtime's "Failed to allocate memory" (a run larger than the memory check's estimate,
    ``runners/inputs/validation.py``: ``check_memory``) as one line instead of its exception."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - ORT raises its own exception types
        text = str(err)
        if "Failed to allocate memory" not in text and "bad_alloc" not in text:
            raise
        raise ElxError(f"ONNX Runtime ran out of memory running the {graph} graph; lower num_beams, the batch or "
                       "the lengths") from None


def load_session(manifest: Manifest, name: str, providers: list, threads: int | None = None,
                 mapped: MappedWeights | None = None, arena: bool = True, prepack: bool | None = None):
    """The InferenceSession of the manifest's graph ``name``; one-line error when unloadable.  ``mapped`` (which
    the caller keeps alive as long as the session): the weights read from its one mapping of each data file
    (``runners/backends/ort_mapped.py``), prepacking off unless ``prepack`` (ONNX Runtime then packs the constant
    weights it has packed kernels for: a graph whose fp32 weights are also graph inputs keeps those unpacked)."""
    import onnxruntime as ort

    path = manifest.graph_path(name)
    prepack = mapped is None if prepack is None else prepack
    try:
        options = session_options(threads, prepack=prepack, arena=arena)
        if mapped is not None:
            mapped.add_to(options, path)
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as err:  # ORT raises several types for unreadable graphs
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ElxError(f"ONNX Runtime cannot load {path} ({first}); re-run 'elx export' for this folder")
    manifest.check_graph_io(name, {i.name: i.type for i in session.get_inputs()},
                            {o.name: o.type for o in session.get_outputs()})
    return session


def load_sessions(manifest: Manifest, providers: list, threads: int | None = None, mapped: MappedWeights | None = None,
                  arena: bool = True, packed_graphs: Collection[str] = ()) -> dict:
    """An InferenceSession per graph the manifest runs (stages and step): ``load_session`` of each (with ``mapped``,
    the graphs of ``packed_graphs`` prepacked)."""
    check_threads(threads)  # before ONNX Runtime starts any: it starts as many as asked, per session
    return {name: load_session(manifest, name, providers, threads, mapped, arena,
                               prepack=True if mapped is not None and name in packed_graphs else None)
            for name in [*manifest.stages, manifest.step]}


class OneResident:
    """The sessions of ``load_sessions``, loaded as a graph runs and one in memory at a time: asking for another
    graph's drops the resident one first.  For a generator run a few times where memory is what counts (the int8
    export's recorded agreement: its prefill and step sessions each hold a prepacked copy of the int8 weights,
    ~190 MiB each on the real SmolLM2-135M, beside HF's model); each switch loads a session again (a search loads
    its prefill, then its step)."""

    def __init__(self, load, names: list[str]):
        self._load, self._names = load, list(names)
        self.resident, self._session = None, None

    def __getitem__(self, name: str):
        if name not in self._names:
            raise KeyError(name)
        if name != self.resident:
            self.resident, self._session = None, None  # released before the next one loads
            self._session, self.resident = self._load(name), name
        return self._session

    def items(self):
        return ((name, self[name]) for name in self._names)


class OrtBackend(Backend):
    name, device = "ort", "cpu"
    in_place_cache = True

    def __init__(self, manifest: Manifest, threads: int | None = None, prepack: bool = True, arena: bool = True,
                 one_session: bool = False, packed_graphs: Collection[str] = ()):
        """``prepack=False``: the sessions share one mapping of the weights (``runners/backends/ort_mapped.py``),
        those of ``packed_graphs`` with prepacking on over it (``load_session``); ``arena=False``: no CPU arena
        (``session_options``); ``one_session``: one session in memory at a time (``OneResident``)."""
        mapped = None if prepack else MappedWeights()
        if one_session:
            check_threads(threads)
            self.sessions = OneResident(
                lambda name: load_session(manifest, name, ["CPUExecutionProvider"], threads, mapped, arena),
                [*manifest.stages, manifest.step])
        else:
            self.sessions = load_sessions(manifest, ["CPUExecutionProvider"], threads, mapped, arena, packed_graphs)
        self.mapped = mapped  # set after the sessions, so dropped after them: they read its arrays
        self._bindings = {}  # graph → (its IOBinding, what each name is bound to): run_in_place
        self._output_shapes, self._output_types = {}, {}
        for g, session in self.sessions.items():  # (one at a time: each loaded once here, the step's kept)
            self._output_shapes[g] = {o.name: o.shape for o in session.get_outputs()}
            self._output_types[g] = {o.name: _NUMPY_TYPES.get(o.type, np.float32) for o in session.get_outputs()}

    def run(self, graph: str, feeds: dict, outputs: list[str], host_outputs: Collection[str] = ()) -> list:
        with allocation_failures(graph):
            return self._session(graph).run(outputs, feeds)

    def _session(self, graph: str):
        """``graph``'s session; with one resident at a time (``OneResident``), the kept bindings of the one it
        replaces go first (a binding holds its session)."""
        if isinstance(self.sessions, OneResident) and self.sessions.resident != graph:
            self._bindings.clear()
        return self.sessions[graph]

    def run_in_place(self, graph: str, feeds: dict, outputs: list[str], in_place: dict) -> list:
        """Each buffer of ``in_place`` bound as both its input and its output (IOBinding on host memory: ONNX Runtime's
        GroupQueryAttention then appends the new positions inside it instead of copying the whole cache into a new
        present each step).  One binding per graph, kept: a buffer is bound again only when it changed (a new one
        with room, or a beam reorder's copy), so a step binds its few small inputs and one scores array."""
        session = self._session(graph)
        if graph not in self._bindings:
            self._bindings[graph] = (session.io_binding(), {})
        binding, bound = self._bindings[graph]
        sources = set(in_place.values())
        alive = []  # the small inputs' arrays, bound by address: alive until the run ends
        for name, value in feeds.items():
            if name in sources:  # held in ``bound`` while bound: its address stays valid
                if bound.get(name) is not value:
                    binding.bind_input(name, "cpu", 0, value.dtype, list(value.shape), value.ctypes.data)
                    bound[name] = value
            else:
                value = np.ascontiguousarray(value)
                alive.append(value)
                binding.bind_input(name, "cpu", 0, value.dtype, list(value.shape), value.ctypes.data)
        rows = feeds[next(iter(in_place.values()))].shape[0]  # a cache: one per row (state feeds are per input)
        results = []
        for name in outputs:
            if name in in_place:
                value = feeds[in_place[name]]
                if bound.get(("output", name)) is value:
                    results.append(value)
                    continue
                bound[("output", name)] = value
            else:
                value = np.empty(self._output_shape(graph, name, rows), dtype=self._output_types[graph][name])
            binding.bind_output(name, "cpu", 0, value.dtype, list(value.shape), value.ctypes.data)
            results.append(value)
        with allocation_failures(graph):
            session.run_with_iobinding(binding)
        return results

    def release_run(self) -> None:
        """Let go of what ``run_in_place`` bound: the last run's cache buffers (a beam search's: 30 layers x 2 x rows
        x its capacity) are held by the kept bindings until the next run otherwise."""
        self._bindings.clear()

    def _output_shape(self, graph: str, name: str, rows: int) -> list[int]:
        """An output's shape with its row axis ``rows`` (scores [rows, vocab]); other symbolic sizes are refused."""
        shape = self._output_shapes[graph][name]
        if any(not isinstance(d, int) and d != "rows" for d in shape):
            raise ElxError(f"the {graph} graph's output {name} has sizes {shape} besides its rows; it cannot run with "
                           "its cache in place: re-run 'elx export'")
        return [rows if d == "rows" else d for d in shape]

    def to_device(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def to_host(self, value) -> np.ndarray:
        return value

    def take(self, value, rows: np.ndarray) -> np.ndarray:
        return np.take(value, rows, axis=0)

    def permute_rows(self, value: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """In place where fewer than half the rows move (a beam reorder moves about a quarter of them):
        only the moved rows are copied, twice (gathered, then written), instead of every row once into a
        new array.  The gather is complete before any write, so chains of moves are safe."""
        moved = np.flatnonzero(rows != np.arange(rows.shape[0]))
        if 2 * moved.size >= rows.shape[0] or not value.flags.writeable:
            return np.take(value, rows, axis=0)
        value[moved] = value[rows[moved]]
        return value

    def nbytes(self, value) -> int:
        return int(value.nbytes)
