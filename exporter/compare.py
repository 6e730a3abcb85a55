"""``elx compare``: HF ``generate`` in PyTorch against the elx runner on the same inputs.

Per returned sequence it reports whether the tokens are identical, the first generated step
where they diverge, and the max abs logits difference per step, measured by teacher-forcing both
models along HF's sequence (so the numbers exist even where the tokens diverge).  It also
reports the encoder output difference.

Two rules decide the verdict (``CompareReport.passed``, exit status 0 only when it holds):

* **Tokens.**  A row where elx differs from HF counts as a failure only when HF's own answer for
  that row is *stable*: HF ``generate`` gives the same row in eager attention fp32, sdpa
  attention fp32 and fp64 (and with the model's default attention, the run compared against).
  On peaked random models a near-tie can make HF's own tokens change between these; a difference
  from elx there proves nothing either way, so such rows are reported as *fragile*, separately,
  and not counted.
* **Numerics.**  The teacher-forced max abs logits difference (every row, every step) and the
  encoder output difference must be within ``atol`` (1e-4 in fp32, the export's own tolerance).
  A corrupted export can keep emitting HF's tokens on a random model; the logits give it away.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from runners.ngram_reference import block_ngrams
from exporter.sources import reload_model

from runners.generate import Generator
from runners.inputs import random_inputs
from runners.validation import check_encoder_inputs

from .families import hf_attention_applies
from .hf_decoding import hf_decoder_logits
from .verify import TOLERANCE

# HF configurations whose agreement makes a row "stable"; the model's default attention is checked as well
HF_VARIANTS = ("eager-fp32", "sdpa-fp32", "fp64")


@dataclass
class RowReport:
    item: int
    identical: bool
    first_divergence: int | None  # generated-token index, None when identical
    step_logits_diff: list = field(default_factory=list)
    hf_tokens: list = field(default_factory=list)
    elx_tokens: list = field(default_factory=list)
    # rows that differ: whether HF's own answer is the same in every HF_VARIANTS configuration (None: not checked)
    hf_stable: bool | None = None
    hf_variant_tokens: dict = field(default_factory=dict)  # variant -> that variant's tokens for this row

    @property
    def failure(self) -> bool:
        """A difference that counts: elx differs and HF's own answer is stable (or could not be checked)."""
        return not self.identical and self.hf_stable is not False

    @property
    def fragile(self) -> bool:
        """elx differs, but so do HF's own configurations: not counted either way."""
        return not self.identical and self.hf_stable is False


@dataclass
class CompareReport:
    rows: list
    encoder_diff: float | None  # None: the model has no encoder
    hf_seconds: float | None  # one warm run each; None when not timed
    elx_seconds: float | None
    settings: dict
    atol: float = TOLERANCE
    shape_identical: bool = True  # elx's output array has HF's shape
    hf_variants: tuple = ()  # the HF configurations run for the stability rule (empty: every row identical)

    @property
    def all_identical(self) -> bool:
        return self.shape_identical and all(r.identical for r in self.rows)

    @property
    def failures(self) -> list:
        return [r for r in self.rows if r.failure]

    @property
    def fragile(self) -> list:
        return [r for r in self.rows if r.fragile]

    @property
    def max_logits_diff(self) -> float:
        values = [d for r in self.rows for d in r.step_logits_diff]
        if any(math.isnan(d) for d in values):
            return math.nan
        return max(values, default=0.0)

    @property
    def logits_within_tolerance(self) -> bool:
        return self.max_logits_diff <= self.atol  # NaN fails

    @property
    def encoder_within_tolerance(self) -> bool:
        return self.encoder_diff is None or self.encoder_diff <= self.atol  # NaN fails; None: no encoder

    @property
    def width_mismatch(self) -> bool:
        """Every row has HF's tokens, yet elx's array has another shape (extra or missing padding columns)."""
        return not self.shape_identical and all(r.identical for r in self.rows)

    @property
    def problems(self) -> list[str]:
        """Why the comparison fails, one line each; empty when it passes."""
        out = []
        failures = self.failures
        if failures:
            out.append(f"{len(failures)} row(s) differ from HF generate where HF's own answer is stable "
                       f"(rows {', '.join(str(self.rows.index(r)) for r in failures)})")
        if self.width_mismatch:
            out.append(f"elx returned another array shape than HF generate with the same rows "
                       f"(extra or missing padding columns)")
        if not self.logits_within_tolerance:
            out.append(f"teacher-forced max abs logits diff {self.max_logits_diff:.3g} exceeds the tolerance "
                       f"{self.atol:g}: the export does not compute the model's logits")
        if not self.encoder_within_tolerance:
            out.append(f"encoder output max abs diff {self.encoder_diff:.3g} exceeds the tolerance {self.atol:g}: "
                       f"the export does not compute the model's encoder")
        return out

    @property
    def passed(self) -> bool:
        """No stable row differs and the numerics are within tolerance (``elx compare`` exits 0 exactly then)."""
        return not self.problems


