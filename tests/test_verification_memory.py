"""The verification's memory savings change no number: the layer-by-layer float64 reference equals the whole
model in float64 and leaves every weight as it was; sessions over one mapping of weights.data give the outputs
of sessions that load the weights themselves, and read the file's bytes, not a copy."""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from elx.exporter.verification.verify import Shape
from tests.conftest import BUILDERS


@pytest.mark.parametrize("family", ["llama", "t5", "whisper"])
def test_float64_layer_by_layer_equals_the_whole_model_in_float64(family):
    from elx.exporter.verification.fp32_noise import _layer_modules, in_float64

    torch.manual_seed(3)
    model = BUILDERS[family]().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # every tensor object the model holds, buffers kept out of the state dict (RoPE's inv_freq) included: a template
    # (exporter/capture/template.py) shares them and must find them in float32 again after the block
    held = dict([*model.named_parameters(), *model.named_buffers()])
    whole = copy.deepcopy(model).to(torch.float64)
    assert len(_layer_modules(model)) >= 2  # the stacks are found: the layers really run one at a time
    if family == "whisper":
        features = torch.randn(2, model.config.num_mel_bins, 2 * model.config.max_source_positions)
        inputs = dict(input_features=features, decoder_input_ids=torch.tensor([[1, 5, 7], [1, 9, 3]]))
    else:
        inputs = dict(input_ids=torch.tensor([[4, 9, 17, 3], [8, 21, 5, 6]]))
        if family == "t5":
            inputs["decoder_input_ids"] = torch.tensor([[0, 5, 7], [0, 9, 3]])
    cast = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
    with torch.no_grad():
        expected = whole(**cast).logits
        with in_float64(model):
            got = model(**cast).logits
            # inside the block, between forwards, every layer holds its own float32 tensors
            assert all(p.dtype == torch.float32 for layer in _layer_modules(model) for p in layer.parameters())
    assert got.dtype == torch.float64
    assert torch.equal(got, expected)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert all(now[k] is t for k, t in held.items())
    assert all(t.dtype == torch.float32 for t in held.values() if t.is_floating_point())


@pytest.mark.parametrize("family", ["llama", "m2m100", "bart"])
def test_large_tables_stay_float32_and_give_the_float64_logits(family, monkeypatch):
    """Embeddings and heads past ``TABLE_VALUES`` stay float32 in the float64 block (gathered then cast; the head
    multiplied by its weight cast a block of rows at a time): the whole model's float64 logits, bit for bit
    where the head is one block, to float64's rounding where it is several; no weight converted meanwhile."""
    from elx.exporter.verification import fp32_noise

    torch.manual_seed(5)
    model = BUILDERS[family](**({"scale_embedding": True} if family == "bart" else {})).eval()
    whole = copy.deepcopy(model).to(torch.float64)
    inputs = dict(input_ids=torch.tensor([[4, 9, 17, 3], [8, 21, 5, 6]]))
    if family != "llama":
        inputs["decoder_input_ids"] = torch.tensor([[2, 5, 7], [2, 9, 3]])
    embedding = model.get_input_embeddings().weight
    monkeypatch.setattr(fp32_noise, "TABLE_VALUES", 0)
    with torch.no_grad():
        expected = whole(**inputs).logits
        for chunk, exact in ((1 << 30, True), (8 * model.config.hidden_size * 7, False)):  # one block; blocks of 7 rows
            monkeypatch.setattr(fp32_noise, "HEAD_CHUNK_BYTES", chunk)
            with fp32_noise.in_float64(model):
                assert embedding.dtype == torch.float32  # kept
                tables = fp32_noise._tables_in_float32(model, set())
                assert {type(m).__name__ for m, _ in tables} >= {"Linear", type(model.get_input_embeddings()).__name__}
                got = model(**inputs).logits
            assert got.dtype == torch.float64
            if exact:
                assert torch.equal(got, expected)
            else:
                torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)
    assert not any("forward" in vars(m) for m in model.modules())  # the classes' forwards again
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_float64_layer_by_layer_restores_the_model_after_an_error():
    from elx.exporter.verification.fp32_noise import _layer_modules, in_float64

    torch.manual_seed(4)
    model = BUILDERS["llama"]().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    def fail(module, args):
        assert next(module.parameters()).dtype == torch.float64  # the layer was swapped to float64 when it failed
        raise RuntimeError("a layer failing mid-forward")

    with pytest.raises(RuntimeError, match="mid-forward"):
        with in_float64(model), torch.no_grad():
            _layer_modules(model)[1].register_forward_pre_hook(fail)  # after in_float64's own hook
            model(input_ids=torch.tensor([[4, 9, 17, 3]]))
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 1  # only the test's own hook is left


