"""Generation over a dataset file: length-bucketed batches, an asynchronous pipeline, resumable output.

``generate_file(folder, input_file, output_file, **options)`` (``elx generate DIR --input-file IN
--output-file OUT``) reads the records of IN (``runners/dataset/io.py``: txt, JSONL, Parquet),
generates with HF ``generate``'s options and appends one JSON line per input to OUT:

    {"id": 7, "tokens": [0, 37, 5, 1], "text": "...", "score": -0.71}

``tokens`` is the row HF ``generate`` returns for that input alone (the family's layout, no batch
padding), ``text`` its decoding when the export has a tokenizer, ``score`` HF's
``sequences_scores`` under beam search.  With ``num_return_sequences`` = r > 1 the line holds r
hypotheses, best first: ``tokens`` is a list of r rows and ``text``/``score`` lists of r values
(still one line per input, so that a line is the unit of completion and of ``--resume``).  A bad
input under ``skip_bad`` gives ``{"id": ..., "line": N, "error": "..."}``.

How it runs (FastSeq §4.3, the asynchronous pipeline):

* **read + prepare** (thread 1): records are read in windows of ``window`` inputs (streamed; the
  file is never held whole), tokenized together (or their audio loaded and turned into log-mel
  features), sorted by length (longest first) and cut into batches of at most ``batch_size``
  inputs and at most ``max_tokens_per_batch`` padded input tokens, so that padding stays small.
* **generate** (thread 2): one ``Generator.generate`` call per batch; the runtime (ONNX Runtime)
  releases the GIL while it computes, so the other stages run meanwhile.
* **detokenize + write** (thread 3): decoding, JSON, one appended line per finished input, progress.

Stages talk through bounded queues (``QUEUE_DEPTH`` batches), so memory stays bounded and the
reader cannot run away.  An exception in any stage stops the reader at once; the batch being
generated finishes and every finished input is written before the exception is re-raised (an
``ElxError`` when the input is at fault: one line naming the file and line).  Output lines are in
input order at the end of a complete run (``dataset_io.put_in_order``); a run that stopped early
leaves complete lines that ``resume=True`` keeps and skips by id.  ``pipeline=False`` runs the same
stages one after the other in the calling thread (for comparison); ``sort=False`` batches in input
order.  ``ray=ADDRESS`` runs the generate stage on Ray Data (``runners/dataset/ray.py``).
"""
from __future__ import annotations

import os
import queue
import signal
import stat
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from elx.runners.arguments import check_generate_file_call
from elx.runners.dataset.io import (InputRules, OutputFile, Record, check_output_path, check_tokens, error_line, put_in_order,
                         read_records, result_line, unit, where)
from elx.runners.dataset.run_record import (OwnedOutput, RunRecord, add_fingerprint, first_difference, owned_output, record_fingerprint,
                          run_identity)
from elx.runners.errors import ElxError
from elx.runners.families import rules_for
from elx.runners.manifest import Manifest
from elx.runners.output_lock import dead_siblings, output_lock
from elx.runners.search.settings import GenerationSettings, resolve_settings
from elx.runners.inputs.validation import check_memory, check_threads

QUEUE_DEPTH = 2  # batches waiting between two stages
DEFAULT_BATCH_SIZE = 16
DEFAULT_WINDOW = 1024  # inputs read and sorted together (at least 8 batches)
PLAIN_PROGRESS_SECONDS = 10.0
LEFTOVER_KINDS = ("sorting", "run")  # temporary siblings of OUT (dataset_io.put_in_order, dataset_run.RunRecord.save)


@dataclass
class DatasetSummary:
    output: Path
    inputs: int  # records in the input file
    written: int  # lines appended by this run (results and error lines)
    errors: int  # error lines among them (skip_bad)
    skipped: int  # inputs already in the output (resume)
    new_tokens: int  # generated tokens (all returned rows, prompt excluded)
    seconds: float
    reordered: bool = False  # the output was rewritten into input order at the end

    @property
    def items_per_second(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


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
                        "with --resume) or pass --skip-bad")


