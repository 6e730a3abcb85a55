"""Export by template and stitch (exporter/capture, issue 41): a deep model's graphs are a 3-layer template's,
its last layer copied once per missing layer and bound to that layer's weights.

The stitched graph must be the graph a whole-model trace gives (node for node, up to which input a Shape node
reads a symbolic size from) and compute the same numbers bit for bit; the passes must find their patterns in it
(each verifies itself); the parts (binding, renaming, the second process, the memory estimate) are checked
alone.  No timing is asserted.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from tests.conftest import LONG, make_model_folder

LAYERS = 5


@pytest.fixture(autouse=True)
def _traced_here(monkeypatch):
    """The template and whole-graph cache off: these tests run the trace (here or in a second process)."""
    monkeypatch.setenv("ELX_TEMPLATE_CACHE", "0")


# -- a canonical form of a graph ---------------------------------------------------------------------------------
def _digest(*parts) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
    return h.digest()


def _attribute(a):
    value = helper.get_attribute_value(a)
    if isinstance(value, TensorProto):
        value = numpy_helper.to_array(value).tobytes()
    return a.name, a.type, value


def signature(path: Path) -> tuple[Counter, list]:
    """Each node as a digest of its operator, attributes and inputs' digests (initializers by value, graph inputs by
    name; a Shape node of a graph input by that input's declared type: the tracer reads a symbolic size from
    whichever input carries it), as a multiset; and the graph outputs' names and digests in order."""
    graph = onnx.load(str(path)).graph
    values = {t.name: _digest("init", t.data_type, list(t.dims), numpy_helper.to_array(t).tobytes())
              for t in graph.initializer}
    values.update({i.name: _digest("input", i.name) for i in graph.input})
    types = {i.name: _digest("type", i.type.SerializeToString()) for i in graph.input}
    nodes = Counter()
    for node in graph.node:
        inputs = [types[x] if node.op_type == "Shape" and x in types else values.get(x, b"?" + x.encode())
                  if x else b"" for x in node.input]
        digest = _digest(node.op_type, node.domain, sorted(_attribute(a) for a in node.attribute), inputs)
        nodes[digest] += 1
        for o, out in enumerate(node.output):
            values[out] = _digest(digest, o)
    return nodes, [(o.name, values.get(o.name)) for o in graph.output]


def _feeds(session, rng) -> dict:
    sizes = {"batch": 2, "rows": 6, "prompt_sequence": 5, "past_sequence": 3, "encoder_sequence": 6,
             "decoder_sequence": 2}
    feeds = {}
    for spec in session.get_inputs():
        shape = [d if isinstance(d, int) else sizes.get(d, 3) for d in spec.shape]
        if "int64" in spec.type:
            feeds[spec.name] = (np.ones(shape, np.int64) if "mask" in spec.name
                                else rng.integers(3, 60, shape).astype(np.int64))
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _same_outputs(a: Path, b: Path) -> bool:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 1, 3
    first, second = ort.InferenceSession(str(a), options), ort.InferenceSession(str(b), options)
    feeds = _feeds(first, np.random.default_rng(0))
    return all(np.array_equal(x, y) for x, y in zip(first.run(None, feeds), second.run(None, feeds)))


# -- the stitched Llama ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama5(tmp_path_factory):
    """A tiny 5-layer Llama (GQA, Llama 3 RoPE) exported by template and stitch (``ELX_CAPTURE=stitch``: a refusal
    would fail the export), its templates traced (``ELX_TEMPLATE_BUILDER=0``: these tests are about the trace and its
    second process; ``tests/test_llama_builder.py`` exports on built ones), with the progress lines it printed."""
    import io

    from elx.exporter.export import export_model

    root = tmp_path_factory.mktemp("capture")
    folder = make_model_folder(root, "llama", num_hidden_layers=LAYERS)
    stream = io.StringIO()
    before = os.environ.get("ELX_CAPTURE")
    os.environ["ELX_CAPTURE"] = "stitch"
    builder = os.environ.get("ELX_TEMPLATE_BUILDER")
    os.environ["ELX_TEMPLATE_BUILDER"] = "0"
    try:
        from contextlib import redirect_stderr

        import elx.exporter.export as export_module

        # the reference on one thread, as the test that exports it again has it: PyTorch's batched reference forwards
        # round by the thread count (``verify.DecoderOnlyTorchSide.run_together``)
        with redirect_stderr(stream), pytest.MonkeyPatch.context() as patch:
            patch.setattr(export_module, "idle_cores", lambda: 1.0)
            out = export_model(str(folder), root / "stitched", progress="plain")
    finally:
        os.environ.pop("ELX_CAPTURE") if before is None else os.environ.__setitem__("ELX_CAPTURE", before)
        os.environ.pop("ELX_TEMPLATE_BUILDER") if builder is None else os.environ.__setitem__("ELX_TEMPLATE_BUILDER",
                                                                                               builder)
    return {"model": folder, "export": out, "log": stream.getvalue(), "root": root}


