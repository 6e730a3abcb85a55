"""Export a deep model in the time of a shallow one: trace a 3-layer template, stitch the other layers.

**Why.**  ``torch.onnx.export(..., dynamo=True)`` (``exporter/capture/onnx_export.py``) costs time per traced layer and
more than linearly in the layer count: torch.export's symbolic shapes, the decompositions and onnxscript's
optimizer (its pattern matcher walks the whole graph per rule) all grow with the graph.  Measured on the
project's 2-core machine (SmolLM2-135M dims, load 6-8, seconds for prefill.onnx + decoder.onnx): 2 layers
15.7 + 20.7, 4 layers 13.3 + 25.1, 8 layers 40.2 + 86.0, and the real 30-layer SmolLM2 483 + 1037
(issue 41).  Every layer of a stack is the same module code, so the exported nodes of layer 9 are those of
layer 2 with other weights and other cache names.

**How.**  ``exporter/capture/template.py`` builds the model with 3 layers per stack (same class and config,
synthetic layer weights, the model's own embeddings, head and buffers); ``trace`` exports it exactly as a
whole model is exported (the same wrapper, dynamo, onnxscript's optimizer, the last-position rewrite);
``exporter/capture/weights.py`` finds which weight each initializer holds; ``exporter/capture/stitch.py``
copies layer 2 once per missing layer, checked against layer 1, bound to the model's weights, which are
written to ``weights.data`` one tensor at a time straight from the PyTorch parameters.  The stitched graph is
node for node the graph a whole-model trace gives (``tests/test_capture.py`` compares the two, and their
outputs bit for bit), so the passes find the same patterns, and it is verified against PyTorch like any
export (``exporter/verification/verify.py``).  A traced template is kept for the next export of the same model
(``exporter/capture/template_cache.py``), which then traces nothing.

**Not chosen.**  (b) the TorchScript exporter (``dynamo=False``): deprecated, and its graphs differ from the
dynamo graphs every pass matches (other decompositions, other names); (c) building the graphs from the weights
with onnx helpers as onnxruntime-genai's builder does: fastest, but a second implementation of each family's
forward (norms, RoPE variants, GQA, biases, parallel residuals), which elx avoids by tracing HF's own modules.
(c) done for the *templates* of the Llama architecture (15th session: Llama; 16th: Mistral, Qwen2, Qwen3), GPT-2
and OPT (16th), T5, BART, Marian and mBART (17th): ``exporter/capture/builders.py``'s modules write the templates node for node as
the trace does (checked canonically against it), in milliseconds where the real SmolLM2-135M's took 11.7 + 19.9 s
of tracing, GPT-2's 8.9 + 17.3 s and t5-base's three ~20 s on two cores.

**Shallow models built whole.**  A model with 3 layers or fewer per stack has nothing to stitch; where a builder
describes it, it is its own template (``Template.whole``) and each graph a builder writes is built from its own
weights (milliseconds, where tracing a 2-layer model's graph takes 15-25 s on two cores), the other graphs traced
whole.  The built graph computes what the trace does (``tests/test_capture.py`` compares their outputs bit for bit;
node for node it differs only in which input each symbolic size is read from, as a stitched graph does).

**When not.**  A shallow model no builder describes is traced whole (nothing to save), and so is a model
whose template does not fit the stitcher's description (layers of several types, a layer-dependent constant, a
weight folded into a form the binding does not know): ``Capture`` says why and traces whole.  ``ELX_CAPTURE``
``=trace`` forces whole-model tracing (for comparisons), ``=stitch`` makes a refusal an error (for tests).

**Built, not traced.**  Where a builder of ``exporter/capture/builders.py`` describes the model (the prefill and
step templates of Llama, Mistral, Qwen2, Qwen3, GPT-2, OPT; the encoder, cross K/V and decoder-step templates of
T5, BART, Marian and mBART), the template is built from the weights in milliseconds instead of traced (the traced template node
for node, with the value shapes the passes read); ``ELX_TEMPLATE_BUILDER=0`` traces it as for every other family
(comparisons, tests of the trace).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import onnx

from elx.runners.errors import ElxError

from elx.exporter.capture import template_cache
from elx.exporter.capture.stitch import NotStitchable, Stack, TooShallow, bind_weights, order_io, stitch_stack
from elx.exporter.capture.template import TEMPLATE_LAYERS, make_template
from elx.exporter.capture.weights import WeightsFile, bind
from elx.exporter.capture.onnx_export import finished, save_model, trace
from elx.exporter.capture.parallel import TemplateProcess
from elx.exporter.capture.shared_weights import WEIGHTS_FILE

MODES = ("auto", "stitch", "trace")


def capture_mode() -> str:
    mode = os.environ.get("ELX_CAPTURE", "auto").strip() or "auto"
    if mode not in MODES:
        raise ElxError(f"ELX_CAPTURE is {mode!r}; use one of {', '.join(MODES)}")
    return mode


class Capture:
    """How one export's graphs are captured: stitched from a template where it applies, else traced whole.

    ``report(line)`` receives progress lines (a line per stitched layer group, say ``Progress``);
    ``records`` holds per graph file how it was captured (the manifest's ``graphs.X.capture``)."""

    def __init__(self, model, family, folder: Path, mode: str | None = None, report=None):
        self.model, self.family, self.folder = model, family, Path(folder)
        self.mode = mode or capture_mode()
        self.report = report or (lambda line: None)
        self.records = {}
        self._template, self._refusal, self._weights = None, None, None
        self._tensors = None
        self._children = {}  # graph file -> TemplateProcess tracing its template
        self._cache_keys = {}  # graph file -> its template's key in ``exporter/capture/template_cache.py`` (None: off)
        self._cached = {}  # graph file -> (its template, its bindings or None) read from that cache by ``prefetch``
        self._whole = {}  # graph file traced whole -> the second process tracing it, or its graph from the cache
        self._bound = {}  # graph file -> the bindings the cache kept for its template (``template_cache.load_bound``)
        self._tensors_digest = None  # ``template_cache.tensors_digest`` of the template
        self._model_digest = None  # ``template_cache.model_digest`` of the model ("": too large to keep whole)
        self._said_why_traced = False  # ``_builder`` said why a Llama's templates are traced
        # called once as ``while_waiting(still_tracing)``, where this process would otherwise wait for a second
        # process's template (the export runs the verification's PyTorch reference there); its time is taken from the
        # wait, not added to the export; ``still_tracing()`` says whether the second process is still at work
        self.while_waiting = None

    # -- the template, built once per export --------------------------------------------------------------
    def _get_template(self):
        if self.mode == "trace":
            self._refusal = self._refusal or "ELX_CAPTURE=trace"
            return None
        if self._template is None and self._refusal is None:
            try:
                self._template = make_template(self.model, TEMPLATE_LAYERS)
            except TooShallow as err:
                self._template = _whole_model_template(self.model)
                if self._template is None:
                    self._refusal = f"traced whole: {err}"
            except NotStitchable as err:
                self._refused(f"traced whole: {err}")
        return self._template

    def _refused(self, why: str) -> None:
        self._refusal = why
        self._template = None
        if self.mode == "stitch":
            raise ElxError(f"ELX_CAPTURE=stitch: the model cannot be stitched ({why})")
        self.report(why)

    def _weights_file(self) -> WeightsFile:
        if self._weights is None:
            self._weights = WeightsFile(self.folder)
        return self._weights

    def tensors(self) -> dict:
        if self._tensors is None:
            self._tensors = {**dict(self.model.named_parameters(remove_duplicate=False)),
                             **dict(self.model.named_buffers(remove_duplicate=False))}
        return self._tensors

    def weights_writing(self) -> bool:
        """Some weight is not on disk yet."""
        return self._weights is not None and self._weights.writing()

    def hand_over_weights(self) -> WeightsFile | None:
        """The ``weights.data`` being written (None: no graph was stitched), now the caller's to ``close`` before
        anything reads it (the export: before the verification's sessions load) and to ``abort`` on failure;
        its thread goes on writing meanwhile (``exporter/capture/weights_writer.py``)."""
        weights, self._weights = self._weights, None
        return weights

    def close(self) -> None:
        """Second processes stopped; weights not handed over written and closed (``hand_over_weights``)."""
        for child in [*self._children.values(), *self._whole.values()]:
            if isinstance(child, TemplateProcess):
                child.stop()
        self._children, self._whole = {}, {}
        weights, self._weights = self._weights, None
        self._template = self._tensors = self.model = None  # the export frees HF's model later
        if weights is not None:
            weights.close()

    def abort(self) -> None:
        """``close`` after a failure: weights not handed over are left unwritten."""
        if self._weights is not None:
            self._weights.abort()
        self.close()

    # -- a template traced by a second process ------------------------------------------------------------
    def prefetch(self, make_spec, path: Path) -> None:
        """Start tracing the template of the graph ``export(make_spec, path)`` will write (or the graph itself, for
        a small model traced whole), in a forked process, while this one goes on with the graphs before it
        (``exporter/capture/parallel.py``).  Nothing happens where it does not apply (no ``fork``,
        ``ELX_CAPTURE_PARALLEL=0``, a model traced whole larger than ``parallel.WHOLE_BYTES``, a cache hit)."""
        from elx.exporter.capture.parallel import parallel_allowed

        path = Path(path)
        if path.name in self._children or path.name in self._cached or path.name in self._whole:
            return
        template = self._get_template()
        if template is None:
            self._prefetch_whole(make_spec, path)
            return
        import torch

        with torch.random.fork_rng():  # the spec's example inputs draw from torch's generator: leave it as it was
            spec = make_spec(template.model)
            if self._builder(spec) is not None:  # built here when its graph is exported: milliseconds, no cache
                return
            key = None if template.whole else self._cache_key(spec, path.name)
        if template.whole:  # a shallow model's graph no builder writes: traced whole
            self._prefetch_whole(make_spec, path)
            return
        cached = _from_cache(key) if key else None
        if cached is not None:
            self._cached[path.name] = cached
            return
        if not parallel_allowed():
            return
        self._children[path.name] = TemplateProcess.start(lambda: trace(make_spec(template.model)),
                                                          self.folder / f".template.{path.name}")
        self.report(f"{path.name}: tracing its {TEMPLATE_LAYERS}-layer template in a second process")

    def _prefetch_whole(self, make_spec, path: Path) -> None:
        """``prefetch`` for a graph traced whole: the second process traces the model itself, where the model is
        small enough for its graph (every weight inside) to be written and read back (``parallel.WHOLE_BYTES``) and
        the cache does not hold it already."""
        from elx.exporter.capture.parallel import WHOLE_BYTES, parallel_allowed

        if not parallel_allowed() or template_cache.tensor_bytes(self.model) > WHOLE_BYTES:
            return
        if template_cache.enabled():
            import torch

            with torch.random.fork_rng():  # the spec's example inputs draw from torch's generator: leave it as it was
                key = self._whole_key(make_spec(self.model), path.name)
            model = template_cache.load(key) if key else None
            if model is not None:
                self._whole[path.name] = model
                return
        self._whole[path.name] = TemplateProcess.start(lambda: trace(make_spec(self.model)),
                                                       self.folder / f".whole.{path.name}")
        self.report(f"{path.name}: tracing it in a second process")

    # -- one graph --------------------------------------------------------------------------------------------
    def export(self, make_spec, path: Path) -> list[str]:
        """Write the graph ``make_spec(model)`` describes to ``path``; returns the data files it reads."""
        path = Path(path)
        real = make_spec(self.model)
        template = self._get_template()
        if template is not None and template.whole and self._builder(real) is None:  # ``real``: the template's spec
            template = None  # a shallow model's graph no builder writes: traced whole
            self.records[path.name] = {"why": "traced whole: no builder writes this graph of a shallow model"}
        if template is not None:
            started = time.perf_counter()
            try:
                model = self._stitch(make_spec, real, template, path.name)
            except NotStitchable as err:  # this graph only: the template may still serve the others
                why = f"traced whole: {err}"
                if self.mode == "stitch":
                    raise ElxError(f"ELX_CAPTURE=stitch: {path.name} cannot be stitched ({why})") from None
                self.report(f"{path.name}: {why}")
                self.records[path.name] = {"why": why}
            else:
                onnx.save_model(finished(model), str(path))
                self.records[path.name]["seconds"] = round(time.perf_counter() - started, 1)
                return [WEIGHTS_FILE]
        started = time.perf_counter()
        model, how = self._traced_whole(real, path.name)
        written = save_model(finished(model), path)
        del model
        why = self.records.get(path.name, {}).get("why", self._refusal)
        self.records[path.name] = {"method": "traced", "why": why, "seconds": round(time.perf_counter() - started, 1),
                                   **how}
        return written

    def _builder(self, spec):
        """The template builder module that builds ``spec``'s template (``exporter/capture/builders.py``)
        where ``ELX_TEMPLATE_BUILDER`` is not 0, else None (a model of a builder's classes it does not describe
        says why once: its templates are traced)."""
        from elx.exporter.capture import builders, llama_builder

        if self._template is None or not llama_builder.enabled():
            return None
        builder = builders.for_model(self._template.model)
        if builder is None:
            return None
        why = builder.applies(self._template.model)
        if why is None:
            return builder if builders.builds(builder, spec.module) else None
        if not self._said_why_traced:
            self._said_why_traced = True
            self.report(f"templates traced, not built ({why})")
        return None

    def _whole_key(self, spec, name: str) -> str | None:
        """Graph ``name``'s key in the cache of whole graphs (``template_cache.whole_graph_key``); None where the
        cache is off or the model too large for it."""
        if not template_cache.enabled():
            return None
        try:
            if self._model_digest is None:
                self._model_digest = template_cache.model_digest(self.model) or ""
            if self._model_digest:
                return template_cache.whole_graph_key(name, spec, self.model, self._model_digest)
        except Exception as err:  # noqa: BLE001 - a tensor whose bytes cannot be read: trace, as without a cache
            self._model_digest = ""
            self.report(f"{name}: no cache for this model's graphs ({type(err).__name__}: {str(err)[:120]})")
        return None

    def _traced_whole(self, spec, name: str) -> tuple[onnx.ModelProto, dict]:
        """Graph ``name`` traced whole: the graph an earlier export traced from the same model and code (the
        template cache keeps whole graphs of small models: ``template_cache.whole_graph_key``), the second
        process's (``prefetch``), or traced here; and how (the manifest's ``capture`` record).  A traced one is
        kept in the cache."""
        key = self._whole_key(spec, name)
        prefetched = self._whole.pop(name, None)
        child = prefetched if isinstance(prefetched, TemplateProcess) else None
        model = prefetched if isinstance(prefetched, onnx.ModelProto) else None
        if model is None and child is None and key:
            model = template_cache.load(key)
        if model is not None:
            self.report(f"{name}: traced whole by an earlier export, from the cache ({template_cache.cache_dir()})")
            return model, {"from_cache": True}
        in_parallel = False
        if child is not None:
            self._wait_for(child)
            model, why = child.result()
            if model is None:
                self.report(f"{name}: the second process gave no graph ({why}); tracing it here")
            else:
                in_parallel = True
                self.report(f"{name}: traced in {child.seconds:.1f} s (in a second process)")
        if model is None:
            model = trace(spec)
        if key:
            why = template_cache.store(key, model)
            if why:
                self.report(f"{name}: its graph not kept in the cache ({why})")
        return model, {"from_cache": False, "traced_in_parallel": in_parallel}

    def _wait_for(self, child) -> None:
        """Run ``while_waiting`` (once per export) where this process would otherwise wait for ``child``."""
        if self.while_waiting is not None and child.running():
            work, self.while_waiting = self.while_waiting, None
            try:
                work(child.running)
            except BaseException:
                child.stop()
                raise

    def _cache_key(self, spec, name: str) -> str | None:
        if name not in self._cache_keys:
            key = None
            if template_cache.enabled():
                try:
                    if self._tensors_digest is None:  # the same for every graph of the export: hashed once
                        self._tensors_digest = template_cache.tensors_digest(self._template)
                    key = template_cache.template_key(name, spec, self._template, self._tensors_digest)
                except Exception as err:  # noqa: BLE001 - a tensor whose bytes cannot be read: trace, as without a cache
                    self.report(f"{name}: no template cache for this model ({type(err).__name__}: {str(err)[:120]})")
            self._cache_keys[name] = key
        return self._cache_keys[name]

    def _traced_template(self, spec, name: str) -> tuple[onnx.ModelProto, float, str]:
        """The template's graph: built from the weights (``exporter/capture/builders.py``; its bindings kept for
        ``_stitch``), from the template cache (``exporter/capture/template_cache.py``), from the second process started
        by ``prefetch`` when it succeeded, else traced here; its tracing (building) time, and where it came from
        ("built", "cache", "second process", "here").  A traced one is kept in the cache; a built one is not
        (building it is quicker than hashing the model's tensors for its key)."""
        builder = self._builder(spec)
        if builder is not None:
            from elx.exporter.capture import builders

            started = time.perf_counter()
            model, self._bound[name] = builders.build(builder, spec.module, self._template.model)
            built = time.perf_counter() - started
            what = "built whole" if self._template.whole else f"built its {TEMPLATE_LAYERS}-layer template"
            self.report(f"{name}: {what} from the weights in {built:.1f} s "
                        f"(exporter/capture/{builder.__name__.rsplit('.', 1)[-1]}.py)")
            return model, built, "built"
        key = self._cache_key(spec, name)
        cached = self._cached.pop(name, None)
        if cached is None and key:
            cached = _from_cache(key)
        if cached is not None:
            self.report(f"{name}: its {TEMPLATE_LAYERS}-layer template from the cache ({template_cache.cache_dir()})")
            model, bindings = cached
            if bindings is not None:
                self._bound[name] = bindings
            return model, 0.0, "cache"
        model, traced, where = self._trace_template(spec, name)
        if key:
            why = template_cache.store(key, model)
            if why:
                self.report(f"{name}: its template not kept in the cache ({why})")
        return model, traced, where

    def _trace_template(self, spec, name: str) -> tuple[onnx.ModelProto, float, str]:
        child = self._children.pop(name, None)
        if child is not None:
            self._wait_for(child)
            model, why = child.result()
            if model is not None:
                self.report(f"{name}: traced a {TEMPLATE_LAYERS}-layer template in {child.seconds:.1f} s "
                            "(in a second process)")
                return model, child.seconds, "second process"
            self.report(f"{name}: the second process gave no template ({why}); tracing it here")
        started = time.perf_counter()
        try:
            model = trace(spec)
        except Exception as err:  # noqa: BLE001 - a template the exporter cannot trace: trace the model itself
            raise NotStitchable(f"its template does not trace ({type(err).__name__}: {str(err)[:200]})") from None
        traced = time.perf_counter() - started
        self.report(f"{name}: traced a {TEMPLATE_LAYERS}-layer template in {traced:.1f} s")
        return model, traced, "here"

    def _stitch(self, make_spec, real, template, name: str) -> onnx.ModelProto:
        spec = make_spec(template.model)
        model, traced, where = self._traced_template(spec, name)
        bindings = self._bound.pop(name, None)
        if bindings is None:
            sources = {**{n: p.detach().numpy() for n, p in template.model.named_parameters(remove_duplicate=False)},
                       **{n: b.detach().numpy() for n, b in template.model.named_buffers(remove_duplicate=False)}}
            bindings = bind(model.graph.initializer, sources)
            del sources
            if self._cache_keys.get(name):
                template_cache.store_bindings(self._cache_keys[name], bindings)
        scopes = _stack_scopes(spec.module, template)
        tensors, weights = self.tensors(), self._weights_file()
        _refuse_unbound_layer_constants(model, scopes, bindings)
        io_names = {}
        total = sum(max(0, template.stacks[s][1] - template.stacks[s][0]) for s in scopes)
        done, began = [0], time.perf_counter()
        every = max(1, total // 6)

        def on_layer(c):
            done[0] += 1
            if done[0] % every == 0 or done[0] == total:
                elapsed = time.perf_counter() - began
                eta = elapsed / done[0] * (total - done[0])
                self.report(f"{name}: stitched layer {c} ({done[0]}/{total} copies, {elapsed:.1f} s, ETA {eta:.0f} s)")

        for stack_path, scope in scopes.items():
            count, real_layers = template.stacks[stack_path]
            stack = Stack(scope, stack_path, count, real_layers)
            for key, copies in stitch_stack(model, stack, bindings, weights, tensors, on_layer).items():
                io_names.setdefault(key, []).extend(copies)
        order_io(model, io_names, real.input_names, real.output_names)
        _check_every_layer_read(model, bindings, template)
        bind_weights(model, bindings, weights, tensors)
        if template.whole:
            self.records[name] = {"method": "built", "why": f"{template.layers} layers or fewer per stack: built whole "
                                  "from the weights, nothing to stitch"}
            return model
        self.records[name] = {"method": "stitched", "template_layers": TEMPLATE_LAYERS,
                              "template_trace_seconds": round(traced, 1),
                              "template_traced_in_parallel": where == "second process",
                              "template_from_cache": where == "cache", "template_built": where == "built"}
        return model


def _whole_model_template(model):
    """A model of ``TEMPLATE_LAYERS`` layers or fewer per stack as its own template (``Template.whole``), where a
    builder of ``exporter/capture/builders.py`` describes it: its graphs are then built from its own weights, the
    stitcher copying no layer, instead of traced whole (a 2-layer model's trace takes 15-25 s a graph on the 2-core
    machines, its build milliseconds).  None (trace it whole) where no builder applies, builders are off
    (``ELX_TEMPLATE_BUILDER=0``) or the model has no layer stack."""
    from elx.exporter.capture import builders, llama_builder
    from elx.exporter.capture.template import Template, stacks_of

    if not llama_builder.enabled():
        return None
    builder = builders.for_model(model)
    stacks = stacks_of(model)
    if builder is None or not stacks or builder.applies(model) is not None:
        return None
    return Template(model, {stack: (count, count) for stack, count in stacks.items()}, whole=True)


def _from_cache(key: str):
    """(template, bindings) from the template cache: without its weights where the cache kept its bindings
    (``template_cache.load_bound``), else whole with None; None on a miss."""
    bound = template_cache.load_bound(key)
    if bound is not None:
        return bound
    model = template_cache.load(key)
    return None if model is None else (model, None)


def _stack_scopes(module, template) -> dict:
    """{stack path in the HF model: the wrapper module's path of it} (what the graph's name scopes say), for the
    stacks the wrapper holds (an encoder graph holds no decoder layer); a wrapper that runs a stack's layers through
    modules of its own names them in ``layer_stacks`` (``exporter/capture/wrappers.py``'s cross K/V graph)."""
    own = getattr(module, "layer_stacks", {})
    paths = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    scopes = {}
    for stack in template.stacks:
        if stack in own:
            scopes[stack] = own[stack]
            continue
        found = paths.get(id(template.model.get_submodule(f"{stack}.0")))
        if found is not None and found.endswith(".0"):
            scopes[stack] = found[: -len(".0")]
    return scopes


def _check_every_layer_read(model: onnx.ModelProto, bindings: dict, template) -> None:
    """A graph that reads a weight of some layer of a stack reads weights of every layer of it (a stack the
    stitcher did not see would otherwise stay at the template's layers)."""
    used = {t.name for t in model.graph.initializer}
    for stack, (_, layers) in template.stacks.items():
        prefix = f"{stack}."
        read = {int(b.source[len(prefix):].split(".", 1)[0]) for name, b in bindings.items()
                if name in used and b.source.startswith(prefix)}
        if read and read != set(range(layers)):
            missing = sorted(set(range(layers)) - read)
            raise NotStitchable(f"the stitched graph reads {stack} but not its layers {missing[:5]}")


def _refuse_unbound_layer_constants(model: onnx.ModelProto, scopes: dict, bindings: dict) -> None:
    """A float initializer of several values that a layer node reads and that no weight explains may be a weight
    folded into a form the binding does not know (Gemma's ``1 + w``): its values would be the template's."""
    from elx.exporter.capture.stitch import layer_of

    index = {f"{scope}.{k}": (scope, k) for scope in scopes.values() for k in range(TEMPLATE_LAYERS)}
    floats = {t.name: t for t in model.graph.initializer if t.data_type in (onnx.TensorProto.FLOAT,
                                                                           onnx.TensorProto.DOUBLE)}
    for node in model.graph.node:
        if layer_of(node, index) is None:
            continue
        for name in node.input:
            tensor = floats.get(name)
            if tensor is not None and name not in bindings:
                size = 1
                for d in tensor.dims:
                    size *= d
                if size > 1:
                    raise NotStitchable(f"layer node {node.name} reads constant {name} {list(tensor.dims)}, "
                                        "which no weight explains")
