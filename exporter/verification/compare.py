"""``elx compare``: HF ``generate`` in PyTorch against the elx runner on the same inputs.

Per returned sequence it reports whether the tokens are identical, the first generated step
where they diverge, and the max abs logits difference per step, measured by teacher-forcing both
models along HF's sequence (so the numbers exist even where the tokens diverge).  It also
reports the encoder output difference.

Two rules decide the verdict (``CompareReport.passed``, exit status 0 only when it holds):

* **Tokens.**  A row where elx differs from HF counts as a failure only when HF's own answer for
  that row is *stable* (``exporter/verification/stability.py``, the rule the differential test shares): HF's
  configurations agree (eager fp32, sdpa fp32, fp64), the input alone gives the same answer, and
  HF's answer survives perturbations of its logits as large as the export's measured teacher-forced
  error.  Other differing rows are *fragile*: reported with their margin, not counted.
* **Numerics.**  The teacher-forced max abs logits difference (every row, every step) and the
  encoder output difference must be within ``atol``, by default the export's own tolerance
  (``export_tolerance``: 1e-4 in fp32; an fp16 export's D·u relative to max |logit|; an int8 export's
  recorded figures, ``exporter/precision/int8_check.py``).
  A corrupted export can keep emitting HF's tokens on a random model; the logits give it away.

An int8 export is judged against what it recorded at export (``exporter/precision/int8_check.py``): differing
rows are not failures one by one (no stability rule); the share of identical rows and the top-1 agreement
along HF's tokens fail only where they are worse than recorded.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from elx.runners.search.ngram_reference import block_ngrams
from elx.exporter.memory import release_memory, return_free_pages
from elx.exporter.source.load import reload_model

from elx.runners.generate import Generator
from elx.runners.inputs.random_inputs import random_inputs
from elx.runners.inputs.validation import check_encoder_inputs

from elx.exporter.verification.hf_reference import hf_generate as _hf_generate
from elx.exporter.verification.stability import HF_VARIANTS, HfVariants, RowStability, check_rows, epsilon_of, hf_variant, same_row  # noqa: F401
from elx.exporter.verification.hf_decoding import hf_decoder_logits
from elx.exporter.verification.verify import TOLERANCE, encoder_tolerance, logits_tolerance


@dataclass
class RowReport:
    item: int
    identical: bool
    first_divergence: int | None  # generated-token index, None when identical
    step_logits_diff: list = field(default_factory=list)
    hf_tokens: list = field(default_factory=list)
    elx_tokens: list = field(default_factory=list)
    stability: RowStability | None = None  # rows that differ: the stability rule's findings (None: not checked)
    step_top1: list = field(default_factory=list)  # per step: elx's top token is PyTorch's (along HF's tokens)

    @property
    def hf_stable(self) -> bool | None:
        """Whether HF's own answer for this row is stable (``exporter/verification/stability.py``); None: not checked."""
        return None if self.stability is None else self.stability.stable

    @property
    def hf_variant_tokens(self) -> dict:
        return {} if self.stability is None else self.stability.variant_tokens

    @property
    def failure(self) -> bool:
        """A difference that counts: elx differs and HF's own answer is stable (or could not be checked)."""
        return not self.identical and self.hf_stable is not False

    @property
    def fragile(self) -> bool:
        """elx differs, but HF's own answer is not stable there: not counted either way."""
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
    agreement: object = None  # an int8 export: elx.exporter.precision.int8_check.Agreement (rows judged together)
    encoder_atol: float | None = None  # the encoder output's bar (``verify.encoder_tolerance``); None: ``atol``

    @property
    def all_identical(self) -> bool:
        return self.shape_identical and all(r.identical for r in self.rows)

    @property
    def failures(self) -> list:
        if self.agreement is not None:  # int8: differing rows are judged by the agreement rule, not one by one
            return []
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
    def encoder_bar(self) -> float:
        return self.atol if self.encoder_atol is None else self.encoder_atol

    @property
    def encoder_within_tolerance(self) -> bool:
        return self.encoder_diff is None or self.encoder_diff <= self.encoder_bar  # NaN fails; None: no encoder

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
            out.append("elx returned another array shape than HF generate with the same rows "
                       "(extra or missing padding columns)")
        if not self.logits_within_tolerance:
            out.append(f"teacher-forced max abs logits diff {self.max_logits_diff:.3g} exceeds the tolerance "
                       f"{self.atol:g}: the export does not compute the model's logits")
        if not self.encoder_within_tolerance:
            out.append(f"encoder output max abs diff {self.encoder_diff:.3g} exceeds the tolerance {self.encoder_bar:g}: "
                       f"the export does not compute the model's encoder")
        if self.agreement is not None:
            out.extend(self.agreement.problems)
        return out

    @property
    def passed(self) -> bool:
        """No stable row differs and the numerics are within tolerance (``elx compare`` exits 0 exactly then)."""
        return not self.problems


