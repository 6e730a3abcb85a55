"""Token-identical generation against HF generate (fp32), for T5 and BART, baseline and ``el``."""
from __future__ import annotations

import numpy as np
import pytest

from elx.exporter.verification.compare import compare

SETTINGS = [
    dict(max_new_tokens=12),  # greedy (num_beams defaults to 1)
    dict(num_beams=1, max_new_tokens=9, no_repeat_ngram_size=3),
    dict(num_beams=2, max_new_tokens=10),
    dict(num_beams=4, num_return_sequences=3, max_new_tokens=10),
    dict(num_beams=4, no_repeat_ngram_size=2, max_new_tokens=12),
    dict(num_beams=4, no_repeat_ngram_size=3, length_penalty=0.6, early_stopping=True, max_new_tokens=12),
    dict(num_beams=3, early_stopping="never", length_penalty=1.5, max_new_tokens=8),
    dict(num_beams=2, min_new_tokens=6, max_new_tokens=10),
]


def _check(report):
    assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]
    worst = max(max(r.step_logits_diff) for r in report.rows)
    assert worst <= 1e-4
    assert report.encoder_diff <= 1e-4


@pytest.mark.parametrize("family", ["t5", "bart"])
@pytest.mark.parametrize("passes", [None, "el"])
@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_identical_to_hf(exported, family, passes, options):
    report = compare(exported(family, passes), batch_size=3, input_length=11, seed=1, **options)
    assert len(report.rows) == 3 * options.get("num_return_sequences", 1)
    _check(report)


def _frequent_token(folder) -> int:
    """A token the random model likes to emit, used as EOS so that hypotheses finish at different steps."""
    report = compare(folder, batch_size=3, input_length=11, seed=1, max_new_tokens=12)
    generated = np.concatenate([np.asarray(r.hf_tokens[1:]) for r in report.rows])
    values, counts = np.unique(generated, return_counts=True)
    return int(values[np.argmax(counts)])


@pytest.mark.parametrize("family", ["t5", "bart"])
@pytest.mark.parametrize("passes", [None, "el"])
def test_identical_with_early_eos(exported, family, passes):
    folder = exported(family, passes)
    eos = _frequent_token(folder)
    finished_early = False
    for options in (dict(max_new_tokens=12), dict(num_beams=4, num_return_sequences=2, max_new_tokens=12),
                    dict(num_beams=3, early_stopping=True, length_penalty=2.0, max_new_tokens=12),
                    dict(num_beams=3, early_stopping="never", max_new_tokens=12)):
        report = compare(folder, batch_size=3, input_length=11, seed=1, eos_token_id=eos, **options)
        _check(report)
        finished_early |= any(len(r.hf_tokens) < 13 or eos in r.hf_tokens[1:] for r in report.rows)
    assert finished_early  # the test really exercised finished hypotheses
