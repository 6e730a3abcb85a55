"""The output side of a dataset run: progress (a bar or plain lines), the writer that appends one finished line per
input (crash-safe, resumable), and the end of a run (the first error re-raised, the lines put in input order).

Shared by the local pipeline (``runners/dataset/pipeline.py``) and Ray Data (``runners/dataset/ray.py``).
"""
from __future__ import annotations

from elx.runners.dataset.io import OutputFile, error_line, put_in_order
from elx.runners.dataset.run_record import record_fingerprint
from elx.runners.errors import ElxError
from elx.runners.progress import Meter
from elx.runners.dataset.job import DatasetSummary, Failed, Job, result_text

Progress = Meter  # the generate stage's meter (runners/progress.py): the bar, the plain lines and the summary's rate


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


def _raise_first(errors: list) -> None:
    """The error to report: an interrupt (KeyboardInterrupt, or any other BaseException such as the CLI's SIGTERM)
    or an input error (ElxError) before a consequential one."""
    for interrupt in (err for err in errors if not isinstance(err, Exception)):
        raise interrupt
    for err in errors:
        if isinstance(err, ElxError):
            raise err
    raise errors[0]


def _finish(job: Job, writer: Writer, errors: list) -> DatasetSummary:
    if errors:
        _raise_first(errors)
    reordered = False if writer.in_order else put_in_order(job.output, job.order, job.record, writer.file.state())
    progress = writer.progress  # the generate stage's meter: the summary's rate is the one its bar showed
    return DatasetSummary(job.output, len(job.order), writer.written, writer.errors, len(job.done),
                          writer.new_tokens, 0.0, reordered, generate_seconds=progress.seconds())
