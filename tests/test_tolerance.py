"""The fp32 tolerance scales with the logits (issue 25 item 6): ``elx.exporter.verification.verify.logits_tolerance``.

The bar is ``max(1e-4, 2^-18 · M)`` with M the largest reference logit: float32 rounding is relative, so
the same export computed at a larger scale errs proportionally more, and an absolute bar refused
flan-t5-base (M = 230, diff 2.3e-4) while checking nothing more.  Unit-scale logits keep 1e-4.

``ELX_LONG_TESTS=1`` also exports every ``--random-init`` preset up to 600 MB of weights (minutes each);
the larger ones are measured by hand (see the closing notes of issue 25).
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from elx.exporter.verification.verify import (LOGITS_SCALE, RELATIVE_TOLERANCE, TOLERANCE, logits_tolerance, require_within_tolerance,
                             tolerance_record, verify_rewrite)
from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from tests.conftest import BUILDERS

LONG = os.environ.get("ELX_LONG_TESTS") == "1"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_rule():
    assert LOGITS_SCALE == pytest.approx(26.2144)
    for magnitude in (0.0, 0.5, 1.0, 13.0, LOGITS_SCALE):  # unit-scale logits: as strict as before
        assert logits_tolerance(magnitude) == TOLERANCE
    assert logits_tolerance(2 * LOGITS_SCALE) == pytest.approx(2e-4)
    assert logits_tolerance(230.0) == pytest.approx(230.0 * 2.0 ** -18)  # flan-t5-base's logits
    assert logits_tolerance(None) == logits_tolerance(float("nan")) == TOLERANCE
    record = tolerance_record(100.0)
    assert record["atol"] == logits_tolerance(100.0) and record["logits_magnitude"] == 100.0
    assert record["absolute"] == TOLERANCE and record["relative"] == RELATIVE_TOLERANCE and "M" in record["rule"]


def test_manifest_tolerance():
    """A manifest's bar is its export's: earlier manifests (no record) keep 1e-4."""
    base = {"verification": {}}
    assert logits_tolerance(Manifest(base)) == TOLERANCE
    assert logits_tolerance(Manifest({"verification": {"tolerance": tolerance_record(500.0)}})) == \
        pytest.approx(500.0 * RELATIVE_TOLERANCE)


def test_rounding_error_is_relative():
    """The rule's premise: two float32 evaluations of a sum of D = 1024 products (pairwise and sequential
    order) differ well within 2^-18 of Σ|a·b|, and by exactly 2^k times more when the terms are 2^k larger
    (a power of two scales every rounding exactly): an absolute bar cannot hold at every scale."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 64, 1024)).astype(np.float32)

    def disagreement(x):
        pairwise = np.sum(x * b, axis=1, dtype=np.float32)
        sequential = np.cumsum(x * b, axis=1, dtype=np.float32)[:, -1]
        return np.abs(pairwise.astype(np.float64) - sequential), np.abs(x.astype(np.float64) * b).sum(axis=1)

    diff, magnitude = disagreement(a)
    assert (diff <= RELATIVE_TOLERANCE * magnitude).all() and diff.max() > 0
    diff_big, magnitude_big = disagreement(a * np.float32(2.0 ** 14))
    np.testing.assert_array_equal(diff_big, diff * 2.0 ** 14)
    assert diff_big.max() > TOLERANCE and (diff_big <= RELATIVE_TOLERANCE * magnitude_big).all()


@pytest.fixture(scope="module")
def large_logits(tmp_path_factory):
    """A tiny T5 whose untied head is 30x larger (max |logit| about 2300): its export errs beyond 1e-4."""
    from elx.exporter.export import export_model

    root = tmp_path_factory.mktemp("large-logits")
    torch.manual_seed(0)
    model = BUILDERS["t5"](tie_word_embeddings=False, feed_forward_proj="gated-gelu", d_model=64, d_ff=128, d_kv=16,
                           vocab_size=512).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(root / "model")
    return export_model(str(root / "model"), root / "export", quiet=True)


def test_large_logits_export(large_logits):
    """Refused before ("exceeds 0.0001"); now verified against the bar of its own magnitude, recorded."""
    manifest = Manifest.load(large_logits)
    report, record = manifest.data["verification"]["export"], manifest.data["verification"]["tolerance"]
    assert report["logits_magnitude"] > 1000 and record["logits_magnitude"] == report["logits_magnitude"]
    assert TOLERANCE < report["max_abs_logits_diff"] <= report["tolerance"] == record["atol"]
    assert record["atol"] == pytest.approx(RELATIVE_TOLERANCE * report["logits_magnitude"])
    assert logits_tolerance(manifest) == record["atol"]