def test_stitched_export_is_recorded_and_stores_each_weight_once(llama5):
    manifest = Manifest.load(llama5["export"])
    for graph in ("prefill", "decoder"):
        record = manifest.data["graphs"][graph]["capture"]
        assert record["method"] == "stitched" and record["template_layers"] == 3
    weights = manifest.data["weights"]
    assert weights["file"] == "weights.data" and weights["tensors"] > weights["distinct_tensors"]  # prefill and step
    assert manifest.data["verification"]["export"]["within"]
    log = llama5["log"]
    assert "decoder.onnx: tracing its 3-layer template in a second process" in log or "ELX_CAPTURE_PARALLEL" in log \
        or "decoder.onnx: traced a 3-layer template" in log
    assert "prefill.onnx: stitched layer 4 (2/2 copies" in log  # the per-layer progress lines
    for side in ("PyTorch fp32", "PyTorch fp64", "graphs"):
        assert f"elx export: verify: {side}, 5 cases in " in log


def test_stitched_graphs_are_the_traced_graphs_bit_for_bit(llama5, tmp_path):
    """Node for node the whole-model trace, and the same outputs bit for bit on ONNX Runtime."""
    from elx.exporter.capture.decoder_only import _prefill_spec, _step_spec
    from elx.exporter.capture.onnx_export import save_model, trace
    from elx.exporter.source.load import resolve_model

    import elx.exporter.capture.parallel as parallel

    loaded = resolve_model(str(llama5["model"]))
    specs = {"prefill.onnx": lambda: _prefill_spec(loaded.model, loaded.family),
             "decoder.onnx": lambda: _step_spec(loaded.model, loaded.family, "shared")[0]}
    # the step graph traced whole by a second process (as an export's template is) while this one traces the prefill
    child = (parallel.TemplateProcess.start(lambda: trace(specs["decoder.onnx"]()), tmp_path / ".whole.decoder.onnx")
             if parallel.parallel_allowed() else None)
    for name, make in specs.items():
        traced, why = child.result() if child is not None and name == "decoder.onnx" else (trace(make()), "")
        assert traced is not None, why
        save_model(traced, tmp_path / name)
        stitched = llama5["export"] / name
        assert signature(stitched) == signature(tmp_path / name), name
        assert _same_outputs(stitched, tmp_path / name), name
        # no Python stack per node (onnx_export._without_stack_traces: with FX's default, 335 of 337 nodes carried
        # one; a handful of nodes torch makes after the trace still do); the nodes still name their modules
        kept = Counter(p.key for node in traced.graph.node for p in node.metadata_props if p.value)
        assert kept["pkg.torch.onnx.name_scopes"] >= len(traced.graph.node) - 2, kept
        assert kept["pkg.torch.onnx.stack_trace"] < len(traced.graph.node) // 10, kept


def test_unpad_finds_its_pattern_in_a_stitched_export(llama5):
    """The pass that applies to a GQA Llama rewrites the stitched prefill and verifies itself against it
    (``test_other_families_stitch_to_the_traced_graph`` runs slim, el-self and el on stitched exports)."""
    from elx.exporter.export import apply_passes

    out = apply_passes(llama5["export"], llama5["root"] / "stitched-unpad", "unpad")
    assert Manifest.load(out).data["passes"][-1]["name"] == "unpad"


