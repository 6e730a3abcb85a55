"""A dataset run's plan and its units of work: the job (inputs, output, settings, what a resumed run keeps),
the length-sorted batches read from the input file, and one batch's generation and result lines.

Shared by the local pipeline (``runners/dataset/pipeline.py``) and Ray Data (``runners/dataset/ray.py``).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from elx.runners.dataset.io import (InputRules, Record, check_output_path, check_tokens, read_records, result_line,
                                    unit, where)
from elx.runners.dataset.run_record import (OwnedOutput, RunRecord, add_fingerprint, first_difference, owned_output, record_fingerprint,
                          run_identity)
from elx.runners.errors import ElxError
from elx.runners.wording import arg
from elx.runners.families import rules_for
from elx.runners.manifest import Manifest
from elx.runners.search.settings import GenerationSettings, resolve_settings
from elx.runners.inputs.validation import check_memory

DEFAULT_BATCH_SIZE = 16
DEFAULT_WINDOW = 1024  # inputs read and sorted together (at least 8 batches)


@dataclass
class DatasetSummary:
    output: Path
    inputs: int  # records in the input file
    written: int  # lines appended by this run (results and error lines)
    errors: int  # error lines among them (skip_bad)
    skipped: int  # inputs already in the output (resume)
    new_tokens: int  # generated tokens (all returned rows, prompt excluded)
    seconds: float  # the whole run: reading and sorting the input, loading the model, generating, writing
    reordered: bool = False  # the output was rewritten into input order at the end
    generate_seconds: float | None = None  # the generate stage, as its progress meter measured it (None: seconds)

    @property
    def _stage_seconds(self) -> float:
        return self.seconds if self.generate_seconds is None else self.generate_seconds

    @property
    def items_per_second(self) -> float:
        """Lines per second of the generate stage: the rate its progress bar showed (runners/progress.py)."""
        return self.written / self._stage_seconds if self._stage_seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self._stage_seconds if self._stage_seconds > 0 else 0.0


@dataclass
class Batch:
    records: list
    inputs: dict  # {"input_ids": rows} or {"input_features": array}


@dataclass
class Failed:
    records: list  # bad records (skip_bad): written as error lines


@dataclass
class Result:
    record: Record
    rows: list  # per returned sequence, HF generate's row for this input alone
    scores: list | None
    new_tokens: int


@dataclass
class Job:
    """A validated dataset run: inputs scanned, output checked, what is left to do."""

    folder: Path
    input: Path
    output: Path
    manifest: Manifest
    rules: InputRules
    settings: GenerationSettings
    order: dict  # id → position in the input
    record: RunRecord  # the run record beside the output (runners/dataset/run_record.py)
    start: OwnedOutput | None = None  # the existing lines to go on after (resume); None: a new or replaced file
    inputs_digest: int = 0  # the digest of the records of those lines
    done: set = field(default_factory=set)  # ids already in the output (resume)
    done_in_order: bool = True  # the existing lines are in input order
    done_last: int = -1  # the input position of the last existing line (-1: none)
    remaining: int = 0  # records still to write
    batch_size: int = DEFAULT_BATCH_SIZE
    max_tokens_per_batch: int | None = None
    sort: bool = True
    window: int = DEFAULT_WINDOW
    skip_bad: bool = False
    options: dict = field(default_factory=dict)

    @property
    def several(self) -> bool:
        return rules_for(self.manifest).rows_per_input(self.settings) > 1

    def bad(self, record: Record) -> ElxError:
        return ElxError(f"{where(self.input, record.line)}: {record.error}; fix it (finished lines are kept: rerun "
                        f"with {arg('resume', True)}) or pass {arg('skip_bad', True)}")


def check_options(batch_size, max_tokens_per_batch, resume: bool, force: bool) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ElxError(f"{arg('batch_size')} must be an integer >= 1, got {batch_size!r}")
    if max_tokens_per_batch is not None and (isinstance(max_tokens_per_batch, bool) or
                                             not isinstance(max_tokens_per_batch, int) or max_tokens_per_batch < 1):
        raise ElxError(f"{arg('max_tokens_per_batch')} must be an integer >= 1, got {max_tokens_per_batch!r}")
    if resume and force:
        raise ElxError(f"{arg('resume', True)} continues the output file and {arg('force', True)} replaces it; pass "
                       "one of them")


def plan_job(folder, input_file, output_file, *, batch_size: int = DEFAULT_BATCH_SIZE,
             max_tokens_per_batch: int | None = None, sort: bool = True, window: int | None = None,
             resume: bool = False, force: bool = False, skip_bad: bool = False, backend: str = "ort",
             device: str = "cpu", **options) -> Job:
    """Everything checked before anything is loaded or written: options, input records, the existing output.

    Call it after ``check_paths``, holding the output's lock (``generate_file`` does both): it decides what may be
    done with OUT."""
    folder, source, target = Path(folder), Path(input_file), Path(output_file)
    check_options(batch_size, max_tokens_per_batch, resume, force)
    manifest = Manifest.load(folder)
    settings = resolve_settings(manifest, **options)
    roles = manifest.encoder_inputs()
    from elx.runners.search.log_softmax import kernel
    from elx.runners.inputs.text import TOKENIZER_DIR

    rules = InputRules(takes_audio="input_features" in roles,
                       has_tokenizer=(folder / TOKENIZER_DIR / "tokenizer.json").is_file(),
                       vocab_size=manifest.dims.get("source_vocab_size", manifest.dims.get("vocab_size")),
                       max_positions=manifest.dims.get("max_position_embeddings"))
    run = run_identity(folder, settings, backend, device, kernel() if settings.num_beams > 1 else None)
    job = Job(folder, source, target, manifest, rules, settings, {}, RunRecord(target, run, str(source)),
              batch_size=batch_size, max_tokens_per_batch=max_tokens_per_batch, sort=sort, skip_bad=skip_bad,
              options=options)
    existing = _existing_output(target, run, resume, force)
    kept = set(existing.ids) if existing else set()
    kept_digest = 0
    lines, count = {}, 0
    for record in read_records(source, rules):
        count += 1
        if record.id in job.order:
            raise ElxError(f"{where(source, record.line)}: id {record.id!r} already on {unit(source)} "
                           f"{lines[record.id]}; ids must be unique (the output is keyed by them)")
        job.order[record.id], lines[record.id] = record.index, record.line
        if record.error and not skip_bad and record.id not in kept:  # an error line already in OUT: done
            raise ElxError(f"{where(source, record.line)}: {record.error}; "
                           f"fix it or pass {arg('skip_bad', True)} (an error line in the output instead)")
        if record.id in kept:
            kept_digest = add_fingerprint(kept_digest, record_fingerprint(record))
    if existing is not None:
        _check_resumed(job, existing, kept_digest)
        job.start, job.inputs_digest = existing, kept_digest
    job.remaining = count - len(job.done)
    # audio: features are big and all of one length (30 s), so no sorting window
    job.window = max(window or DEFAULT_WINDOW, batch_size) if sort and not rules.takes_audio else batch_size
    return job


def check_paths(folder: Path, source: Path, target: Path) -> None:
    """IN is a regular file; OUT is one that writing cannot destroy anything through (dataset_io.check_output_path)."""
    try:
        st = os.stat(source)
    except FileNotFoundError:
        raise ElxError(f"input file {source} not found") from None
    if stat.S_ISDIR(st.st_mode):
        raise ElxError(f"input file {source} is a folder; name a .txt, .jsonl or .parquet file")
    if not stat.S_ISREG(st.st_mode):
        raise ElxError(f"input file {source} is not a regular file (a FIFO, device or socket); elx reads IN twice "
                       "(checked first, then generated): save it to a file")
    check_output_path(target, source, folder)


def _existing_output(target: Path, run: dict, resume: bool, force: bool) -> OwnedOutput | None:
    """The existing OUT that ``resume`` continues (proved elx's, of the same run); None for a new file or one that
    ``force`` replaces (proved elx's too: never a file of the user's)."""
    if not target.exists() or target.stat().st_size == 0:
        return None
    if not (resume or force):
        raise ElxError(f"{target} exists and is not empty; pass {arg('resume', True)} to continue it or "
                       f"{arg('force', True)} to replace it")
    existing = owned_output(target, force=force)
    if force:
        return None
    difference = first_difference(existing.record.run, run)
    if difference:
        raise ElxError(f"{target} was written by another run ({difference}); {arg('resume', True)} continues the "
                       f"same export with the same options: pass the first run's, or {arg('force', True)} to replace "
                       "the output")
    return existing


def _check_resumed(job: Job, existing: OwnedOutput, kept_digest: int) -> None:
    """The existing lines are of this input: known ids, each once, of the same records as when they were written."""
    for rid in existing.ids:
        if rid not in job.order:
            raise ElxError(f"{job.output} holds id {rid!r}, which {job.input} does not have: is it the output of "
                           f"another input? Pass another {arg('output_file')}, or {arg('force', True)} to replace it")
        if rid in job.done:
            raise ElxError(f"{job.output} holds id {rid!r} twice; it was not written by one elx run")
        job.done.add(rid)
    if kept_digest != existing.state.inputs:
        raise ElxError(f"the inputs of {job.input} whose results {job.output} holds are not those they were generated "
                       f"from (changed, or another file with the same ids); {arg('resume', True)} continues the same "
                       f"inputs: pass the first run's {arg('input_file')}, or {arg('force', True)} to replace the output")
    positions = [job.order[rid] for rid in existing.ids]
    job.done_in_order = all(a < b for a, b in zip(positions, positions[1:]))
    job.done_last = max(positions, default=-1)


# ----------------------------------------------------------------------------- stage 1: read + prepare


def iter_work(job: Job, text=None, load_audio: bool = True):
    """Batches (and, under skip_bad, bad records) of the inputs still to do, window by window.

    ``load_audio=False``: audio batches carry the records only (the Ray workers load the files)."""
    window = []
    extractor = None
    if job.rules.takes_audio and load_audio:
        from elx.runners.inputs.audio import load_feature_extractor

        extractor = load_feature_extractor(job.folder)
    for record in read_records(job.input, job.rules):
        if record.id in job.done:
            continue
        if record.error:
            yield Failed([record])
            continue
        window.append(record)
        if len(window) >= job.window:
            yield from _prepare(job, window, text, extractor)
            window = []
    if window:
        yield from _prepare(job, window, text, extractor)


def _prepare(job: Job, window: list, text, extractor):
    good, bad = [], []
    if job.rules.takes_audio:
        for record in window:
            if extractor is None:
                good.append(record)
                continue
            try:
                record.features = _features(extractor, record.value)
                good.append(record)
            except ElxError as err:
                record.error = str(err)
                bad.append(record)
    else:
        texts = [r for r in window if r.kind == "text"]
        if texts:
            for record, ids in zip(texts, text.encode([r.value for r in texts])):
                record.tokens = ids
        for record in window:
            if record.kind == "input_ids":
                record.tokens = record.value
            record.error = check_tokens(record.tokens, job.rules) or _alone_error(job, record.tokens)
            (bad if record.error else good).append(record)
    for record in bad:
        if not job.skip_bad:
            raise job.bad(record)
    if bad:
        yield Failed(bad)
    for batch in plan_batches(good, job.batch_size, job.max_tokens_per_batch, job.sort and not job.rules.takes_audio,
                              key=padding_key(job)):
        if job.rules.takes_audio:
            if extractor is None:
                yield Batch(batch, {})
                continue
            inputs = {"input_features": np.stack([r.features for r in batch])}
            for record in batch:
                record.features = None
        else:
            inputs = {"input_ids": [r.tokens for r in batch]}
        yield Batch(batch, inputs)


def _features(extractor, path) -> np.ndarray:
    from elx.runners.inputs.audio import features_from_audio, load_clip

    return features_from_audio(extractor, [load_clip(path, extractor)], [path])["input_features"][0]


def _alone_error(job: Job, tokens: list) -> str | None:
    """Why the input alone cannot be generated with the run's settings, as ``Generator.generate`` would refuse it
    (a decoder-only prompt that leaves no room for the new tokens within the positions; an input whose attention
    or search cannot fit in memory); None when it can."""
    ids = np.asarray([tokens], dtype=np.int64)
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    rules = rules_for(job.manifest)
    prompt = rules.prompt_length(job.settings)
    try:
        rules.check_lengths(job.manifest, inputs, job.settings)
        check_memory(job.manifest, job.settings, inputs, len(tokens) if prompt is None else prompt)
    except ElxError as err:
        return str(err)
    return None


def padding_key(job: Job):
    """What inputs must share to be batched together, as a function of their length (None: nothing).

    A decoder-only prompt is left-padded to the batch's longest, and HF counts that padding as prompt
    (``runners/families.py``): ``max_length`` and ``min_length`` cap and floor the total length, so a padded
    row would get fewer (or more) new tokens than the input alone, and n-gram blocking sees the pad tokens.
    So such inputs share a batch only where it changes nothing: the same number of new tokens allowed and
    required, and with n-gram blocking the same length (no padding at all).  With ``max_new_tokens`` and
    ``min_new_tokens`` (or lengths that never bind) lengths mix freely.  Encoder-decoder models pad the
    encoder's input only, behind an attention mask: None."""
    settings = job.settings
    if rules_for(job.manifest).prompt_length(settings) is not None:
        return None

    def key(length: int) -> tuple:
        new = settings.total_max_length(length) - length
        floor = max(0, settings.total_min_length(length) - length)
        return new, floor, length if settings.no_repeat_ngram_size else None

    return key


def plan_batches(records: list, batch_size: int, max_tokens: int | None, sort: bool, key=None) -> list[list]:
    """Batches of at most ``batch_size`` records and ``max_tokens`` padded tokens (rows × longest row).

    ``sort``: longest first (ties in input order), so each batch holds inputs of similar length; a record
    longer than ``max_tokens`` gets a batch of its own.  ``key(length)``: records of different keys never share a
    batch (``padding_key``)."""
    def length(record) -> int:
        return len(record.tokens) if record.tokens is not None else 1

    ordered = sorted(records, key=lambda r: (-length(r), r.index)) if sort else list(records)
    batches, batch, longest = [], [], 0
    for record in ordered:
        size = length(record)
        widest = max(longest, size)
        if batch and (len(batch) >= batch_size or (max_tokens is not None and (len(batch) + 1) * widest > max_tokens)
                      or (key is not None and key(size) != key(length(batch[0])))):
            batches.append(batch)
            batch, widest = [], size
        batch.append(record)
        longest = widest
    if batch:
        batches.append(batch)
    return batches


# ----------------------------------------------------------------------------- stage 2: generate


def run_batch(generator, settings: GenerationSettings, batch: Batch) -> list[Result]:
    """Generate one batch and split it per input: each row cut to its own length (after its first EOS) and put in
    HF's layout for that input alone, so it equals ``generator.generate`` of the input by itself."""
    out = generator.generate(**batch.inputs, settings=settings, decode=False)
    rules = generator.rules
    per_input = rules.rows_per_input(settings)
    fixed = rules.prompt_length(settings)  # None: decoder-only, the prompt is the input, left-padded to the batch's
    prompt = fixed if fixed is not None else max(len(r.tokens) for r in batch.records)
    eos = np.asarray(settings.eos_token_id, dtype=np.int64)
    raw = out.raw_sequences
    scores = out.sequences_scores
    results = []
    for i, record in enumerate(batch.records):
        rows, new = [], 0
        start = 0 if fixed is not None else prompt - len(record.tokens)  # the input alone has no left padding
        for r in range(i * per_input, (i + 1) * per_input):
            tail = raw[r, prompt:]
            hits = np.flatnonzero(np.isin(tail, eos)) if eos.size else []
            end = prompt + (int(hits[0]) + 1 if len(hits) else tail.shape[0])
            new += end - prompt
            rows.append(rules.output_sequences(raw[r: r + 1, start:end], settings)[0].tolist())
        row_scores = None
        if scores is not None:
            row_scores = [_finite(s) for s in scores[i * per_input: (i + 1) * per_input]]
        results.append(Result(record, rows, row_scores, new))
    return results


def _finite(value) -> float | None:
    value = float(value)
    return value if np.isfinite(value) else None


# ----------------------------------------------------------------------------- stage 3: detokenize + write


def result_text(result: Result, text, several: bool) -> str:
    texts = text.decode(result.rows) if text is not None else None
    return result_line(result.record.id, result.rows, texts, result.scores, several)