def test_large_logits_pass_uses_the_rule(large_logits, tmp_path):
    from elx.exporter.export import apply_passes

    folder = apply_passes(large_logits, tmp_path / "el", "el")
    record = Manifest.load(folder).passes[0]
    assert record["tolerance"] == pytest.approx(RELATIVE_TOLERANCE * record["logits_magnitude"])
    assert record["max_abs_logits_diff"] <= record["tolerance"]


def test_large_logits_bar_still_refuses_a_wrong_graph(large_logits, tmp_path):
    """Scaled to the logits, the bar still refuses a decoder whose weights are off by 1e-4 relative."""
    from tests.test_compare import corrupt_initializers

    folder = tmp_path / "corrupt"
    shutil.copytree(large_logits, folder)
    assert corrupt_initializers(folder / "decoder.onnx", relative=1e-4) > 0
    report = verify_rewrite(Manifest.load(large_logits), Manifest.load(folder))
    assert report["max_abs_logits_diff"] > report["tolerance"] > TOLERANCE
    with pytest.raises(ElxError, match=r"exceeds \S+ \(the fp32 tolerance at max \|logit\| 2\.3\de\+03\)"):
        require_within_tolerance(report, "corrupted decoder")


def test_new_presets_have_published_dims():
    """The translation presets build the published architectures (configs only: no weights, no tokenizer)."""
    from elx.exporter.source.load import _config_class, _find_preset

    expected = {"mbart-large-50": ("MBartForConditionalGeneration", 250054, 1024, 12),
                "nllb-200-distilled-600m": ("M2M100ForConditionalGeneration", 256206, 1024, 12),
                "pegasus-large": ("PegasusForConditionalGeneration", 96103, 1024, 16),
                "fsmt-wmt19-en-de": ("FSMTForConditionalGeneration", 42024, 1024, 6),
                "marian-en-de": ("MarianMTModel", 58101, 512, 6)}
    for name, (architecture, vocab, d_model, layers) in expected.items():
        preset = _find_preset(name)
        assert preset["architecture"] == architecture
        config = _config_class(architecture)[1](**preset["config"])
        assert (config.vocab_size, config.d_model, config.decoder_layers) == (vocab, d_model, layers)
    assert _find_preset("facebook/nllb-200-distilled-600M")["name"] == "nllb-200-distilled-600m"


SMALL_PRESETS = ("t5-tiny", "t5-small", "whisper-tiny", "marian-en-de", "gpt2", "opt-125m", "bart-base",
                 "whisper-base", "t5-base", "flan-t5-base")


@pytest.mark.skipif(not LONG, reason="exports presets of up to 250M parameters; set ELX_LONG_TESTS=1")
@pytest.mark.parametrize("preset", SMALL_PRESETS)
def test_preset_exports(preset, tmp_path):
    from elx.exporter.export import export_model

    folder = export_model(preset, tmp_path / preset, random_init=True, quiet=True)
    verification = json.loads((folder / "manifest.json").read_text())["verification"]
    report = verification["export"]
    print(f"{preset}: max abs logits diff {report['max_abs_logits_diff']:.3g}, max |logit| "
          f"{report['logits_magnitude']:.4g}, tolerance {report['tolerance']:.3g}")
    assert report["max_abs_logits_diff"] <= report["tolerance"] == verification["tolerance"]["atol"]