def _first_divergence(a: np.ndarray, b: np.ndarray, prompt_len: int) -> int | None:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size:
        return int(diff[0]) - prompt_len
    return None if len(a) == len(b) else n - prompt_len


def teacher_forced_steps(generator: Generator, model, inputs: dict, sequences: np.ndarray, per_item: int,
                         no_repeat_ngram_size: int = 0):
    """Both sides' scores per step along ``sequences`` ([items·per_item, T]): elx's and PyTorch's, each a list of
    [rows, vocab] arrays (one per step), and the encoder diff.

    When the run reads the step graph's blocked log-probs (the ``ngram`` pass with the run's
    n-gram size), the PyTorch logits go through log-softmax and the reference blocking first.
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
            return [], [], encoder_diff
        ref = hf_decoder_logits(model, encoder, rep.get("attention_mask"), torch.from_numpy(sequences[:, :-1]))
    if runner.returns_log_probs:
        ref = torch.log_softmax(ref, dim=-1)
    ref = ref.numpy()
    blocks = runner.plan.ngram_size if runner.returns_log_probs else 0
    expected = [block_ngrams(sequences[:, : t + 1], ref[:, t], blocks) if blocks else ref[:, t]
                for t in range(length - 1)]
    return ort_steps, expected, encoder_diff


def step_diffs(ours: list, expected: list, rows: int) -> np.ndarray:
    """Max abs difference per (row, step); equal −inf entries count as equal."""
    diffs = []
    for got, want in zip(ours, expected):
        both_inf = np.isneginf(want) & np.isneginf(got)
        with np.errstate(invalid="ignore"):  # -inf - -inf, masked by both_inf
            diffs.append(np.where(both_inf, 0.0, np.abs(got - want)).max(axis=1))
    return np.stack(diffs, axis=1) if diffs else np.zeros((rows, 0))


def step_top1(ours: list, expected: list, rows: int) -> np.ndarray:
    """Per (row, step): whether both sides' highest-scoring token is the same."""
    same = [np.argmax(got, axis=1) == np.argmax(want, axis=1) for got, want in zip(ours, expected)]
    return np.stack(same, axis=1) if same else np.zeros((rows, 0), dtype=bool)


def export_tolerance(manifest) -> float:
    """The default ``atol``: the export's own tolerance.  fp32: ``logits_tolerance`` (1e-4, or 64 ulps of the
    largest logit the export's verification measured where that is more).  int8: ``logits_bound`` of
    ``exporter/precision/int8_check.py`` (the recorded figures).  fp16: the manifest's fp16
    rule (``exporter/precision/fp16_check.py``: D·u relative to max |logit|) as the absolute bound the export's final
    fp16 check applied, ``relative_tolerance × max_abs_reference`` of ``verification.fp16`` (runtime mode)."""
    precision = manifest.data.get("precision", "fp32")
    if precision == "fp32":
        return logits_tolerance(manifest)
    if precision == "int8":
        from elx.exporter.precision.int8_check import logits_bound

        return logits_bound(manifest)
    check = manifest.data["verification"]["fp16"]["runtime"]
    return float(check["relative_tolerance"] * check["max_abs_reference"])


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def compare(folder, batch_size: int = 4, input_length: int = 32, seed: int = 0, threads: int | None = None,
            inputs: dict | None = None, atol: float | None = None, check_stability: bool = True,
            backend: str = "ort", device: str = "cpu", timed: bool = False, model=None, **options) -> CompareReport:
    """Compare the export in ``folder`` (run by ``backend`` on ``device``) with HF ``generate`` on the CPU
    (see the module docstring for the verdict); ``timed``: see ``compare_loaded``.  ``model``: where the source
    model is now (an HF folder or GGUF file), when it moved from the path the manifest records."""
    generator = Generator.from_folder(folder, backend=backend, device=device, threads=threads)
    source = generator.manifest.data["source"]
    if model is not None:
        from elx.exporter.source.locate import relocated_source

        source = relocated_source(source, model, generator.manifest.family)
    model = reload_model(source)
    return compare_loaded(generator, model, batch_size=batch_size, input_length=input_length, seed=seed,
                          inputs=inputs, atol=atol, variants=HfVariants(model) if check_stability else None,
                          timed=timed, **options)


