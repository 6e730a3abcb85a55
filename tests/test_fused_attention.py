"""``--pass fused-attention``: the step graph's attention as ONNX Runtime's GroupQueryAttention kernel.

Applied to conftest's per-beam exports (no new trace): Qwen2 (MHA, q/k/v biases) in CI, and a GQA Llama
(4 query heads over 2 key/value heads) exported per-beam here.  Held to: one kernel per layer, the
verification recorded within the fp32 tolerance, generation token-identical to HF ``generate`` (greedy and
beam search on a left-padded batch), a deliberately wrong kernel refused, and every combination it cannot
take refused in one line (the command line's refusals, before any heavy import: ``tests/test_fast_refusals.py``).
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elx.exporter.verification.compare import compare
from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from tests.conftest import make_model_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def fused(qwen2_exports, tmp_path_factory):
    from elx.exporter.export import apply_passes

    out = tmp_path_factory.mktemp("fused") / "qwen2"
    return apply_passes(qwen2_exports["per-beam"], out, "fused-attention", quiet=True)


@pytest.fixture(scope="module")
def llama16(tmp_path_factory):
    """A GQA Llama (4 query heads, 2 key/value heads of 16: RoPE goes into the kernel too; conftest's heads of 8 keep
    it traced, as Qwen2's above), exported per-beam."""
    from elx.exporter.export import export_model

    root = tmp_path_factory.mktemp("llama16")
    folder = make_model_folder(root / "models", "llama", head_dim=16)
    return export_model(str(folder), root / "per-beam", quiet=True, prompt_cache="per-beam")


@pytest.fixture(scope="module")
def llama_fused(llama16, tmp_path_factory):
    from elx.exporter.export import apply_passes

    return apply_passes(llama16, tmp_path_factory.mktemp("fused") / "llama", "fused-attention", quiet=True)


def _ops(folder):
    manifest = Manifest.load(folder)
    model = onnx.load(str(manifest.graph_path(manifest.step)), load_external_data=False)
    return manifest, [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("which", ["fused", "llama_fused"])
def test_one_kernel_per_layer_and_the_verification_recorded(which, request):
    manifest, ops = _ops(request.getfixturevalue(which))
    layers = manifest.dims["num_decoder_layers"]
    assert ops.count("GroupQueryAttention") == layers
    assert "Softmax" not in ops  # every attention core went into the kernel
    rotary = which == "llama_fused"  # heads of 16 and Llama 3's (static) scaling; Qwen2's heads of 8: RoPE as traced
    assert ("Neg" in ops) is not rotary
    record = next(p for p in manifest.data["passes"] if p["name"] == "fused-attention")
    assert record["layers"] == layers and record["op"] == "com.microsoft.GroupQueryAttention"
    assert (record["num_heads"], record["kv_num_heads"]) == (manifest.dims["num_heads"], manifest.dims["num_kv_heads"])
    assert record["step_nodes"]["after"] < record["step_nodes"]["before"]
    assert record["rotary_positions"] == (128 if rotary else None) and manifest.dims["max_position_embeddings"] == 128
    # q, k and v as one projection where the kernel reads them unrotated (RoPE in the kernel); rotated, three
    assert record["packed_qkv"] == (layers if rotary else 0)
    _, traced = _ops(request.getfixturevalue("llama16") if rotary else request.getfixturevalue("qwen2_exports")["per-beam"])
    assert ops.count("MatMul") == traced.count("MatMul") - 2 * layers - (2 * layers if rotary else 0)
    assert 0 < record["max_abs_logits_diff"] <= record["tolerance"]
    prefill = onnx.load(str(manifest.graph_path("prefill")), load_external_data=False)
    assert "GroupQueryAttention" not in {n.op_type for n in prefill.graph.node}  # the prompt's graph as traced


@pytest.mark.parametrize("which", ["fused", "llama_fused"])
@pytest.mark.parametrize("options", [dict(max_new_tokens=12),
                                     dict(num_beams=3, num_return_sequences=2, max_new_tokens=10)])
def test_generation_is_hf_generate(which, options, request):
    """A left-padded batch (rows of different lengths): the kernel's bias must mask the padding as the graph did."""
    report = compare(request.getfixturevalue(which), batch_size=3, input_length=9, seed=4, **options)
    assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]
    assert report.max_logits_diff <= report.atol


def _steps(folder, in_place: bool, tokens=(11, 12, 13)):
    """The prompt's step and one step per token of ``tokens`` on a left-padded batch of 2, the caches in place or
    not: (each step's scores, the caches after each step)."""
    from elx.runners.generate import Generator

    model = Generator.from_folder(folder).model
    model.backend.in_place_cache = in_place
    ids = np.array([[0, 5, 6, 7], [4, 5, 6, 7]], dtype=np.int64)
    state = model.encode({"input_ids": ids, "attention_mask": np.array([[0, 1, 1, 1], [1, 1, 1, 1]])})
    scores, cache = model.step(ids, state, model.empty_cache(2))
    steps = [(scores, cache)]
    for token in tokens:
        scores, cache = model.step(np.full((2, 1), token, dtype=np.int64), state, cache)
        steps.append((scores, {k: np.array(v) for k, v in cache.arrays.items()}, cache))
    return model, state, steps


@pytest.mark.parametrize("which", ["fused", "llama_fused"])
def test_the_cache_runs_in_place_bit_for_bit(which, request):
    """The rewritten graph reads the past length from the mask only, so each past input and its present are bound to
    one buffer and the kernel appends there (no copy of the whole cache each step): the same scores and caches, bit
    for bit, as the plain run; one buffer kept across steps; a cache stepped from twice keeps its own positions."""
    from elx.runners.model import CacheBuffer

    folder = request.getfixturevalue(which)
    manifest = Manifest.load(folder)
    assert all(entry["in_place"] for entry in manifest.cache_entries)
    assert next(p for p in manifest.passes if p["name"] == "fused-attention")["in_place_cache"] is True
    graph = onnx.load(str(manifest.graph_path(manifest.step)), load_external_data=False).graph
    pasts = {entry["input"] for entry in manifest.cache_entries}
    assert {n.op_type for n in graph.node if set(n.input) & pasts} == {"GroupQueryAttention"}
    model, state, ours = _steps(folder, True)
    _, _, plain = _steps(folder, False)
    for (a, *_), (b, *_) in zip(ours, plain):
        assert np.array_equal(a, b)
    for (_, a, _), (_, b, _) in zip(ours[1:], plain[1:]):
        assert all(np.array_equal(a[k], b[k]) for k in b)
    bases = [{id(v.base) for v in step[2].arrays.values()} for step in ours[1:]]
    assert all(isinstance(v.base, CacheBuffer) for v in ours[-1][2].arrays.values())
    assert bases[1] == bases[2]  # the same buffers from the second step on (the first re-homes the prompt's cache)
    # stepping again from the second step's cache (a branch): the third step's cache must keep its positions
    before = {k: np.array(v) for k, v in ours[-1][2].arrays.items()}
    again, _ = model.step(np.full((2, 1), 99, dtype=np.int64), state, ours[2][2])
    assert all(np.array_equal(before[k], v) for k, v in ours[-1][2].arrays.items())
    assert not np.array_equal(again, ours[3][0])


def test_the_memory_bound_holds_the_buffers(fused):
    """The memory check's bound on the cache (``self_cache_bound``: 2.5x for entries in place) holds the buffers the
    search keeps (each counted whole, its room too), measured at every step of a beam search."""
    from elx.runners.generate import Generator
    from elx.runners.inputs.validation import self_cache_bound

    generator = Generator.from_folder(fused)
    rows = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
    out = generator.generate(input_ids=rows, num_beams=4, max_new_tokens=40, min_new_tokens=40, track_memory=True)
    prompt = out.raw_sequences.shape[1] - 40
    bound = self_cache_bound(generator.manifest, 2, 4, prompt, prompt + 40)
    live = max(step["cache_bytes"] for step in out.memory)
    plain = 8 * (prompt + 40) * sum(int(np.prod([d for i, d in enumerate(e["shape"]) if i not in (0, e["seq_axis"])]))
                                    * 4 for e in generator.manifest.cache_entries)
    assert plain < live <= bound  # the room is counted (more than the cache alone) and within the bound


def test_nothing_of_a_run_stays_bound_after_generate(fused):
    """The backend binds each cache buffer to its graph for the steps of a run; once ``generate`` returns (or
    fails), none of them is alive: a beam search's caches were held until the next run (the int8 export's recorded
    agreement peaked there, beside HF's model)."""
    import gc
    import weakref

    from elx.runners.generate import Generator
    from elx.runners.model import CacheBuffer

    generator = Generator.from_folder(fused)
    seen = []
    run_in_place = generator.model.backend.run_in_place

    def spy(graph, feeds, outputs, in_place):
        seen.extend(weakref.ref(feeds[name]) for name in in_place.values() if isinstance(feeds[name], CacheBuffer))
        if len(seen) > 40:
            raise RuntimeError("a failing step")
        return run_in_place(graph, feeds, outputs, in_place)

    def alive():
        gc.collect()
        return sum(ref() is not None for ref in seen)

    generator.model.backend.run_in_place = spy
    generator.generate(input_ids=[[5, 6, 7, 8, 9]], num_beams=4, max_new_tokens=3)
    assert seen and alive() == 0  # the run bound buffers, and none is left
    seen.clear()
    with pytest.raises(RuntimeError, match="a failing step"):
        generator.generate(input_ids=[[5, 6, 7, 8, 9]], num_beams=4, max_new_tokens=30, min_new_tokens=30)
    assert alive() == 0


def test_one_resident_session_gives_the_same_tokens_and_holds_one_session(fused):
    """``OrtBackend(one_session=True)`` (the int8 export's recorded agreement, beside HF's model: each session holds
    its own packed weights) loads a graph's session when it runs and drops the other first: greedy and beam
    searches give the tokens and scores of the usual backend, and no dropped session stays alive (not through a
    kept binding either)."""
    import gc
    import weakref

    from elx.runners.backends.ort import OneResident, OrtBackend
    from elx.runners.generate import Generator, Model

    manifest = Manifest.load(fused)
    usual = Generator(Model(manifest, OrtBackend(manifest)))
    lean = Generator(Model(manifest, OrtBackend(manifest, one_session=True)))
    sessions = lean.model.backend.sessions
    assert isinstance(sessions, OneResident) and sessions.resident == manifest.step  # the last loaded at start
    loaded, alive_at_load = [], []
    load = sessions._load

    def spy(name):
        gc.collect()
        alive_at_load.append(sum(ref() is not None for _, ref in loaded))  # the one it replaces: gone already
        session = load(name)
        loaded.append((name, weakref.ref(session)))
        return session

    sessions._load = spy
    lean.model.backend.release_run = lambda: None  # bindings kept between runs: switching must drop them itself
    for options in (dict(max_new_tokens=6), dict(num_beams=3, num_return_sequences=2, max_new_tokens=5)):
        a = usual.generate(input_ids=[[5, 6, 7, 8, 9], [3, 4, 5, 6, 7]], decode=False, output_scores=True, **options)
        b = lean.generate(input_ids=[[5, 6, 7, 8, 9], [3, 4, 5, 6, 7]], decode=False, output_scores=True, **options)
        np.testing.assert_array_equal(a.sequences, b.sequences)
        if a.sequences_scores is not None:
            np.testing.assert_array_equal(a.sequences_scores, b.sequences_scores)
    gc.collect()
    assert [name for name, _ in loaded] == [manifest.stages[0], manifest.step] * 2  # a prefill, then its steps
    assert alive_at_load == [0, 0, 0, 0]
    assert sum(ref() is not None for _, ref in loaded) == 1 and loaded[-1][1]() is sessions[manifest.step]


def test_int8_quantizes_the_packed_projections_by_layer(llama_fused, llama16, tmp_path):
    """int8 after the pass: its packed q/k/v weight (a Concat of the three) is folded and quantized like any weight
    MatMul, and each MatMul keeps its layer through the rewrite (the per-layer rule tells layers by the exporter's
    node metadata, which onnx-graphsurgeon drops: ``exporter/passes/rewrite.py`` keeps it)."""
    from elx.exporter.precision.int8 import convert_folder
    from elx.exporter.precision.int8_layers import measured_layers

    fused, traced = Manifest.load(llama_fused), Manifest.load(llama16)
    assert measured_layers(fused) == measured_layers(traced) and len(measured_layers(fused)) > 2
    graph = onnx.load(str(fused.graph_path(fused.step)), load_external_data=False).graph
    scopes = {n.name: next((p.value for p in n.metadata_props if p.key == "namespace"), "") for n in graph.node
              if n.op_type == "MatMul"}
    assert all(scopes.values()), scopes  # each its module path (the exporter's), through the rewrite
    assert all("q_proj" in scope for name, scope in scopes.items() if "qkv" in name)  # packed: the q projection's
    layers = fused.dims["num_decoder_layers"]
    ops = {}
    for name, manifest in (("fused", fused), ("traced", traced)):
        converted = convert_folder(manifest, tmp_path / name)
        ops[name] = [n.op_type for n in onnx.load(str(converted.graph_path(converted.step))).graph.node]
    assert ops["fused"].count("MatMul") == ops["traced"].count("MatMul") - 2 * layers  # q·Kᵀ and p·V: in the kernel
    assert ops["fused"].count("MatMulNBits") == ops["traced"].count("MatMulNBits") - 2 * layers  # q, k, v: one


@pytest.mark.parametrize("wrong", ["scale", "rotary"])
def test_a_wrong_kernel_is_refused(wrong, qwen2_exports, tmp_path, monkeypatch, request):
    """The verification is what accepts the rewrite: the kernel given a wrong scale (x 1.01), or RoPE tables one
    position off, is refused and nothing is written."""
    from elx.exporter.export import apply_passes
    from elx.exporter.passes import fused_attention

    if wrong == "scale":
        real = fused_attention.find_core

        def off(*args):
            core = real(*args)
            core.scale *= 1.01
            return core

        monkeypatch.setattr(fused_attention, "find_core", off)
    else:  # Qwen2's heads of 8 keep RoPE as traced: this case needs heads of 16
        qwen2_exports = {"per-beam": request.getfixturevalue("llama16")}
        tables = fused_attention.rotary_tables
        monkeypatch.setattr(fused_attention, "rotary_tables",
                            lambda *args: [np.roll(t, 1, axis=0) for t in tables(*args)])
    with pytest.raises(ElxError, match="pass fused-attention.*exceeds"):
        apply_passes(qwen2_exports["per-beam"], tmp_path / "out", "fused-attention", quiet=True)
    assert not (tmp_path / "out").exists()


@settings(max_examples=4, deadline=None, derandomize=True, database=None)
@given(beams=st.integers(1, 5), batch=st.integers(1, 4), width=st.integers(2, 12), new=st.integers(1, 14),
       seed=st.integers(0, 2 ** 16))
def test_drawn_settings_are_hf_generate(llama_fused, beams, batch, width, new, seed):
    options = {"max_new_tokens": new, "num_beams": beams}
    if beams > 1:
        options["num_return_sequences"] = 1 + seed % beams
    report = compare(llama_fused, batch_size=batch, input_length=width, seed=seed, **options)
    assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]