def check_options(batch_size, max_tokens_per_batch, resume: bool, force: bool) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ElxError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
    if max_tokens_per_batch is not None and (isinstance(max_tokens_per_batch, bool) or
                                             not isinstance(max_tokens_per_batch, int) or max_tokens_per_batch < 1):
        raise ElxError(f"--max-tokens-per-batch must be an integer >= 1, got {max_tokens_per_batch!r}")
    if resume and force:
        raise ElxError("--resume continues the output file and --force replaces it; pass one of them")


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
        if record.error and not skip_bad:
            raise ElxError(f"{where(source, record.line)}: {record.error}; "
                           "fix it or pass --skip-bad (an error line in the output instead)")
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
        raise ElxError(f"{target} exists and is not empty; pass --resume to continue it or --force to replace it")
    existing = owned_output(target, force=force)
    if force:
        return None
    difference = first_difference(existing.record.run, run)
    if difference:
        raise ElxError(f"{target} was written by another run ({difference}); --resume continues the same export with "
                       "the same options: pass the first run's, or --force to replace the output")
    return existing


def _check_resumed(job: Job, existing: OwnedOutput, kept_digest: int) -> None:
    """The existing lines are of this input: known ids, each once, of the same records as when they were written."""
    for rid in existing.ids:
        if rid not in job.order:
            raise ElxError(f"{job.output} holds id {rid!r}, which {job.input} does not have: is it the output of "
                           "another input? Pass another --output-file, or --force to replace it")
        if rid in job.done:
            raise ElxError(f"{job.output} holds id {rid!r} twice; it was not written by one elx run")
        job.done.add(rid)
    if kept_digest != existing.state.inputs:
        raise ElxError(f"the inputs of {job.input} whose results {job.output} holds are not those they were generated "
                       "from (changed, or another file with the same ids); --resume continues the same inputs: pass "
                       "the first run's --input-file, or --force to replace the output")
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


class Progress:
    """A tqdm bar on a terminal (items, items/s, generated tokens/s, ETA), plain lines every 10 s otherwise, or none."""

    def __init__(self, total: int, mode: str = "auto", stream=None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "plain"
        if mode not in ("bar", "plain", "none"):
            raise ElxError(f"progress must be auto, bar, plain or none, not {mode!r}")
        self.mode, self.total = mode, total
        self.items = self.tokens = 0
        self.start = self.shown = time.monotonic()
        self.first = None  # (time, items, tokens) of the first update: rates and ETA count from there, not from
        # the model loading or the Ray start-up before it
        self.bar = None
        if mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="item", file=self.stream, dynamic_ncols=True, smoothing=0.05,
                            desc="elx generate")

    def update(self, items: int, tokens: int) -> None:
        now = time.monotonic()
        self.items += items
        self.tokens += tokens
        if self.first is None:
            self.first = (now, self.items, self.tokens)
            if self.bar is not None:
                self.bar.unpause()  # tqdm's rate and ETA: from the first batch on, not from the loading
        if self.bar is not None:
            self.bar.update(items)
            if now - self.shown >= 0.5:
                self.bar.set_postfix_str(f"{self.rates(now)[1]:.0f} tok/s", refresh=False)
                self.shown = now
        elif self.mode == "plain" and now - self.shown >= PLAIN_PROGRESS_SECONDS:
            self.shown = now
            print(f"elx: {self.line(now)}", file=self.stream, flush=True)

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """Items/s and generated tokens/s since the first finished batch (0 before a second one)."""
        if self.first is None:
            return 0.0, 0.0
        start, items, tokens = self.first
        elapsed = (now or time.monotonic()) - start
        if elapsed <= 0 or self.items == items:
            return 0.0, 0.0
        return (self.items - items) / elapsed, (self.tokens - tokens) / elapsed

    def line(self, now: float | None = None) -> str:
        rate, token_rate = self.rates(now)
        eta = (self.total - self.items) / rate if rate > 0 else float("nan")
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if np.isfinite(eta) else "?"
        return f"{self.items}/{self.total} items, {rate:.2f} items/s, {token_rate:.0f} tokens/s, ETA {eta_text}"


    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Writer:
    """Stage 3: turns results into lines, appends them, counts them."""

    def __init__(self, job: Job, text, progress: Progress):
        self.job, self.text, self.progress = job, text, progress
        self.file = OutputFile(job.output, job.record, job.start)
        self.file.inputs = job.inputs_digest
        try:
            self.file.sync()  # the run record, before any line: OUT is provably elx's from its first byte
        except BaseException:
            self.file.close(sync=False)
            raise
        self.written = self.errors = self.new_tokens = 0
        self.last_index = job.done_last
        self.in_order = job.done_in_order

    def _line(self, index: int, line: str, fingerprint: int) -> None:
        self.file.write(line, fingerprint)
        if index < self.last_index:
            self.in_order = False
        self.last_index = index
        self.written += 1

    def write(self, work) -> None:
        if isinstance(work, Failed):
            for record in work.records:
                self._line(record.index, error_line(record), record_fingerprint(record))
            self.errors += len(work.records)
            self.file.checkpoint()
            self.progress.update(len(work.records), 0)
            return
        tokens = 0
        for result in work:
            self._line(result.record.index, result_text(result, self.text, self.job.several),
                       record_fingerprint(result.record))
            tokens += result.new_tokens
        self.new_tokens += tokens
        self.file.checkpoint()
        self.progress.update(len(work), tokens)

    def write_line(self, index: int, line: str, fingerprint: int, new_tokens: int, error: bool) -> None:
        """One finished line made elsewhere (the Ray workers); ``fingerprint``: its record's (dataset_run).  The
        caller calls ``checkpoint`` after each group of them."""
        self._line(index, line, fingerprint)
        self.errors += int(error)
        self.new_tokens += new_tokens
        self.progress.update(1, new_tokens)

    def checkpoint(self) -> None:
        self.file.checkpoint()

    def close(self) -> None:
        self.file.close()