# -- the parts alone -----------------------------------------------------------------------------------------------
def test_relayer_renames_one_dotted_layer_index():
    from elx.exporter.capture.stitch import relayer

    assert relayer("present.2.key", 2, 7) == "present.7.key"
    assert relayer("past_key_values.2.decoder.value", 2, 11) == "past_key_values.11.decoder.value"
    assert relayer("model.layers.2.mlp.up_proj.weight", 2, 3) == "model.layers.3.mlp.up_proj.weight"
    assert relayer("present.12.key", 2, 7) is None and relayer("attention_mask", 2, 7) is None
    assert relayer("h.2.attn.2.x", 2, 3) is None  # two candidates: ambiguous


def test_bind_finds_weights_as_they_are_transposed_or_shifted_and_nothing_else():
    from elx.exporter.capture.weights import IDENTITY, SHIFT, TRANSPOSE, Binding, bind

    rng = np.random.default_rng(0)
    w, norm, other = (rng.standard_normal(s).astype(np.float32) for s in ((6, 4), (4,), (6, 4)))
    initializers = [numpy_helper.from_array(w.T.copy(), "a"), numpy_helper.from_array(norm, "b"),
                    numpy_helper.from_array(norm + np.float32(1.0), "c"),  # Gemma's folded 1 + w
                    numpy_helper.from_array(w * 2, "d"), numpy_helper.from_array(np.array([2.0], np.float32), "e"),
                    numpy_helper.from_array(np.arange(4, dtype=np.int64), "f")]
    found = bind(initializers, {"layers.0.w": w, "layers.0.norm": norm, "layers.1.w": other})
    assert found == {"a": Binding("layers.0.w", TRANSPOSE), "b": Binding("layers.0.norm", IDENTITY),
                     "c": Binding("layers.0.norm", SHIFT, 1.0)}
    assert np.array_equal(found["c"].apply(norm), norm + np.float32(1.0))


def test_layers_of_several_types_are_traced_whole():
    from transformers import Qwen2Config

    from elx.exporter.capture.stitch import NotStitchable
    from elx.exporter.capture.template import template_config

    config = Qwen2Config(num_hidden_layers=6, use_sliding_window=True, max_window_layers=4, sliding_window=64,
                         hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert len(set(config.layer_types)) == 2
    with pytest.raises(NotStitchable, match="several types"):
        template_config(config)
    uniform = template_config(Qwen2Config(num_hidden_layers=6, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, num_key_value_heads=2))
    assert uniform.num_hidden_layers == 3 and len(uniform.layer_types) == 3


def _tiny_graph() -> onnx.ModelProto:
    node = helper.make_node("Add", ["x", "w"], ["y"])
    w = numpy_helper.from_array(np.arange(400, dtype=np.float32), "w")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [400])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [400])], [w])
    return helper.make_model(graph)


def test_second_process_returns_its_template_or_why_not(tmp_path, monkeypatch):
    """A forked child's graph comes back whole; a failing child's error, a hung child killed: the export then traces
    the template itself.  No file is left behind."""
    import elx.exporter.capture.parallel as parallel

    child = parallel.TemplateProcess.start(_tiny_graph, tmp_path / ".template.a.onnx")
    model, why = child.result()
    assert why == "" and np.array_equal(numpy_helper.to_array(model.graph.initializer[0]), np.arange(400))

    def broken():
        raise RuntimeError("no template")

    model, why = parallel.TemplateProcess.start(broken, tmp_path / ".template.b.onnx").result()
    assert model is None and why == "RuntimeError: no template"

    monkeypatch.setattr(parallel, "STALL_SECONDS", 1.0)
    model, why = parallel.TemplateProcess.start(lambda: time.sleep(600), tmp_path / ".template.c.onnx").result()
    assert model is None and "no progress" in why
    assert list(tmp_path.iterdir()) == []