def compare_loaded(generator: Generator, model, batch_size: int = 4, input_length: int = 32, seed: int = 0,
                   inputs: dict | None = None, atol: float | None = None, variants: HfVariants | None = None,
                   timed: bool = False, **options) -> CompareReport:
    """``compare`` with the runner and the PyTorch model already loaded (callers that compare many times).

    ``atol`` None: the export's own tolerance (``export_tolerance``).  ``variants`` (built on ``model``) runs
    the stability rule on rows that differ; None skips it (differing rows then count as failures).
    ``timed``: after the compared runs (the warm-ups), one more run of each is timed (``hf_seconds``,
    ``elx_seconds``: one run each, no ratio is printed; ``elx bench`` measures speed with repeats).
    """
    # an int8 export is judged against the agreement it recorded (none yet while the export records it)
    data = generator.manifest.data
    int8 = data.get("precision") == "int8" and "int8" in data.get("verification", {})
    # the encoder's own bar where the export measured PyTorch fp32's encoder error (fp32 exports, default atol)
    encoder_atol = encoder_tolerance(generator.manifest) if atol is None and data.get("precision", "fp32") == "fp32" \
        else None
    atol = export_tolerance(generator.manifest) if atol is None else atol
    if int8:
        variants = None  # rows are judged together against the recorded agreement
    settings = generator.settings(**options)
    rules = generator.rules
    hf_options = rules.hf_options(generator.manifest, {k: v for k, v in options.items() if v is not None})
    own_draw = inputs is None
    if own_draw:
        inputs = random_inputs(generator.manifest, batch_size, input_length, np.random.default_rng(seed))
    check_encoder_inputs(generator.manifest, inputs)  # before HF sees them (torch fails with a traceback)
    hf = _hf_generate(model, inputs, hf_options)  # the compared runs double as warm-ups ...
    release_memory()  # each run's freed memory back before the next allocates (exporter/memory.py; the int8
    # export's recorded agreement, two searches of each side beside HF's model, peaked above its bound without)
    out = generator.generate(inputs, settings=settings)
    release_memory()
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
        ours, expected, encoder_diff = teacher_forced_steps(generator, model, inputs, forced, per_item,
                                                            settings.no_repeat_ngram_size)
        diffs, top1 = step_diffs(ours, expected, forced.shape[0]), step_top1(ours, expected, forced.shape[0])
    else:  # no encoder: the prompt's own logits are the first step's
        from elx.exporter.verification.compare_decoder_only import decoder_only_teacher_forced

        diffs, top1, encoder_diff = decoder_only_teacher_forced(generator, model, inputs, forced, per_item)
    return_free_pages()
    fill = rules.output_fill(settings)
    rows = []
    for r in range(hf.shape[0]):
        a, b = hf[r], elx[r] if r < elx.shape[0] else np.array([], dtype=np.int64)
        same = same_row(a, b, fill)
        rows.append(RowReport(r // per_item, same, None if same else _first_divergence(a, b, prompt_len),
                              [float(x) for x in diffs[r]], a.tolist(), b.tolist(),
                              step_top1=[bool(x) for x in top1[r]]))
    differing = [r for r, row in enumerate(rows) if not row.identical]
    checked = ()
    if differing and variants is not None:
        measured = [d for row in rows for d in row.step_logits_diff]  # as CompareReport.max_logits_diff
        epsilon = epsilon_of(math.nan if any(map(math.isnan, measured)) else max(measured, default=0.0), atol)
        found = check_rows(generator, variants, inputs, hf, hf_options, settings, differing, epsilon)
        checked = HF_VARIANTS
        for r, stability in found.items():
            rows[r].stability = stability
    report = CompareReport(rows, encoder_diff, hf_seconds, elx_seconds,
                           {k: getattr(settings, k) for k in ("num_beams", "num_return_sequences",
                                                              "no_repeat_ngram_size", "length_penalty", "early_stopping",
                                                              "max_new_tokens", "min_new_tokens")},
                           atol=atol, shape_identical=elx.shape == hf.shape, hf_variants=checked,
                           encoder_atol=encoder_atol)
    if int8:
        from elx.exporter.precision.int8_check import judge

        drawn = {"seed": seed, "batch_size": batch_size, "input_length": input_length} if own_draw else {}
        report.agreement = judge(generator.manifest, report, {**drawn, "num_beams": settings.num_beams,
                                                              "max_new_tokens": settings.max_new_tokens})
    return report


