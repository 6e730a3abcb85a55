"""The device search path (``runners/search/device.py``, issue 26): HF's tokens and scores, where the logits are.

* The device processors against their host versions and the n-gram reference (hypothesis-drawn).
* ``test_differential_search_on_the_device``: the search-only differential (random tiny configs and settings,
  elx's search on HF's float64 logits against HF ``generate``) with ``ELX_SEARCH=device``: the device path on
  torch CPU tensors.  Examples the device path does not cover run the host path (counted, and bounded below).
* ``test_device_path_is_the_host_path``: exported models on ort-io (the CPU EP, the code that runs on CUDA):
  the device path returns the host path's sequences and scores, bit for bit, and took the device path (no
  step copies a logits row down).

More examples: ``ELX_DIFF_SEARCH_EXAMPLES=N`` (differential), ``ELX_DEVICE_EXAMPLES=N`` (exported models).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import elx.runners.search.search as search
from elx.runners.errors import ElxError
from elx.runners.search.ngram_reference import block_ngrams
from elx.runners.search.processors.masks import BanUntilLength, ForceTokenAt, NoRepeatNGram, Suppress
from elx.runners.search.device import TorchTensors, _on_device, host_reason, search_mode
from elx.runners.search.search_hooks import NO_HOOKS, SearchHooks
from tests.counting_backend import D2H, count_crossings
from tests.differential import Stats, run_search_example
from tests.test_differential import _run, draw_search_case

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEARCH_EXAMPLES = int(os.environ.get("ELX_DIFF_SEARCH_EXAMPLES") or 0) or 20
DEVICE_EXAMPLES = int(os.environ.get("ELX_DEVICE_EXAMPLES") or 0) or 8
QUICK = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


# the device tests run on torch CPU tensors everywhere, and on a CUDA device where there is one
# (tools/gpu_check.sh picks the "cuda" cases by their skip reason)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device (torch.cuda)"))]


def _device(processor, device="cpu"):
    return _on_device(processor, TorchTensors(device).tensor_from_host)


def _on(device, array):
    return torch.from_numpy(array).to(device)


@pytest.mark.parametrize("device", DEVICES)
@QUICK
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 9), st.integers(2, 6), st.integers(0, 2**31))
def test_ngram_blocking_on_the_device_is_the_reference(device, n, rows, length, vocab, seed):
    rng = np.random.default_rng(seed)
    history = rng.integers(0, vocab + 1, size=(rows, length))  # vocab itself: an id the scores do not have
    scores = rng.standard_normal((rows, vocab)).astype(np.float32)
    expected = block_ngrams(history, scores, n)
    got = _device(NoRepeatNGram(n), device)(torch, _on(device, history), _on(device, scores.copy()))
    np.testing.assert_array_equal(got.cpu().numpy(), expected)


@pytest.mark.parametrize("device", DEVICES)
@QUICK
@given(st.sampled_from([0.5, 1.3, 2.0, 1.05]), st.integers(1, 4), st.integers(1, 7), st.integers(0, 2**31))
def test_repetition_penalty_on_the_device_is_the_host_one(device, penalty, rows, length, seed):
    """HF's operators on the device, the host processor's numpy (``tests/test_processors.py`` holds it to HF):
    the same scores bit for bit, repeated tokens and ids past the vocabulary (8) included.  On CUDA the
    reference is HF's own processor there: PyTorch's CUDA division by a Python float multiplies by its
    reciprocal (1 ulp from numpy's division, seen on an H200), and the device path is held to HF on CUDA."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from elx.runners.search.processors.penalties import RepetitionPenalty

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 10 if device == "cpu" else 8, size=(rows, length))  # HF's gather: ids < vocab
    scores = (rng.standard_normal((rows, 8)) * 3).astype(np.float32)
    if device == "cpu":
        expected = RepetitionPenalty(penalty)(tokens, scores.copy())
    else:
        expected = RepetitionPenaltyLogitsProcessor(penalty)(_on(device, tokens), _on(device, scores.copy()))
        expected = expected.cpu().numpy()
    got = _device(RepetitionPenalty(penalty), device)(torch, _on(device, tokens), _on(device, scores.copy()))
    np.testing.assert_array_equal(got.cpu().numpy(), expected)