def test_the_child_never_tears_down_the_parents_garbage(tmp_path, monkeypatch):
    """Unreachable objects the parent had not collected yet are the child's too; its garbage collector must not
    destroy them.  An ONNX Runtime session that has run, in a reference cycle: its destructor in the child waits
    forever on thread-pool state whose threads were not forked (found in the suite: after a test that left such
    sessions behind, every export's second process hung until ``STALL_SECONDS`` and the export traced again)."""
    import gc

    import onnxruntime as ort

    import elx.exporter.capture.parallel as parallel

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    for _ in range(3):
        session = ort.InferenceSession(_tiny_graph().SerializeToString(), options, providers=["CPUExecutionProvider"])
        session.run(None, {"x": np.ones(400, np.float32)})
        cycle = [session]
        cycle.append(cycle)  # garbage only the cyclic collector frees
    del session, cycle
    gc.disable()  # the cycles stay garbage until the child's own collection
    try:
        def collecting():
            gc.enable()
            gc.collect()
            return _tiny_graph()

        monkeypatch.setattr(parallel, "STALL_SECONDS", 10.0)
        model, why = parallel.TemplateProcess.start(collecting, tmp_path / ".template.g.onnx").result()
    finally:
        gc.enable()
    assert why == "" and model is not None


@pytest.mark.skipif(not __import__("elx.exporter.capture.parallel", fromlist=["x"]).parallel_allowed(),
                    reason="one core, or no fork")
def test_a_small_model_traced_whole_has_its_step_graph_traced_by_the_second_process(tmp_path, monkeypatch):
    """A model traced whole (here 2 layers, builders off): the second process traces its decoder.onnx whole while
    this one goes on; the graph is the one this process traces, byte for byte, and the child's files are gone.  With
    the builders on (the default) the same model's graph is built whole from its weights instead, traces nothing, and
    gives the traced graph's outputs bit for bit."""
    import torch

    from elx.exporter.capture.onnx_export import decoder_spec, save_model, trace
    from elx.exporter.capture.stitched import Capture
    from elx.exporter.families.catalog import family_for_architecture
    from tests.conftest import BUILDERS

    torch.manual_seed(0)
    model = BUILDERS["t5"]().eval()
    family = family_for_architecture(type(model).__name__)

    def make_spec(m):
        return decoder_spec(m, family)[0]

    for run in ("parallel", "here", "built"):
        (tmp_path / run).mkdir()
    monkeypatch.setenv("ELX_TEMPLATE_BUILDER", "0")
    lines = []
    capture = Capture(model, family, tmp_path / "parallel", report=lines.append)
    try:
        capture.prefetch(make_spec, tmp_path / "parallel" / "decoder.onnx")
        assert "decoder.onnx: tracing it in a second process" in lines
        save_model(trace(make_spec(model)), tmp_path / "here" / "decoder.onnx")  # meanwhile, here
        capture.export(make_spec, tmp_path / "parallel" / "decoder.onnx")
    finally:
        capture.close()
    assert capture.records["decoder.onnx"]["traced_in_parallel"] is True
    assert any("(in a second process)" in line for line in lines), lines
    files = {run: {p.name: p.read_bytes() for p in (tmp_path / run).iterdir()} for run in ("parallel", "here")}
    assert files["parallel"] == files["here"] and "decoder.onnx" in files["here"]

    monkeypatch.setenv("ELX_TEMPLATE_BUILDER", "1")
    lines = []
    capture = Capture(model, family, tmp_path / "built", report=lines.append)
    try:
        capture.prefetch(make_spec, tmp_path / "built" / "decoder.onnx")  # nothing to trace: no second process
        capture.export(make_spec, tmp_path / "built" / "decoder.onnx")
    finally:
        capture.close()
    assert capture.records["decoder.onnx"]["method"] == "built", capture.records
    assert not any("second process" in line or "traced" in line for line in lines), lines
    assert _same_outputs(tmp_path / "built" / "decoder.onnx", tmp_path / "here" / "decoder.onnx")

def test_a_failing_wait_job_stops_the_second_process(tmp_path):
    """``Capture.while_waiting`` runs once where the export would wait for the template; if it fails, the child is
    killed and its files removed (the export then fails with the job's own error)."""
    import elx.exporter.capture.parallel as parallel
    from elx.exporter.capture.stitched import Capture

    capture = Capture(None, None, tmp_path, mode="auto")
    child = parallel.TemplateProcess.start(lambda: time.sleep(600), tmp_path / ".template.d.onnx")
    capture._children["d.onnx"] = child
    ran = []

    def job(still_tracing):
        ran.append(still_tracing())
        raise ElxError("the job failed")

    capture.while_waiting = job
    with pytest.raises(ElxError, match="the job failed"):
        capture._traced_template(None, "d.onnx")
    assert ran == [True] and child.done and capture.while_waiting is None
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # reaped: no zombie, no process
    assert list(tmp_path.iterdir()) == []