def _row_status(row: RowReport, int8: bool = False) -> str:
    if row.identical:
        return "identical"
    where = f"first divergence at generated step {row.first_divergence}"
    if int8:
        return f"different ({where}; an int8 export: rows are judged together, below)"
    found = row.stability
    if found is None:
        return f"DIFFERENT ({where}; HF stability not checked): FAILURE"
    if found.search_agrees is False:
        return (f"DIFFERENT ({where}; elx's search on HF's float64 logits differs from HF's float64 generate: a "
                f"search bug): FAILURE")
    if found.stable:
        survives = ("" if found.survives is None else
                    f", survives logits perturbations of ±ε = {found.epsilon:.1e}, {found.margin_text()}")
        return (f"DIFFERENT ({where}; HF stable: {' = '.join(HF_VARIANTS)} = the input alone{survives}): FAILURE")
    margin = "" if found.survives is None else f"; {found.margin_text()}"
    return f"different ({where}) but FRAGILE: {'; '.join(found.reasons)}{margin}; not counted"


def format_report(report: CompareReport, passes: list) -> str:
    lines = [f"passes: {', '.join(passes) or 'none (baseline)'}; settings: {report.settings}",
             "no encoder (decoder-only model)" if report.encoder_diff is None
             else f"encoder output max abs diff: {report.encoder_diff:.2e}"]
    for i, row in enumerate(report.rows):
        worst = max(row.step_logits_diff) if row.step_logits_diff else 0.0
        steps = " ".join(f"{d:.1e}" for d in row.step_logits_diff)
        lines.append(f"row {i} (input {row.item}): {_row_status(row, report.agreement is not None)}; {len(row.hf_tokens)} tokens; "
                     f"max abs logits diff {worst:.2e}; per step: {steps}")
    same = sum(r.identical for r in report.rows)
    fragile, failures = len(report.fragile), len(report.failures)
    if report.agreement is not None:
        lines.append(f"{same}/{len(report.rows)} sequences identical to HF generate (an int8 export: judged against "
                     "its recorded agreement, below)")
    else:
        lines.append(f"{same}/{len(report.rows)} sequences identical to HF generate; {failures} stable difference(s) "
                     f"(failures), {fragile} fragile (HF's own answer not stable there; not counted)")
    numerics = "within" if report.logits_within_tolerance and report.encoder_within_tolerance else "OUTSIDE"
    lines.append(f"numerics {numerics} tolerance {report.atol:g}: teacher-forced max abs logits diff "
                 f"{report.max_logits_diff:.2e}" + ("" if report.encoder_diff is None
                                                     else f", encoder {report.encoder_diff:.2e}" + (
                                                         "" if report.encoder_bar == report.atol else
                                                         f" (its tolerance {report.encoder_bar:g})")))
    if report.agreement is not None:
        lines.extend(report.agreement.lines())
    problems = report.problems
    lines.append("PASS" if not problems else "FAIL: " + "; ".join(problems))
    return "\n".join(lines)