# ----------------------------------------------------------------------------- the pipeline

_END = object()


class _Stages:
    """Three threads joined by bounded queues; the first failure stops the reader, the rest drain what is finished."""

    def __init__(self):
        self.stop = threading.Event()  # no new work: set by any failure or an interrupt
        self.writer_dead = threading.Event()
        self.errors = []
        self.lock = threading.Lock()

    def fail(self, err: BaseException) -> None:
        with self.lock:
            self.errors.append(err)
        self.stop.set()

    @staticmethod
    def put(q: queue.Queue, item, abandon: threading.Event) -> bool:
        while not abandon.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def run(self, work_iter, generate, writer: Writer) -> None:
        batches, results = queue.Queue(QUEUE_DEPTH), queue.Queue(QUEUE_DEPTH)

        def read():
            try:
                for work in work_iter:
                    if not self.put(batches, work, self.stop):
                        return
            except BaseException as err:  # noqa: BLE001 - reported by the main thread
                self.fail(err)
            finally:
                self.put(batches, _END, self.stop)

        def compute():
            try:
                while not self.stop.is_set():
                    try:
                        work = batches.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    if work is _END or self.stop.is_set():
                        break
                    done = work if isinstance(work, Failed) else generate(work)
                    if not self.put(results, done, self.writer_dead):
                        return
            except BaseException as err:  # noqa: BLE001
                self.fail(err)
            finally:
                self.put(results, _END, self.writer_dead)

        def write():
            try:
                while True:
                    try:
                        done = results.get(timeout=0.05)
                    except queue.Empty:
                        if finished[1].is_set() and results.empty():
                            return
                        continue
                    if done is _END:
                        return
                    writer.write(done)
            except BaseException as err:  # noqa: BLE001
                self.writer_dead.set()
                self.fail(err)

        # each stage says it has finished through its own Event, not Thread.is_alive()/join(): on Python 3.11 a join
        # interrupted by a signal's exception can mark a thread that still runs as stopped (the bpo-45274 fix
        # releases the thread's own state lock), and the stages would then be left running
        finished = [threading.Event() for _ in range(3)]

        def stage(fn, done: threading.Event):
            def run_stage():
                try:
                    fn()
                finally:
                    done.set()
            return run_stage

        threads = [threading.Thread(target=stage(fn, done), name=f"elx-{fn.__name__}", daemon=True)
                   for fn, done in zip((read, compute, write), finished)]
        for thread in threads:
            thread.start()
        try:
            for done in finished:
                while not done.wait(0.1):
                    pass
        except BaseException as err:  # noqa: BLE001 - Ctrl-C, or SIGTERM/SIGHUP as the CLI raises them (Terminated)
            # finish the batch in flight and write what is finished, then re-raise: a thread left inside ONNX
            # Runtime while the interpreter exits aborts the process ("terminate called without an active exception")
            self.fail(err)
            with _interrupts_held():
                for done in finished:
                    while not done.wait(0.1):
                        pass
        with _interrupts_held():  # the stages are past their last statement: gone in a moment, and uninterrupted
            for thread in threads:
                thread.join()