def _side(manifest, backend):
    from elx.exporter.verification.verify import RuntimeSide
    from elx.runners.model import Model

    side = RuntimeSide.__new__(RuntimeSide)
    side.model, side.prefill = Model(manifest, backend).for_run(0), False
    return side


def test_mapped_sessions_give_the_loaded_sessions_outputs(exported):
    from elx.exporter.verification.verify import default_shapes, make_case
    from elx.runners.backends.ort import OrtBackend
    from elx.runners.manifest import Manifest

    manifest = Manifest.load(exported("llama"))
    mapped = OrtBackend(manifest, prepack=False)
    files = {str(p) for p in manifest.folder.glob("*.data")}
    assert mapped.mapped._values and set(mapped.mapped._maps) <= {str(Path(f).resolve()) for f in files}
    plain, shared = _side(manifest, OrtBackend(manifest)), _side(manifest, mapped)
    for shape in default_shapes(manifest):
        case = make_case(manifest, shape, seed=1)
        a, _ = plain.run(case, dict(case.past))
        b, _ = shared.run(case, dict(case.past))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["whisper", "bart"])
def test_the_reference_decoder_on_a_few_rows_at_a_time_gives_the_all_rows_forward(family, exported, model_folders,
                                                                                   monkeypatch):
    """``TorchSide`` runs the decoder on chunks of an item's beams (``rows_per_forward``: Whisper's cross keys and
    values of all rows were the export's memory peak); each row must get its own encoder output, past and tokens:
    held to HF's forward on every row at once, the form it replaced, with a row per forward and with all beams."""
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    import elx.exporter.verification.verify as verify
    from elx.runners.manifest import Manifest

    manifest = Manifest.load(exported(family))
    auto = AutoModelForSpeechSeq2Seq if family == "whisper" else AutoModelForSeq2SeqLM
    model = auto.from_pretrained(model_folders[family]).eval()
    side = verify.TorchSide(model, manifest)
    case = verify.make_case(manifest, Shape(batch=2, beams=3, source=6, past=4), seed=2)
    inputs = {role: torch.from_numpy(a) for role, a in case.inputs.items()}
    mask = inputs.get("attention_mask")
    with torch.no_grad():
        encoder = model.get_encoder()(**inputs).last_hidden_state.repeat_interleave(3, 0)
        pairs = [(torch.from_numpy(case.past[f"past_key_values.{i}.decoder.key"]),
                  torch.from_numpy(case.past[f"past_key_values.{i}.decoder.value"])) for i in range(side.layers)]
        expected = model(encoder_outputs=(encoder,), decoder_input_ids=torch.from_numpy(case.tokens),
                         attention_mask=None if mask is None else mask.repeat_interleave(3, 0),
                         past_key_values=EncoderDecoderCache(DynamicCache(pairs), DynamicCache()),
                         use_cache=True).logits[:, -1, :].numpy()
    for budget, rows in ((1, 1), (1 << 40, 3)):
        monkeypatch.setattr(verify, "CROSS_CACHE_BYTES", budget)
        assert verify.rows_per_forward(encoder, side.layers, 3) == rows
        scores, _ = side.run(case, dict(case.past))
        assert scores.shape == expected.shape
        np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-5)
    # the rows differ (their own past and tokens): a row given another row's inputs would not pass the above
    assert np.abs(expected[0] - expected[1]).max() > 1e-2


