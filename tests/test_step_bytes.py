"""Bytes each decoder step moves between host and device today (issue 26, item 2's "before").

The runner's search runs on the host: every step the device backend (ort-io, here on the CPU EP through
the code that runs on CUDA) returns the whole logits tensor [rows, vocab] float32 to the host, and the host
sends the step's token ids [rows, 1] int64 and, after a beam step, the parent rows (int64) once per cache
entry for the reorder.  The cache and the per-input state stay on the device.  These tests pin that
traffic exactly (tests/counting_backend.py counts it); a device-resident search changes the d2h term to
O(rows · k), and these numbers with it.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from elx.runners.generate import Generator
from tests.counting_backend import D2H, H2D, count_crossings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH, NEW = 3, 5
# t5-tiny's EOS (1) suppressed until the last token: every item runs NEW steps, no item leaves the batch
FORCED = dict(max_new_tokens=NEW, min_new_tokens=NEW)


def _inputs():
    rng = np.random.default_rng(0)
    return {"input_ids": rng.integers(2, 128, size=(BATCH, 7)), "attention_mask": np.ones((BATCH, 7), np.int64)}


def _counted(exported, model_folders, **options):
    generator = Generator.from_folder(exported("t5"), backend="ort-io", device="cpu", threads=1)
    counting = count_crossings(generator)
    out = generator.generate(_inputs(), track_memory=True, decode=False, **FORCED, **options)
    vocab = json.loads((model_folders["t5"] / "config.json").read_text())["vocab_size"]  # the HF model's
    return counting, out, generator.model.plan, vocab


def test_greedy_step_moves_the_logits_down_and_the_tokens_up(exported, model_folders):
    counting, out, plan, vocab = _counted(exported, model_folders, num_beams=1)
    assert len(counting.steps) == out.steps == NEW
    for step, memory in zip(counting.steps, out.memory):
        rows = memory["rows"]
        assert rows == BATCH
        assert [(c.what, c.nbytes) for c in step.of(D2H)] == [(f"output:{plan.logits}", rows * vocab * 4)]
        assert [(c.what, c.nbytes) for c in step.of(H2D)] == [(f"feed:{plan.token_input}", rows * 8)]
    # before the first step: the encoder inputs and the empty cache (0 bytes) went down, and the encoder
    # output came up once (kept on the host for elx compare: runners/plan.py KEPT) [batch, source, d_model]
    config = json.loads((model_folders["t5"] / "config.json").read_text())
    inputs = _inputs()
    assert counting.phases[0].bytes(H2D) == sum(a.nbytes for a in inputs.values())
    assert [(c.what, c.nbytes) for c in counting.phases[0].of(D2H)] == [
        ("to_host", inputs["input_ids"].size * config["d_model"] * 4)]


def test_beam_step_moves_the_logits_down_and_tokens_and_parent_rows_up(exported, model_folders):
    beams = 4
    counting, out, plan, vocab = _counted(exported, model_folders, num_beams=beams)
    entries = len(plan.cache)
    rows = BATCH * beams
    assert len(counting.steps) == out.steps == NEW
    assert [m["rows"] for m in out.memory] == [rows] * NEW
    reorders = []
    for i, step in enumerate(counting.steps):
        assert [(c.what, c.nbytes) for c in step.of(D2H)] == [(f"output:{plan.logits}", rows * vocab * 4)]
        up = [(c.what, c.nbytes) for c in step.of(H2D)]
        assert up[0] == (f"feed:{plan.token_input}", rows * 8)
        # a reorder sends the parent rows once per cache entry; an identity reorder is skipped; the last step has none
        moved = up[1:]
        assert moved in ([], [("rows", rows * 8)] * entries)
        reorders.append(bool(moved))
        expected = rows * vocab * 4 + rows * 8 + (entries * rows * 8 if moved else 0)
        assert step.bytes(D2H) + step.bytes(H2D) == expected
    # step 1: every beam but the first starts at -1e9, so all candidates come from beam 0 (a real reorder)
    assert reorders[0] and not reorders[-1]
    # the logits are the O(rows · vocab) term a device-resident search removes
    assert all(step.bytes(D2H) / rows == vocab * 4 for step in counting.steps)


def test_the_host_backend_cannot_be_counted(exported):
    from tests.counting_backend import CountingBackend

    generator = Generator.from_folder(exported("t5"), backend="ort", device="cpu", threads=1)
    with pytest.raises(ValueError, match="host arrays"):
        CountingBackend(generator.model.backend, generator.model.plan.step.name)