@contextmanager
def _interrupts_held():
    """Further Ctrl-C/SIGTERM/SIGHUP are ignored while the stages drain after the first one, which is re-raised
    then: a second exception there would leave the threads running into the interpreter's exit."""
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            handler = signal.getsignal(signum)
            if callable(handler):  # a handler that raises; ignored and default dispositions stay as they are
                previous[signum] = signal.signal(signum, lambda *_: None)
        except (ValueError, OSError):  # not the main thread: signals are not delivered here anyway
            pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _raise_first(errors: list) -> None:
    """The error to report: an interrupt (KeyboardInterrupt, or any other BaseException such as the CLI's SIGTERM)
    or an input error (ElxError) before a consequential one."""
    for interrupt in (err for err in errors if not isinstance(err, Exception)):
        raise interrupt
    for err in errors:
        if isinstance(err, ElxError):
            raise err
    raise errors[0]


def generate_file(folder, input_file, output_file, *, batch_size: int = DEFAULT_BATCH_SIZE,
                  max_tokens_per_batch: int | None = None, sort: bool = True, window: int | None = None,
                  pipeline: bool = True, resume: bool = False, force: bool = False, skip_bad: bool = False,
                  progress: str = "auto", threads: int | None = None, backend: str = "ort", device: str = "cpu",
                  generator=None, ray: str | bool | None = None, ray_actors: int | None = None,
                  ray_ship: bool = False, **options) -> DatasetSummary:
    """Generate for every record of ``input_file`` and write ``output_file`` (JSONL); see the module doc.

    ``options`` are HF ``generate``'s (num_beams, max_new_tokens, ...).  ``generator``: an already loaded
    ``Generator`` for ``folder`` (else one is loaded with ``backend``/``device``/``threads``).  ``ray``: run the
    generate stage on Ray Data (True or "auto": a local instance or ``RAY_ADDRESS``; else a cluster address)."""
    check_generate_file_call(locals())  # runners/arguments.py: one line naming a wrong argument
    start = time.monotonic()
    check_options(batch_size, max_tokens_per_batch, resume, force)
    if generator is not None:
        backend, device = generator.model.backend.name, generator.model.backend.device
    elif not ray:
        check_threads(threads)  # before the input is scanned (Ray's workers check it on their own nodes)
    if ray:
        from elx.runners.dataset.ray import check_reachable

        check_reachable(os.environ.get("RAY_ADDRESS") if ray is True else ray)
    output = Path(os.path.abspath(Path(output_file).expanduser()))
    check_paths(Path(folder), Path(input_file), output)
    with output_lock(output, "--output-file"):
        for leftover, _ in dead_siblings(output, LEFTOVER_KINDS):  # what a killed run left: a sorted copy, a record
            leftover.unlink(missing_ok=True)
        job = plan_job(folder, input_file, output, batch_size=batch_size, max_tokens_per_batch=max_tokens_per_batch,
                       sort=sort, window=window, resume=resume, force=force, skip_bad=skip_bad,
                       backend="ort" if ray else backend, device="cpu" if ray else device, **options)
        if ray:
            from elx.runners.dataset.ray import run_on_ray

            text = _text(job)
            summary = run_on_ray(job, text, address=None if ray is True else ray, actors=ray_actors, ship=ray_ship,
                                 threads=threads, progress=progress)
        else:
            if generator is None:
                from elx.runners.generate import Generator

                generator = Generator.from_folder(job.folder, backend=backend, device=device, threads=threads)
            summary = _run_local(job, generator, pipeline, progress)
    summary.seconds = time.monotonic() - start
    return summary


def _text(job: Job):
    from elx.runners.inputs.text import Text

    return Text.load(job.folder) if job.rules.has_tokenizer else None


def _run_local(job: Job, generator, pipeline: bool, progress_mode: str) -> DatasetSummary:
    text = generator.text
    progress = Progress(job.remaining, progress_mode)
    try:
        writer = Writer(job, text, progress)
    except BaseException:
        progress.close()
        raise
    errors = []
    try:
        work = iter_work(job, text)
        if pipeline:
            stages = _Stages()
            stages.run(work, lambda batch: run_batch(generator, job.settings, batch), writer)
            errors = stages.errors
        else:
            try:
                for item in work:
                    writer.write(item if isinstance(item, Failed) else run_batch(generator, job.settings, item))
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the file is closed
                errors = [err]
    finally:
        writer.close()
        progress.close()
    return _finish(job, writer, errors)


def _finish(job: Job, writer: Writer, errors: list) -> DatasetSummary:
    if errors:
        _raise_first(errors)
    reordered = False if writer.in_order else put_in_order(job.output, job.order, job.record, writer.file.state())
    return DatasetSummary(job.output, len(job.order), writer.written, writer.errors, len(job.done),
                          writer.new_tokens, 0.0, reordered)