def test_row_chunks_cover_each_items_beams_in_order_never_across_items():
    from elx.exporter.verification.verify import _row_chunks

    assert _row_chunks(2, 3, 1) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)]
    assert _row_chunks(2, 3, 2) == [(0, 2), (2, 1), (3, 2), (5, 1)]
    assert _row_chunks(3, 2, 4) == [(0, 2), (2, 2), (4, 2)]


def _decoder_only_cases(exported, model_folders, family: str):
    from transformers import AutoModelForCausalLM

    from elx.exporter.verification.verify import DecoderOnlyTorchSide, default_shapes
    from elx.runners.manifest import Manifest

    manifest = Manifest.load(exported(family))
    model = AutoModelForCausalLM.from_pretrained(model_folders[family]).eval()
    return model, manifest, DecoderOnlyTorchSide(model, manifest), default_shapes(manifest)


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt_neox"])
def test_the_reference_cases_in_two_forwards_give_what_each_case_gives_alone(family, exported, model_folders):
    """The export's fp32 and float64 references run their decoder-only cases in two forwards for all of them
    (``DecoderOnlyTorchSide.run_together``: left-padded prompts, a masked gap before each case's past): every
    case's float64 logits equal those of the case run alone up to float64's rounding (far below fp32's error,
    which they measure), its fp32 logits within fp32's own error of the case alone, each layer is converted
    2 x layers times instead of 2 x layers x cases, PyTorch's thread count is read per layer, and the model is
    float32 again after it.  Every decoder-only family (CI: Llama and GPT-2; the
    others with ELX_LONG_TESTS=1): OPT reads positions its own way, Mistral has a sliding window, Phi-3 a partial
    rotary, Gemma scales its embeddings; the padded rows must compute what the case computes in each."""
    from elx.exporter.verification.fp32_noise import Float64Side, _LayerSwap, _layer_modules, in_float64
    from elx.exporter.verification.verify import RecordedSide, make_case

    model, manifest, side, shapes = _decoder_only_cases(exported, model_folders, family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    conversions, asked = [], []
    original = _LayerSwap.enter

    def counted(self, module, args):
        conversions.append(module)
        return original(self, module, args)

    layers = len(_layer_modules(model))
    assert layers >= 2 and len(shapes) >= 3
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_LayerSwap, "enter", counted)
        with in_float64(model):
            alone = RecordedSide(Float64Side(side), manifest, shapes, [0])
        assert len(conversions) == 2 * layers * len(shapes)
        conversions.clear()
        with in_float64(model, threads=lambda: asked.append(1) or 1):
            together = RecordedSide(Float64Side(side), manifest, shapes, [0], together=True)
        assert len(conversions) == 2 * layers and len(asked) == 2 * layers
    assert {shape.source for shape in shapes} != {shapes[0].source}  # prompts of several widths: padding happens
    fp32_alone = RecordedSide(side, manifest, shapes, [0])
    fp32_together = RecordedSide(side, manifest, shapes, [0], together=True)
    for shape in shapes:
        case = make_case(manifest, shape, 0)
        a, b = alone.run(case, case.past)[0], together.run(case, case.past)[0]
        assert a.dtype == np.float64 and a.shape == b.shape
        assert np.abs(a - b).max() <= 1e-10 * np.abs(a).max(), shape
        # fp32 batched: the same function, rounded otherwise (fp32's error against float64 is what bounds it)
        c, d = fp32_alone.run(case, case.past)[0], fp32_together.run(case, case.past)[0]
        assert c.dtype == d.dtype == np.float32 and c.shape == d.shape
        assert np.abs(c - d).max() <= 2 * np.abs(c - a).max() + 1e-6 * np.abs(a).max(), shape
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def test_a_batched_float64_reference_that_disagrees_with_fp32_is_run_again_case_by_case(exported, model_folders):
    """A family whose forward the batched cases would change must not widen the bars: ``torch_references`` checks
    the batched float64 logits against fp32's case-by-case ones and, past ``BATCHED_AGREEMENT``, runs the cases
    alone.  Here the batched float64 forward is made wrong on purpose (one case's logits shifted by 1)."""
    from elx.exporter.verification import verify
    from elx.exporter.verification.fp32_noise import Float64Side, in_float64
    from elx.exporter.verification.verify import DecoderOnlyTorchSide, RecordedSide, make_case, torch_references

    model, manifest, side, shapes = _decoder_only_cases(exported, model_folders, "llama")
    honest = DecoderOnlyTorchSide.run_together

    def shifted(self, items):  # the float64 forward only: fp32's batched reference stays right
        found = honest(self, items)
        if found[1][0].dtype == np.float64:
            found[1] = (found[1][0] + 1.0, None)
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecoderOnlyTorchSide, "run_together", shifted)
        fp32, fp64 = torch_references(model, manifest, shapes)
        with in_float64(model):
            wrong = RecordedSide(Float64Side(side), manifest, shapes, [0], together=True)
        assert not verify._agrees_with(wrong, fp32, manifest, shapes, 0)
    with in_float64(model):
        alone = RecordedSide(Float64Side(side), manifest, shapes, [0])
    for shape in shapes:
        case = make_case(manifest, shape, 0)
        assert np.array_equal(fp64.run(case, case.past)[0], alone.run(case, case.past)[0])