def test_the_reference_computed_while_the_template_traces_is_the_later_one(llama5, tmp_path, monkeypatch):
    """The export runs PyTorch's fp32 and fp64 reference while the second process traces the step's template, from
    the manifest as described before that graph exists; the numbers must be those of the reference computed after
    the graphs (no second process).  Whichever way the fixture's export went (it depends on timing), this export
    goes the other way."""
    import io
    from contextlib import redirect_stderr

    import elx.exporter.capture.parallel as parallel
    from elx.exporter.export import export_model

    import elx.exporter.export as export_module

    marker = "(while the step graph traces in a second process)"
    fixture_early = marker in llama5["log"]
    monkeypatch.setattr(export_module, "idle_cores", lambda: 1.0)  # this export's reference on one thread
    monkeypatch.setenv("ELX_CAPTURE", "stitch")
    monkeypatch.setenv("ELX_TEMPLATE_BUILDER", "0")  # traced, as the fixture's
    if fixture_early:
        monkeypatch.setenv("ELX_CAPTURE_PARALLEL", "0")
    else:  # the first question (Capture's) answered "still at work" whatever the truth: the job runs
        asked, real = [], parallel.TemplateProcess.running

        def running(self):
            if not asked:
                asked.append(real(self))
                return True
            return real(self)
        monkeypatch.setattr(parallel.TemplateProcess, "running", running)
    stream = io.StringIO()
    with redirect_stderr(stream):
        out = export_model(str(llama5["model"]), tmp_path / "other", progress="plain")
    assert (marker in stream.getvalue()) != fixture_early, stream.getvalue()
    ours, theirs = (Manifest.load(f).data["verification"] for f in (out, llama5["export"]))
    assert ours["export"]["max_abs_logits_diff"] > 0  # compared, not skipped
    assert ours["export"] == theirs["export"] and ours["tolerance"] == theirs["tolerance"]