@pytest.mark.parametrize("device", DEVICES)
@QUICK
@given(st.sampled_from(["ban", "force", "suppress", "suppress_at"]), st.lists(st.integers(0, 12), min_size=1,
                                                                              max_size=4),
       st.integers(1, 6), st.integers(0, 2**31))
def test_column_processors_on_the_device_are_the_host_ones(device, kind, ids, length, seed):
    """Min length, forced BOS/EOS, suppress (always, at the beginning): the host processor's scores, bit for bit;
    ids outside the vocabulary (8 here) are ignored as on the host (forced ones: in range only)."""
    vocab = 8
    if kind == "force":
        ids = [i % vocab for i in ids]
    host = {"ban": BanUntilLength(ids, 4), "force": ForceTokenAt(ids, 3), "suppress": Suppress(ids),
            "suppress_at": Suppress(ids, at_length=2)}[kind]
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(3, length))
    scores = rng.standard_normal((3, vocab)).astype(np.float32)
    expected = host(tokens, scores.copy())
    got = _device(host, device)(torch, _on(device, tokens), _on(device, scores.copy()))
    np.testing.assert_array_equal(got.cpu().numpy(), expected)


def test_search_path_choice(monkeypatch):
    monkeypatch.setenv("ELX_SEARCH", "gpu")
    with pytest.raises(ElxError, match="ELX_SEARCH='gpu' is not a search path"):
        search_mode()

    class HostModel:  # the tests' HF-logits models: no backend
        needs_history = False

    assert host_reason(HostModel(), [], NO_HOOKS, "auto") == "the backend keeps its values in host arrays"
    assert host_reason(HostModel(), [], NO_HOOKS, "device") is None
    assert host_reason(HostModel(), [], NO_HOOKS, "host") == "ELX_SEARCH=host"
    assert "sampling" in host_reason(HostModel(), [], SearchHooks(sampler=object()), "device")
    assert "output_scores" in host_reason(HostModel(), [], SearchHooks(record_scores=True), "device")
    from elx.runners.search.processors.penalties import EncoderRepetitionPenalty, RepetitionPenalty

    assert host_reason(HostModel(), [RepetitionPenalty(1.2)], NO_HOOKS, "device") is None
    padded = RepetitionPenalty(1.2, padding=np.array([0, 2]))  # a left-padded decoder-only prompt
    assert "RepetitionPenalty" in host_reason(HostModel(), [padded], NO_HOOKS, "device")
    encoder = EncoderRepetitionPenalty(1.2, np.zeros((1, 3), dtype=np.int64))
    assert "EncoderRepetitionPenalty" in host_reason(HostModel(), [encoder], NO_HOOKS, "device")
    monkeypatch.setenv("ELX_LOG_SOFTMAX", "numpy")
    assert "ELX_LOG_SOFTMAX=numpy" in host_reason(HostModel(), [], NO_HOOKS, "device")