def test_a_pass_is_verified_with_one_set_of_sessions_loaded_at_a_time(exported, tmp_path, monkeypatch):
    """A pass's verification records the graphs' results before it and releases their sessions before the rewritten
    graphs load (``verify_rewrite``: ``RecordedSide``): the two sets side by side were the peak of the real
    SmolLM2-135M's export with ``--pass fused-attention,fused-norm`` (2,220 MB against the bound's 2,104; 1,503 MB
    after).  Each side is counted alive when the next loads (no collection: freed as its last reference goes)."""
    import weakref

    import elx.exporter.verification.verify as verify
    from elx.exporter.export import apply_passes
    from elx.runners.manifest import Manifest

    alive, seen = [], []
    real = verify.RuntimeSide

    class Counted(real):
        def __init__(self, *args, **kwargs):
            seen.append(sum(ref() is not None for ref in alive))
            super().__init__(*args, **kwargs)
            alive.append(weakref.ref(self))

    monkeypatch.setattr(verify, "RuntimeSide", Counted)
    out = apply_passes(exported("t5"), tmp_path / "el", "el")
    assert len(seen) >= 2 and set(seen) == {0}, seen  # before's sessions, then after's, never together
    assert Manifest.load(out).pass_names() == ["el"]


def test_audio_cases_share_windows_and_each_is_encoded_once_per_evaluation(exported, model_folders, monkeypatch):
    """Whisper's cases draw their rows from ``AUDIO_WINDOWS`` windows (in turn: neighbours differ), and PyTorch's
    reference encodes each window once per evaluation: the same logits and encoder outputs as encoding every row,
    a third of the encoder's forwards."""
    from transformers import WhisperForConditionalGeneration

    from elx.exporter.verification.verify import AUDIO_WINDOWS, RecordedSide, TorchSide, default_shapes, make_case
    from elx.runners.manifest import Manifest

    manifest = Manifest.load(exported("whisper"))
    shapes = default_shapes(manifest)
    cases = [make_case(manifest, shape, 0) for shape in shapes]
    windows = {row.tobytes() for case in cases for row in case.inputs["input_features"]}
    assert len(windows) == AUDIO_WINDOWS < sum(shape.batch for shape in shapes)
    for case in cases:  # items distinct up to the pool's size; beyond it, neighbours differ
        rows = [row.tobytes() for row in case.inputs["input_features"]]
        assert len(set(rows)) == min(case.shape.batch, AUDIO_WINDOWS)
        assert all(a != b for a, b in zip(rows, rows[1:]))
    assert any(case.shape.batch > AUDIO_WINDOWS for case in cases)  # the 3-item case repeats a window
    model = WhisperForConditionalGeneration.from_pretrained(model_folders["whisper"]).eval()
    calls, projections = [], []
    model.get_encoder().register_forward_hook(lambda module, args, output: calls.append(1))
    model.model.decoder.layers[0].encoder_attn.k_proj.register_forward_hook(
        lambda module, args, output: projections.append(args[0].shape[0]))
    import elx.exporter.verification.verify as verify

    side = TorchSide(model, manifest)
    RecordedSide(side, manifest, shapes, [0])  # the tiny model's outputs are short: each item's rows project theirs
    assert projections == [case.shape.beams for case in cases for _ in range(case.shape.batch)] and not side.crossed
    calls.clear(), projections.clear()
    monkeypatch.setattr(verify, "CROSS_CACHE_BYTES", 1)  # whisper-base's 1500 frames: two rows' are past the budget
    recorded = RecordedSide(side, manifest, shapes, [0])
    assert len(calls) == AUDIO_WINDOWS and side.encoded == {} and side.crossed == {}  # forgotten after it
    assert projections == [1] * AUDIO_WINDOWS  # the cross keys/values once per window, one row each
    for case in cases:  # each row encoded alone, nothing kept: the same numbers
        fresh = TorchSide(model, manifest)
        fresh._encoded = lambda item: (object(), model.get_encoder()(**item).last_hidden_state)
        expected = fresh.run(case, dict(case.past))
        got = recorded.run(case, dict(case.past))
        assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
        # and HF's decoder projecting every row's own cross keys/values (no cross cache given): the same function
        plain = TorchSide(model, manifest)
        plain._cross = lambda key, encoder: []
        np.testing.assert_allclose(plain.run(case, dict(case.past))[0], got[0], rtol=0, atol=1e-5)


