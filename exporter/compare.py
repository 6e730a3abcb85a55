"""``elx compare``: HF ``generate`` in PyTorch against the elx runner on the same inputs.

Per returned sequence it reports whether the tokens are identical, the first generated step
where they diverge, and the max abs logits difference per step, measured by teacher-forcing both
models along HF's sequence (so the numbers exist even where the tokens diverge).  It also
reports the encoder output difference.  Exit status 0 only when every sequence is identical.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from runners.ngram_reference import block_ngrams
from exporter.sources import reload_model

from runners.generate import Generator
from runners.inputs import random_inputs
from runners.validation import check_encoder_inputs


@dataclass
class RowReport:
    item: int
    identical: bool
    first_divergence: int | None  # generated-token index, None when identical
    step_logits_diff: list = field(default_factory=list)
    hf_tokens: list = field(default_factory=list)
    elx_tokens: list = field(default_factory=list)


@dataclass
class CompareReport:
    rows: list
    encoder_diff: float
    hf_seconds: float
    elx_seconds: float
    settings: dict

    @property
    def all_identical(self) -> bool:
        return all(r.identical for r in self.rows)


def _hf_generate(model, inputs: dict, options: dict) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(**{k: torch.from_numpy(v) for k, v in inputs.items()}, **options)
    return out.numpy()


def _first_divergence(a: np.ndarray, b: np.ndarray, prompt_len: int) -> int | None:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size:
        return int(diff[0]) - prompt_len
    return None if len(a) == len(b) else n - prompt_len


def teacher_forced_diffs(generator: Generator, model, inputs: dict, sequences: np.ndarray, per_item: int,
                         no_repeat_ngram_size: int = 0):
    """Max abs logits diff per (row, step) along ``sequences`` ([items·per_item, T]), and the encoder diff.

    When the run reads the step graph's blocked log-probs (the ``ngram`` pass with the run's
    n-gram size), the PyTorch logits go through log-softmax and the reference blocking first;
    equal −inf entries count as equal.
    """
    runner = generator.model.for_run(no_repeat_ngram_size)
    state = runner.encode(inputs)
    rows, length = sequences.shape
    cache = runner.empty_cache(rows)
    ort_steps = []
    for t in range(length - 1):
        history = np.ascontiguousarray(sequences[:, : t + 1]) if runner.needs_history else None
        logits, cache = runner.step(np.ascontiguousarray(sequences[:, t: t + 1]), state, cache, history)
        ort_steps.append(logits)
    rep = {k: torch.from_numpy(np.repeat(v, per_item, axis=0)) for k, v in inputs.items()}
    with torch.no_grad():
        encoder = model.get_encoder()(**rep).last_hidden_state
        ref = model(encoder_outputs=(encoder,), attention_mask=rep.get("attention_mask"),
                    decoder_input_ids=torch.from_numpy(sequences[:, :-1])).logits
    if runner.returns_log_probs:
        ref = torch.log_softmax(ref, dim=-1)
    ref = ref.numpy()
    blocks = runner.plan.ngram_size if runner.returns_log_probs else 0
    diffs = []
    for t in range(length - 1):
        expected = block_ngrams(sequences[:, : t + 1], ref[:, t], blocks) if blocks else ref[:, t]
        both_inf = np.isneginf(expected) & np.isneginf(ort_steps[t])
        diffs.append(np.where(both_inf, 0.0, np.abs(ort_steps[t] - expected)).max(axis=1))
    encoder_ort = state.kept["encoder:last_hidden_state"]
    encoder_diff = float(np.abs(encoder_ort - encoder[::per_item].numpy()).max())
    return np.stack(diffs, axis=1), encoder_diff


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def compare(folder, batch_size: int = 4, input_length: int = 32, seed: int = 0, threads: int | None = None,
            inputs: dict | None = None, **options) -> CompareReport:
    generator = Generator.from_folder(folder, threads=threads)
    settings = generator.settings(**options)
    rules = generator.rules
    hf_options = rules.hf_options(generator.manifest, {k: v for k, v in options.items() if v is not None})
    model = reload_model(generator.manifest.data["source"])
    if inputs is None:
        inputs = random_inputs(generator.manifest, batch_size, input_length, np.random.default_rng(seed))
    check_encoder_inputs(generator.manifest, inputs)  # before HF sees them (torch fails with a traceback)
    hf = _hf_generate(model, inputs, hf_options)  # the compared runs double as warm-ups ...
    out = generator.generate(inputs, settings=settings)
    hf_seconds = _seconds(lambda: _hf_generate(model, inputs, hf_options))  # ... of one timed warm run each
    elx_seconds = _seconds(lambda: generator.generate(inputs, settings=settings))
    elx = out.sequences  # HF's layout for the family
    per_item = rules.rows_per_input(settings)
    # where HF's layout keeps the decoder prompt, divergence is counted from the first generated token
    prompt_len = len(settings.prompt()) if out.sequences is out.raw_sequences else 0
    forced = rules.full_sequences(hf, settings)
    diffs, encoder_diff = teacher_forced_diffs(generator, model, inputs, forced, per_item,
                                               settings.no_repeat_ngram_size)
    rows = []
    for r in range(hf.shape[0]):
        a, b = hf[r], elx[r] if r < elx.shape[0] else np.array([], dtype=np.int64)
        same = a.shape == b.shape and bool(np.array_equal(a, b))
        rows.append(RowReport(r // per_item, same, None if same else _first_divergence(a, b, prompt_len),
                              [float(x) for x in diffs[r]], a.tolist(), b.tolist()))
    if elx.shape != hf.shape:  # different lengths make every row differ in shape: flag it on all rows
        for row in rows:
            row.identical = False
    return CompareReport(rows, encoder_diff, hf_seconds, elx_seconds,
                         {k: getattr(settings, k) for k in ("num_beams", "num_return_sequences", "no_repeat_ngram_size",
                                                            "length_penalty", "early_stopping", "max_new_tokens",
                                                            "min_new_tokens")})


def format_report(report: CompareReport, passes: list) -> str:
    lines = [f"passes: {', '.join(passes) or 'none (baseline)'}; settings: {report.settings}",
             f"encoder output max abs diff: {report.encoder_diff:.2e}"]
    for i, row in enumerate(report.rows):
        worst = max(row.step_logits_diff) if row.step_logits_diff else 0.0
        status = "identical" if row.identical else f"DIFFERENT (first divergence at generated step {row.first_divergence})"
        steps = " ".join(f"{d:.1e}" for d in row.step_logits_diff)
        lines.append(f"row {i} (input {row.item}): {status}; {len(row.hf_tokens)} tokens; "
                     f"max abs logits diff {worst:.2e}; per step: {steps}")
    same = sum(r.identical for r in report.rows)
    lines.append(f"{same}/{len(report.rows)} sequences identical to HF generate; "
                 f"speed, one warm run each (after a warm-up): HF {report.hf_seconds:.2f} s, "
                 f"elx {report.elx_seconds:.2f} s ({report.hf_seconds / max(report.elx_seconds, 1e-9):.2f}x; "
                 f"elx bench measures with repeats)")
    return "\n".join(lines)