def test_a_killed_export_leaves_no_folder_and_no_process(tmp_path):
    """SIGKILL while the second process traces: it dies with the export, and no output folder appears."""
    folder = make_model_folder(tmp_path, "llama", num_hidden_layers=LAYERS)
    out = tmp_path / "out"
    env = {**os.environ, "ELX_CAPTURE": "stitch", "ELX_TEMPLATE_BUILDER": "0"}  # a template traced by a second process
    proc = subprocess.Popen([sys.executable, "-m", "elx.cli", "export", "--model", str(folder), "--output", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    children = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not children:
        try:
            children = [int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        except OSError:
            children = []
        time.sleep(0.1)
    if not children:
        proc.kill()
        pytest.skip(f"no second process seen (export ended with {proc.poll()})")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for _ in range(100):
        if not any(Path(f"/proc/{c}").exists() and "zombie" not in _state(c) for c in children):
            break
        time.sleep(0.1)
    assert not any(Path(f"/proc/{c}").exists() and "zombie" not in _state(c) for c in children)
    assert not out.exists()


@pytest.mark.parametrize("at_write", [1, 3])
def test_a_weight_write_failing_in_its_thread_is_one_line_and_leaves_no_folder(llama5, tmp_path, capsys, monkeypatch,
                                                                              at_write):
    """``weights.data`` is written by a thread while the export goes on (``exporter/capture/weights_writer.py``): a
    write failing there (the disk full at the first or a later write) ends the export with one line, exit 2, no
    folder, no thread left writing."""
    import errno
    import threading

    from elx.cli import main
    from elx.exporter.capture import weights_writer

    calls = []

    def full(self, data, offset):
        calls.append(offset)
        if len(calls) >= at_write:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "out" / "weights.data"))
        os.pwrite(self.fd, data, offset)

    monkeypatch.setattr(weights_writer.BackgroundWriter, "_pwrite", full)
    monkeypatch.setenv("ELX_CAPTURE", "stitch")
    code = main(["export", "--model", str(llama5["model"]), "--output", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("elx: error:")]
    assert code == 2 and len(lines) == 1 and "no space left" in lines[0] and "Traceback" not in err, err
    assert len(calls) == at_write  # the thread stopped at the failed write
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert not [t for t in threading.enumerate() if t.name == "elx-weights-writer"]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


def test_a_model_too_large_is_refused_before_its_weights_are_read(tmp_path, monkeypatch):
    """The estimate (float32 weights counted from the config, copies at the peak, elx itself) against the memory
    available, in one line; nothing is written."""
    import elx.runners.inputs.validation as validation
    from elx.exporter.export import export_model
    from elx.exporter.memory import FP32_COPIES, PROCESS_BYTES, check_export_memory
    from elx.exporter.source.locate import locate_model

    estimate = check_export_memory(locate_model("smollm2-135m", random_init=True), available=10**12)
    assert estimate["float32_weight_bytes"] == 4 * 134_515_008  # SmolLM2-135M: tied head counted once
    assert estimate["needed_bytes"] == FP32_COPIES * 4 * 134_515_008 + PROCESS_BYTES
    monkeypatch.setattr(validation, "available_memory", lambda: 500_000_000)
    with pytest.raises(ElxError, match=r"needs about 1\.91 GB of memory \(2 copies of its 538 MB of float32 weights.*"
                                       r"500 MB is available"):
        export_model("smollm2-135m", tmp_path / "out", random_init=True, quiet=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not LONG, reason="CI stitches Llama (tests above); set ELX_LONG_TESTS=1 for the other families")
@pytest.mark.parametrize("family, passes", [("gpt2", "el-self"), ("opt", None), ("qwen2", "slim=skip-bad"),
                                            ("t5", "el"), ("bart", "slim-cross=skip-bad")])
def test_other_families_stitch_to_the_traced_graph(family, passes, tmp_path, monkeypatch):
    """Each family's stitched export is its traced export node for node and bit for bit, and a pass that applies
    to it rewrites and verifies it."""
    from elx.exporter.export import apply_passes, export_model

    layers = {"gpt2": dict(n_layer=LAYERS), "opt": dict(num_hidden_layers=LAYERS),
              "qwen2": dict(num_hidden_layers=LAYERS), "t5": dict(num_layers=LAYERS, num_decoder_layers=LAYERS),
              "bart": dict(encoder_layers=LAYERS, decoder_layers=LAYERS)}[family]
    folder = make_model_folder(tmp_path, family, **layers)
    outs = {}
    for mode in ("stitch", "trace"):
        monkeypatch.setenv("ELX_CAPTURE", mode)
        outs[mode] = export_model(str(folder), tmp_path / mode, quiet=True)
    manifest = Manifest.load(outs["stitch"])
    assert any(g.get("capture", {}).get("method") == "stitched" for g in manifest.data["graphs"].values())
    for spec in manifest.data["graphs"].values():
        assert signature(outs["stitch"] / spec["file"]) == signature(outs["trace"] / spec["file"])
        assert _same_outputs(outs["stitch"] / spec["file"], outs["trace"] / spec["file"])
    if passes is not None:
        out = apply_passes(outs["stitch"], tmp_path / "passes", passes)
        assert Manifest.load(out).data["passes"][-1]["name"] == passes.split("=")[0]


def test_the_collector_skips_what_exists_inside_the_block_and_takes_it_back_after():
    """``collector_skips_existing_objects`` (an export's whole run): objects made before it are frozen (a full
    collection walks only what the export made), garbage made inside is still collected, and after it every object
    is the collector's again; inside a block that froze already (the traces' child) it does nothing."""
    import gc
    import weakref

    from elx.exporter.memory import collector_skips_existing_objects

    class Node:
        pass

    assert gc.get_freeze_count() == 0
    with collector_skips_existing_objects():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with collector_skips_existing_objects():
            assert gc.get_freeze_count() == frozen  # nested: nothing more
        cycle = Node()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None  # made inside: collected
    assert gc.get_freeze_count() == 0