def _torch_inputs(inputs: dict, dtype=torch.float32) -> dict:
    """numpy inputs → tensors; floating inputs (Whisper's features) in the model's dtype."""
    out = {}
    for key, value in inputs.items():
        tensor = torch.from_numpy(np.ascontiguousarray(value))
        out[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


def _hf_generate(model, inputs: dict, options: dict) -> np.ndarray:
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        out = model.generate(**_torch_inputs(inputs, dtype), **options)
    return out.numpy()


def hf_variant(model, name: str):
    """A copy of ``model`` in one of ``HF_VARIANTS``: attention implementation eager/sdpa in fp32, or fp64 (eager)."""
    attention, _, precision = name.rpartition("-")
    variant = copy.deepcopy(model)
    if precision == "fp64":
        attention = attention or "eager"
        variant = variant.double()
    else:
        variant = variant.float()
    variant.set_attn_implementation(attention)
    if variant.config._attn_implementation != attention:  # pragma: no cover - a model that cannot switch
        raise RuntimeError(f"{type(model).__name__} did not switch to {attention} attention")
    return variant.eval()


class HfVariants:
    """HF ``generate`` in each of ``HF_VARIANTS`` (copies of one model, built on first use and kept)."""

    def __init__(self, model):
        self.model = model
        self._models = {}

    def get(self, name: str):
        if name not in self._models:
            self._models[name] = hf_variant(self.model, name)
        return self._models[name]

    def generate(self, inputs: dict, options: dict) -> dict:
        """Each variant HF can run the model in (FSMT's own attention has no sdpa form)."""
        return {name: _hf_generate(self.get(name), inputs, options) for name in HF_VARIANTS
                if name == "fp64" or hf_attention_applies(self.model, name.rpartition("-")[0])}


def same_row(a, b, fill: int) -> bool:
    """Equal tokens, where one row may be longer only by ``fill`` padding (the batch's width depends on other rows)."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    if not np.array_equal(a[:n], b[:n]):
        return False
    return bool(np.all(a[n:] == fill) and np.all(b[n:] == fill))


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
        encoder_diff = float(np.abs(state.kept["encoder:last_hidden_state"] - encoder[::per_item].numpy()).max())
        if length < 2:  # nothing to teacher-force
            return np.zeros((rows, 0)), encoder_diff
        ref = hf_decoder_logits(model, encoder, rep.get("attention_mask"), torch.from_numpy(sequences[:, :-1]))
    if runner.returns_log_probs:
        ref = torch.log_softmax(ref, dim=-1)
    ref = ref.numpy()
    blocks = runner.plan.ngram_size if runner.returns_log_probs else 0
    diffs = []
    for t in range(length - 1):
        expected = block_ngrams(sequences[:, : t + 1], ref[:, t], blocks) if blocks else ref[:, t]
        both_inf = np.isneginf(expected) & np.isneginf(ort_steps[t])
        with np.errstate(invalid="ignore"):  # -inf - -inf, masked by both_inf
            diffs.append(np.where(both_inf, 0.0, np.abs(ort_steps[t] - expected)).max(axis=1))
    return np.stack(diffs, axis=1), encoder_diff


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def compare(folder, batch_size: int = 4, input_length: int = 32, seed: int = 0, threads: int | None = None,
            inputs: dict | None = None, atol: float = TOLERANCE, check_stability: bool = True,
            backend: str = "ort", device: str = "cpu", timed: bool = False, **options) -> CompareReport:
    """Compare the export in ``folder`` (run by ``backend`` on ``device``) with HF ``generate`` on the CPU
    (see the module docstring for the verdict); ``timed``: see ``compare_loaded``."""
    generator = Generator.from_folder(folder, backend=backend, device=device, threads=threads)
    model = reload_model(generator.manifest.data["source"])
    return compare_loaded(generator, model, batch_size=batch_size, input_length=input_length, seed=seed,
                          inputs=inputs, atol=atol, variants=HfVariants(model) if check_stability else None,
                          timed=timed, **options)


def compare_loaded(generator: Generator, model, batch_size: int = 4, input_length: int = 32, seed: int = 0,
                   inputs: dict | None = None, atol: float = TOLERANCE, variants: HfVariants | None = None,
                   timed: bool = False, **options) -> CompareReport:
    """``compare`` with the runner and the PyTorch model already loaded (callers that compare many times).

    ``variants`` (built on ``model``) runs the stability rule on rows that differ; None skips it
    (differing rows then count as failures).  ``timed``: after the compared runs (the warm-ups), one
    more run of each is timed for the report's speed line; otherwise the report has no timings.
    """
    settings = generator.settings(**options)
    rules = generator.rules
    hf_options = rules.hf_options(generator.manifest, {k: v for k, v in options.items() if v is not None})
    if inputs is None:
        inputs = random_inputs(generator.manifest, batch_size, input_length, np.random.default_rng(seed))
    check_encoder_inputs(generator.manifest, inputs)  # before HF sees them (torch fails with a traceback)
    hf = _hf_generate(model, inputs, hf_options)  # the compared runs double as warm-ups ...
    out = generator.generate(inputs, settings=settings)
    hf_seconds = elx_seconds = None
    if timed:  # ... of one timed warm run each
        hf_seconds = _seconds(lambda: _hf_generate(model, inputs, hf_options))
        elx_seconds = _seconds(lambda: generator.generate(inputs, settings=settings))
    elx = out.sequences  # HF's layout for the family
    per_item = rules.rows_per_input(settings)
    # where HF's layout keeps the decoder prompt, divergence is counted from the first generated token
    prompt_len = rules.prompt(inputs, settings).shape[1] if out.sequences is out.raw_sequences else 0
    forced = rules.full_sequences(hf, settings)
    if generator.manifest.data.get("is_encoder_decoder", True):
        diffs, encoder_diff = teacher_forced_diffs(generator, model, inputs, forced, per_item,
                                                   settings.no_repeat_ngram_size)
    else:  # no encoder: the prompt's own logits are the first step's
        from .compare_decoder_only import decoder_only_teacher_forced

        diffs, encoder_diff = decoder_only_teacher_forced(generator, model, inputs, forced, per_item)
    fill = rules.output_fill(settings)
    rows = []
    for r in range(hf.shape[0]):
        a, b = hf[r], elx[r] if r < elx.shape[0] else np.array([], dtype=np.int64)
        same = same_row(a, b, fill)
        rows.append(RowReport(r // per_item, same, None if same else _first_divergence(a, b, prompt_len),
                              [float(x) for x in diffs[r]], a.tolist(), b.tolist()))
    differing = [r for r, row in enumerate(rows) if not row.identical]
    checked = ()
    if differing and variants is not None:
        outputs = variants.generate(inputs, hf_options)
        checked = tuple(outputs)
        for r in differing:
            row = rows[r]
            row.hf_variant_tokens = {name: tokens[r].tolist() if r < tokens.shape[0] else []
                                     for name, tokens in outputs.items()}
            row.hf_stable = all(same_row(hf[r], tokens, fill) for tokens in row.hf_variant_tokens.values())
    return CompareReport(rows, encoder_diff, hf_seconds, elx_seconds,
                         {k: getattr(settings, k) for k in ("num_beams", "num_return_sequences", "no_repeat_ngram_size",
                                                            "length_penalty", "early_stopping", "max_new_tokens",
                                                            "min_new_tokens")},
                         atol=atol, shape_identical=elx.shape == hf.shape, hf_variants=checked)


def _row_status(row: RowReport) -> str:
    if row.identical:
        return "identical"
    where = f"first divergence at generated step {row.first_divergence}"
    if row.hf_stable is None:
        return f"DIFFERENT ({where}; HF stability not checked): FAILURE"
    if row.hf_stable:
        return f"DIFFERENT ({where}; HF stable: {' = '.join(HF_VARIANTS)}): FAILURE"
    disagree = [name for name, tokens in row.hf_variant_tokens.items() if tokens != row.hf_tokens]
    return (f"different ({where}) but FRAGILE: HF's own answer changes ({', '.join(disagree)} differ from HF's "
            f"default); not counted")


def format_report(report: CompareReport, passes: list) -> str:
    lines = [f"passes: {', '.join(passes) or 'none (baseline)'}; settings: {report.settings}",
             "no encoder (decoder-only model)" if report.encoder_diff is None
             else f"encoder output max abs diff: {report.encoder_diff:.2e}"]
    for i, row in enumerate(report.rows):
        worst = max(row.step_logits_diff) if row.step_logits_diff else 0.0
        steps = " ".join(f"{d:.1e}" for d in row.step_logits_diff)
        lines.append(f"row {i} (input {row.item}): {_row_status(row)}; {len(row.hf_tokens)} tokens; "
                     f"max abs logits diff {worst:.2e}; per step: {steps}")
    same = sum(r.identical for r in report.rows)
    fragile, failures = len(report.fragile), len(report.failures)
    lines.append(f"{same}/{len(report.rows)} sequences identical to HF generate; {failures} stable difference(s) "
                 f"(failures), {fragile} fragile (HF's own eager fp32 / sdpa fp32 / fp64 disagree; not counted)"
                 + ("" if report.hf_seconds is None else
                    f"; speed, one warm run each (after a warm-up): HF {report.hf_seconds:.2f} s, elx "
                    f"{report.elx_seconds:.2f} s ({report.hf_seconds / max(report.elx_seconds, 1e-9):.2f}x; elx bench "
                    f"measures with repeats)"))
    numerics = "within" if report.logits_within_tolerance and report.encoder_within_tolerance else "OUTSIDE"
    lines.append(f"numerics {numerics} tolerance {report.atol:g}: teacher-forced max abs logits diff "
                 f"{report.max_logits_diff:.2e}" + ("" if report.encoder_diff is None
                                                     else f", encoder {report.encoder_diff:.2e}"))
    problems = report.problems
    lines.append("PASS" if not problems else "FAIL: " + "; ".join(problems))
    return "\n".join(lines)