@pytest.mark.parametrize("where", ["cpu-kernels", "hf-ops", DEVICES[1]])
def test_differential_search_on_the_device(capsys, monkeypatch, where):
    """The search-only differential on the device path (torch tensors on the CPU; ``hf-ops``: the branch CUDA
    runs, HF's operators and ``torch.topk``, on the CPU; ``cuda``: on a CUDA device): HF's tokens, scores and
    extras, nothing excused beyond the differential's own rule (HF's logits are float64 on the CPU; the device
    path's float32 log-softmax on CUDA is CUDA's kernel, so its ties and last bits are the rule's business)."""
    from elx.runners.search import device as search_device

    monkeypatch.setenv("ELX_SEARCH", "device")
    monkeypatch.setattr(search_device.DeviceScorer, "hf_ops_on_cpu", where == "hf-ops")
    if where == "cuda":  # the models here have no device backend: the scorer's transfers put everything on CUDA
        class CudaTensors(TorchTensors):
            def __init__(self):
                super().__init__("cuda")

        monkeypatch.setattr(search_device, "HostTensors", CudaTensors)
    stats = Stats("search-device" + ("" if where == "cpu-kernels" else f"-{where}"))
    taken, counts = [], []  # device scorers made in this example's searches; whether each example made one
    scorer = search.device_scorer

    def counted(*args, **kwargs):
        made = scorer(*args, **kwargs)
        taken.append(made is not None)
        return made

    monkeypatch.setattr(search, "device_scorer", counted)

    @given(st.data())
    def example(data):  # issue 25's options a quarter of the time: mostly options the device path covers
        taken.clear()
        run_search_example(stats, *draw_search_case(
            data, issue25=lambda data: data.draw(st.integers(0, 3), label="issue25_draw") == 0),
            search_device=(lambda: "cuda" if any(taken) else None) if where == "cuda" else None)
        counts.append(any(taken))

    _run(example, SEARCH_EXAMPLES)
    stats.dump()
    with capsys.disabled():
        print(f"\n{stats.summary()}\ndevice path: {sum(counts)} of {len(counts)} examples (the others need the host path)")
    assert not stats.failures, stats.summary()
    assert stats.examples == SEARCH_EXAMPLES
    # some draws ask for what the device path leaves to the host (sampling, penalties, recorded scores)
    assert sum(counts) >= len(counts) // 2, (sum(counts), len(counts))


@st.composite
def _device_options(draw, eos: int) -> dict:
    beams = draw(st.integers(1, 4), label="beams")
    options = {"num_beams": beams, "max_new_tokens": draw(st.integers(1, 8), label="new")}
    if beams > 1:
        options["num_return_sequences"] = draw(st.integers(1, beams), label="return")
        options["length_penalty"] = draw(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]), label="lp")
        options["early_stopping"] = draw(st.sampled_from([True, False, "never"]), label="early")
    if draw(st.booleans(), label="use_min"):
        options["min_new_tokens"] = draw(st.integers(0, options["max_new_tokens"]), label="min")
    options["no_repeat_ngram_size"] = draw(st.integers(0, 3), label="ngram")
    if draw(st.booleans(), label="use_repetition_penalty"):
        options["repetition_penalty"] = draw(st.sampled_from([0.7, 1.2, 1.5]), label="repetition_penalty")
    if draw(st.booleans(), label="eos_list"):  # several EOS ids: HF keeps more candidates per item
        options["eos_token_id"] = [eos, draw(st.integers(3, 60), label="eos2")]
    if draw(st.booleans(), label="suppress"):
        options["suppress_tokens"] = draw(st.lists(st.integers(2, 127), min_size=1, max_size=3), label="ids")
    if draw(st.booleans(), label="forced_eos"):
        options["forced_eos_token_id"] = eos
    return options