def test_a_run_past_the_rotary_tables_is_refused(llama_fused):
    """The kernel's RoPE tables hold max_position_embeddings (128) positions: a longer run is refused in one line
    before it starts (ONNX Runtime would stop at the first position past them)."""
    from elx.runners.generate import Generator

    generator = Generator.from_folder(llama_fused)
    ids = np.array([[5, 6, 7, 8]], dtype=np.int64)
    assert generator.generate(input_ids=ids, max_new_tokens=120).sequences.shape[1] <= 124
    with pytest.raises(ElxError, match="RoPE tables for 128"):
        generator.generate(input_ids=ids, max_new_tokens=130)


def test_a_shared_prompt_cache_is_refused(qwen2_exports, tmp_path):
    from elx.exporter.export import apply_passes

    with pytest.raises(ElxError, match="--prompt-cache per-beam"):
        apply_passes(qwen2_exports["shared"], tmp_path / "out", "fused-attention", quiet=True)
    assert not (tmp_path / "out").exists()


def test_gpu_backends_refuse_the_export(fused):
    from elx.runners.generate import make_backend

    manifest = Manifest.load(fused)
    for backend, device in (("ort", "cuda"), ("ort-io", "cuda"), ("tensorrt", "cuda")):
        with pytest.raises(ElxError, match="run it on the CPU"):
            make_backend(manifest, backend=backend, device=device)


def test_engine_builds_refuse_the_export(fused):
    from elx.exporter.tensorrt.build import build_engine

    with pytest.raises(ElxError, match="TensorRT has no layer"):
        build_engine(fused, quiet=True)
    assert json.loads((fused / "manifest.json").read_text())["passes"][-1]["name"] == "fused-attention"