def test_an_encoders_bar_is_its_own_fp32_error_times_the_multiple_never_below_the_logits_bar():
    """``tolerance_record``'s ``encoder_atol`` and ``elx compare``'s encoder check: the real whisper-base's encoder
    output is 2.4e-4 from fp64 in PyTorch fp32 itself while its logits' bar is 2.24e-4, so the logits' bar refused a
    correct export; the encoder's bar is NOISE_MULTIPLE x its own error, at least the logits' bar, and only the
    encoder's bar changes."""
    from types import SimpleNamespace

    from elx.exporter.verification.compare import CompareReport
    from elx.exporter.verification.fp32_noise import NOISE_MULTIPLE
    from elx.exporter.verification.verify import encoder_tolerance, tolerance_record

    def report(encoder):
        noise = {"max_torch_fp32_vs_fp64": 4.8e-5, "max_torch_fp32_vs_fp64_encoder": encoder}
        return {"tolerance": 2.24e-4, "shapes": [], "fp32_noise": noise}

    record = tolerance_record(58.6, report(2.43e-4))
    assert record["encoder_atol"] == pytest.approx(NOISE_MULTIPLE * 2.43e-4) and record["atol"] == pytest.approx(2.24e-4)
    assert tolerance_record(58.6, report(1e-6))["encoder_atol"] == record["atol"]  # never below the logits' bar
    assert "encoder_atol" not in tolerance_record(58.6, report(float("nan")))
    assert encoder_tolerance(SimpleNamespace(data={"verification": {"tolerance": record}})) == record["encoder_atol"]

    def compared(encoder_diff, encoder_atol):
        return CompareReport([], encoder_diff, None, None, {}, atol=record["atol"], encoder_atol=encoder_atol)

    assert compared(2.39e-4, record["encoder_atol"]).passed
    assert not compared(2.39e-4, None).passed  # the logits' bar alone: refused
    beyond = compared(1.5e-3, record["encoder_atol"])
    assert not beyond.passed and "encoder output max abs diff 0.0015 exceeds the tolerance 0.000972" in beyond.problems[0]
    assert not compared(float("nan"), record["encoder_atol"]).passed


class _Offset:
    """A side whose logits and encoder output are another side's plus fixed offsets (a fake fp32, fp64 or graphs
    side for ``_judged``: it reads ``spread``, the other rounding draws' worst, as ``RecordedSide`` has it)."""

    spread = None

    def __init__(self, side, logits: float = 0.0, encoder: float = 0.0):
        self.side, self.logits, self.encoder = side, logits, encoder

    def run(self, case, past):
        scores, encoder = self.side.run(case, past)
        return scores + np.float32(self.logits), encoder + np.float32(self.encoder)


def test_the_exports_verdict_judges_the_encoder_output_by_its_own_bar(large_logits):
    """An encoder output beyond its bar (NOISE_MULTIPLE x PyTorch fp32's own encoder error, at least the logits'
    bar) refuses the export even where every logit is within its bar; within it, the verdict is as before.  A
    pass's check (``measure`` with ``encoder_floor``) holds the encoder to at least the export's encoder bar."""
    from elx.exporter.verification.fp32_noise import NOISE_MULTIPLE
    from elx.exporter.verification.verify import (RuntimeSide, _judged, default_shapes, encoder_tolerance, measure,
                                                  worst_report)

    manifest = Manifest.load(large_logits)
    shapes = default_shapes(manifest)[:2]
    graphs = RuntimeSide(manifest)
    logits_bar = manifest.data["verification"]["tolerance"]["atol"]
    noise = 2 * logits_bar  # PyTorch fp32's own encoder error, made larger than the logits' bar
    fp64, fp32 = _Offset(graphs), _Offset(graphs, encoder=noise)

    within = _judged(fp32, fp64, _Offset(graphs, encoder=noise + 3 * noise), manifest, shapes, 0)
    assert within["encoder_tolerance"] == pytest.approx(NOISE_MULTIPLE * noise, rel=1e-3) and within["encoder_within"]
    assert within["within"] and within["fp32_noise"]["max_torch_fp32_vs_fp64_encoder"] == pytest.approx(noise, rel=1e-3)
    require_within_tolerance(within, "exported graphs vs PyTorch")

    beyond = _judged(fp32, fp64, _Offset(graphs, encoder=noise + 5 * noise), manifest, shapes, 0)
    assert beyond["max_abs_logits_diff"] <= beyond["tolerance"] and not beyond["encoder_within"]
    assert not beyond["within"]
    with pytest.raises(ElxError, match=r"encoder output's max abs diff \S+ exceeds \S+ \(its fp32 tolerance; "
                                       r"PyTorch's own fp32 encoder error is \S+\) although the logits are within"):
        require_within_tolerance(beyond, "exported graphs vs PyTorch")

    bar = encoder_tolerance(manifest)  # a pass: at least the export's encoder bar
    kept = measure(graphs, _Offset(graphs, encoder=0.5 * bar), manifest, shapes, encoder_floor=bar)
    moved = measure(graphs, _Offset(graphs, encoder=2 * bar), manifest, shapes, encoder_floor=bar)
    assert kept["within"] and not moved["within"] and moved["max_abs_logits_diff"] == 0.0
    assert not worst_report([kept, moved])["encoder_within"]  # the encoder's numbers from the run nearest its bar
    recorded = measure(graphs, _Offset(graphs, encoder=2 * bar), manifest, shapes)  # no floor: recorded, not judged
    assert recorded["within"] and "encoder_tolerance" not in recorded and recorded["max_abs_encoder_diff"] > bar