class _TorchLogitsModel:
    """A model whose logits are torch tensors on its backend's device (a PyTorch-computed step; the GPU check's
    stand-in): fixed random logits, a fresh tensor per step, copied down only when the search asks for host values."""

    needs_history = False
    returns_log_probs = False

    def __init__(self, logits: np.ndarray, backend):
        self.backend, self.logits, self.asked = backend, backend.tensor_from_host(logits), []

    def empty_cache(self, rows):
        from elx.runners.backends.base import DecoderCache
        return DecoderCache({}, rows, 0)

    def step(self, tokens, state, cache, history=None, device=False):
        from elx.runners.backends.base import DecoderCache
        self.asked.append(device)
        logits = self.logits[: tokens.shape[0]].clone()
        return (logits if device else self.backend.tensor_to_host(logits)), DecoderCache({}, tokens.shape[0], cache.length + 1)

    def reorder(self, cache, rows):
        from elx.runners.backends.base import DecoderCache
        return DecoderCache({}, int(rows.shape[0]), cache.length)

    def select(self, state, items):
        from elx.runners.backends.base import EncoderState
        return EncoderState({}, int(items.shape[0]))

    def state_bytes(self, state):
        return 0

    def cache_bytes(self, cache):
        return 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_torch_backends_logits_are_read_where_they_are(monkeypatch, device):
    """A model whose backend holds torch tensors (``TorchTensors``) is asked for device scores, and no step
    copies its [rows, vocab] logits down and back up (the first GPU check measured that round trip as 40 ms of
    "host bookkeeping" a step at batch 128); the tokens are the host path's, the scores too (on CUDA to its last bits)."""
    from elx.runners.backends.base import EncoderState
    from elx.runners.search.processors import build_processors
    from elx.runners.search.settings import GenerationSettings

    class Counting(TorchTensors):
        def __init__(self):
            super().__init__(device)
            self.down = []

        def tensor_to_host(self, tensor):
            self.down.append(tuple(tensor.shape))
            return super().tensor_to_host(tensor)

    batch, beams, vocab = 3, 4, 97
    logits = (np.random.default_rng(0).standard_normal((batch * beams, vocab)) * 4).astype(np.float32)
    settings = GenerationSettings(num_beams=beams, max_new_tokens=5, min_new_tokens=2, eos_token_id=[1],
                                  pad_token_id=0, decoder_start_token_id=0, no_repeat_ngram_size=2)
    results = {}
    for path in ("host", "device"):
        monkeypatch.setenv("ELX_SEARCH", path)
        backend = Counting()
        model = _TorchLogitsModel(logits, backend)
        results[path] = search.beam_search(model, EncoderState({}, batch), settings, build_processors(settings, 1))
        results[path + "-asked"], results[path + "-down"] = model.asked, backend.down
    assert set(results["device-asked"]) == {True} and set(results["host-asked"]) == {False}
    assert not [shape for shape in results["device-down"] if vocab in shape], results["device-down"]
    assert any(vocab in shape for shape in results["host-down"])  # the counter sees a logits copy where there is one
    np.testing.assert_array_equal(results["device"].sequences, results["host"].sequences)
    if device == "cpu":  # the same CPU kernels: bit for bit
        np.testing.assert_array_equal(results["device"].scores, results["host"].scores)
    else:  # CUDA's log-softmax, not the CPU's: last bits (an H100 gave 1 ulp on one of three scores)
        np.testing.assert_array_max_ulp(results["device"].scores, results["host"].scores, maxulp=4)


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_device_path_is_the_host_path(exported, model_folders, family, monkeypatch):
    """ort-io on the CPU EP: the device path's sequences and scores are the host path's, bit for bit (the host
    path is the one the differential tests hold to HF), and its steps copy no logits row down."""
    from elx.runners.generate import Generator

    generator = Generator.from_folder(exported(family), backend="ort-io", device="cpu", threads=1)
    counting = count_crossings(generator)
    eos = generator.settings().eos_token_id[0]
    vocab = json.loads((model_folders[family] / "config.json").read_text())["vocab_size"]

    @settings(max_examples=DEVICE_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_device_options(eos), st.integers(1, 3), st.integers(0, 2**31))
    def example(options, batch, seed):
        rng = np.random.default_rng(seed)
        ids = rng.integers(3, 120, size=(batch, 6))
        inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        outs = {}
        for path in ("host", "device"):
            monkeypatch.setenv("ELX_SEARCH", path)
            del counting.phases[1:]
            outs[path] = generator.generate(inputs, decode=False, track_memory=True, **options)
            rows = [m["rows"] for m in outs[path].memory]  # a decoder-only model's first step runs no step graph
            per_row = [step.bytes(D2H) / r for step, r in zip(counting.steps, rows[len(rows) - len(counting.steps):])]
            if path == "device":  # candidates only (a logits row: 4 · vocab bytes)
                assert all(b < vocab for b in per_row), per_row
            else:
                assert all(b == 4 * vocab for b in per_row), per_row
        np.testing.assert_array_equal(outs["device"].sequences, outs["host"].sequences)
        if options["num_beams"] > 1:
            np.testing.assert_array_equal(outs["device"].scores, outs["host"].scores)

    example()