def test_a_scaled_embedding_that_computes_something_else_is_converted_instead():
    """The float32 table is read as "rows times ``embed_scale``" only where the module computes that on a probe;
    another forward keeps the conversion (its float64 numbers then come from its own code)."""
    from elx.exporter.verification.fp32_noise import _float64_forward

    class MyScaledWordEmbedding(torch.nn.Embedding):
        def __init__(self, shift=0.0):
            super().__init__(10, 4)
            self.embed_scale, self.shift = 2.0, shift

        def forward(self, ids):
            return super().forward(ids) * self.embed_scale + self.shift

    assert _float64_forward(MyScaledWordEmbedding(shift=1.0)) is None
    plain = MyScaledWordEmbedding()
    forward = _float64_forward(plain)
    assert forward is not None
    got = forward(torch.tensor([3, 7]))
    assert got.dtype == torch.float64 and torch.equal(got, plain.weight[[3, 7]].double() * 2.0)


def test_audio_rows_are_encoded_a_few_at_a_time_on_the_host(exported, monkeypatch):
    """With a budget (the verification's ``RuntimeSide``) an audio encoder on host arrays runs rows in chunks whose
    attention scores fit it (the export's peak was three 30 s rows' scores at once); the state is the whole
    batch's, as one run gives it.  The runtime's default keeps the batch whole."""
    from elx.exporter.verification.verify import AUDIO_SCORES_BYTES, RuntimeSide
    from elx.runners.backends.ort import OrtBackend
    from elx.runners.manifest import Manifest
    from elx.runners.model import Model

    manifest = Manifest.load(exported("whisper"))
    features = np.random.default_rng(0).standard_normal((3, *manifest.encoder_inputs()["input_features"]["shape"][1:]))
    inputs = {"input_features": features.astype(np.float32)}
    per_row = 2 * 4 * manifest.dims["num_heads"] * (features.shape[-1] // 2) ** 2
    encoded = {}
    for budget in (per_row, 3 * per_row, None):  # one row a run, all three, no budget
        model = Model(manifest, OrtBackend(manifest), audio_scores_bytes=budget)
        runs = []
        run = model.backend.run
        monkeypatch.setattr(model.backend, "run", lambda *a, run=run, runs=runs, **k: runs.append(a[0]) or run(*a, **k))
        encoded[budget] = model.encode(inputs)
        assert runs.count("encoder") == (3 if budget == per_row else 1) and encoded[budget].batch == 3
    chunked, whole = encoded[per_row], encoded[None]
    assert chunked.feeds.keys() == whole.feeds.keys() and chunked.kept.keys() == whole.kept.keys()
    for key in chunked.feeds:
        np.testing.assert_allclose(chunked.feeds[key], whole.feeds[key], rtol=1e-5, atol=1e-5)
    assert RuntimeSide(manifest).model.audio_rows(inputs) == max(1, AUDIO_SCORES_BYTES // per_row)
    text = Manifest.load(exported("t5"))
    assert Model(text, OrtBackend(text), audio_scores_bytes=1).audio_rows({"input_ids": np.zeros((3, 4), np.int64)}) is None


def test_the_graphs_encode_each_audio_window_once_and_give_the_numbers_of_every_row_encoded(exported, monkeypatch):
    """``RuntimeSide._encode_row``: with the verification's row-at-a-time audio encoder, each distinct window runs
    the encoder stages once per side (``AUDIO_WINDOWS`` of them for 8 rows), and every case's scores and encoder
    output are bit-identical to encoding every row (ONNX Runtime's CPU kernels on the same bytes and shape; the
    kept state is not written to by the decoder steps)."""
    import elx.exporter.verification.verify as verify
    from elx.runners.manifest import Manifest
    from elx.runners.model import Model

    manifest = Manifest.load(exported("whisper"))
    frames = manifest.encoder_inputs()["input_features"]["shape"][-1] // 2
    monkeypatch.setattr(verify, "AUDIO_SCORES_BYTES", 2 * 4 * manifest.dims["num_heads"] * frames ** 2)  # a row
    shapes = verify.default_shapes(manifest)
    runs = []
    encode = Model._encode
    monkeypatch.setattr(Model, "_encode", lambda self, inputs: runs.append(len(inputs["input_features"])) or
                        encode(self, inputs))
    once = verify.RuntimeSide(manifest)
    every = verify.RuntimeSide(manifest)
    del every.model._encode  # no memo: each row through the encoder stages (the class's method)
    first_time = []
    for shape in shapes:
        case = verify.make_case(manifest, shape, 0)
        before = len(runs)
        got = once.run(case, dict(case.past))
        mine, before = runs[before:], len(runs)
        expected = every.run(case, dict(case.past))
        assert runs[before:] == [1] * case.shape.batch  # every row through the encoder stages
        assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
        first_time.extend(mine)
    assert first_time == [1] * verify.AUDIO_WINDOWS and verify.AUDIO_WINDOWS < sum(shape.batch for shape in shapes)


def test_cases_kept_hands_out_the_same_case_as_copies_keyed_by_what_it_reads(exported):
    """``cases_kept``: inside it each case is made once and copies are handed out (a caller writing to one changes
    no other); a manifest whose cache entries differ (a pass's new layout) gets its own case; outside it nothing is
    kept."""
    import elx.exporter.verification.verify as verify
    from elx.runners.manifest import Manifest

    manifest = Manifest.load(exported("whisper"))
    shape = verify.default_shapes(manifest)[1]
    fresh = verify.make_case(manifest, shape, 0)
    calls = []
    new_case = verify._new_case
    with verify.cases_kept():
        verify._new_case = lambda *args: calls.append(1) or new_case(*args)
        try:
            first = verify.make_case(manifest, shape, 0)
            first.tokens[:] = 0
            first.inputs["input_features"][:] = 0
            second = verify.make_case(manifest, shape, 0)
            other = copy.deepcopy(manifest.data)
            other["cache"]["self"][0]["shape"] = [*other["cache"]["self"][0]["shape"][:-1], 3]
            changed = verify.make_case(Manifest(other, manifest.folder), shape, 0)
        finally:
            verify._new_case = new_case
    assert calls == [1, 1]  # the first case once, the changed manifest's once
    assert np.array_equal(second.tokens, fresh.tokens) and np.array_equal(second.inputs["input_features"],
                                                                          fresh.inputs["input_features"])
    assert changed.past[other["cache"]["self"][0]["input"]].shape[-1] == 3
    assert verify._kept_cases.get() is None
