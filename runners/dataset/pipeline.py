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
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path


from elx.runners.arguments import check_generate_file_call
from elx.runners.errors import ElxError
from elx.runners.wording import arg
from elx.runners.output_lock import dead_siblings, output_lock
from elx.runners.inputs.validation import check_threads
from elx.runners.dataset.job import (DEFAULT_BATCH_SIZE, DatasetSummary, Failed, Job, check_options, check_paths,
                                   iter_work, plan_job, run_batch)
from elx.runners.dataset.writer import Progress, Writer, _finish

QUEUE_DEPTH = 2  # batches waiting between two stages
LEFTOVER_KINDS = ("sorting", "run")  # temporary siblings of OUT (dataset_io.put_in_order, dataset_run.RunRecord.save)


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
        with _interrupts_held(redeliver=True):  # the stages are past their last statement: gone in a moment
            for thread in threads:
                thread.join()


@contextmanager
def _interrupts_held(redeliver: bool = False):
    """Ctrl-C/SIGTERM/SIGHUP are held off while the stages drain or are joined: an exception there would leave the
    threads running into the interpreter's exit.  After the first interrupt (``redeliver`` False: it is re-raised
    then) further ones are dropped; otherwise (the stages finished on their own) the first one that came is raised
    when the block ends, by its own handler: a signal in that moment ended the run with exit 0 and no word."""
    previous, arrived = {}, []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            handler = signal.getsignal(signum)
            if callable(handler):  # a handler that raises; ignored and default dispositions stay as they are
                previous[signum] = signal.signal(signum, lambda number, _: arrived.append(number))
        except (ValueError, OSError):  # not the main thread: signals are not delivered here anyway
            pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if redeliver and arrived:
            previous[arrived[0]](arrived[0], None)


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
    if _discards(output):  # --output-file /dev/null (timing a run): written in a private folder, then dropped
        if resume:
            raise ElxError(f"{arg('output_file')} {output} keeps nothing to resume; drop {arg('resume', True)}")
        given = dict(locals())
        arguments = {**options, **{name: given[name] for name in _ARGUMENTS}}
        with tempfile.TemporaryDirectory(prefix="elx-discarded-") as private:
            summary = generate_file(folder, input_file, Path(private) / "results.jsonl", **arguments)
        summary.output = output
        return summary
    check_paths(Path(folder), Path(input_file), output)
    with output_lock(output, "output_file"):
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


_ARGUMENTS = ("batch_size", "max_tokens_per_batch", "sort", "window", "pipeline", "force", "skip_bad", "progress",
              "threads", "backend", "device", "generator", "ray", "ray_actors", "ray_ship")


def _discards(output: Path) -> bool:
    """Whether ``output`` is the null device, where results go to be discarded (never locked, renamed or truncated:
    elx's siblings of OUT would be files in /dev, and the final rename would replace the device)."""
    try:
        return os.path.samefile(output, os.devnull)
    except OSError:
        return False


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
