"""A template (or a small model's whole graph) traced by a forked process while the export goes on.

Tracing is single-threaded Python (torch.export, the decompositions, onnxscript's optimizer): on a machine of
two cores or more a second process traces the step graph's template while the first traces and stitches the
prefill (or the encoder and cross K/V graphs).  Measured on the real SmolLM2-135M (2-core machine, load 7-8):
the two templates took 12-21 s and 20-31 s one after the other.

``fork`` shares the model with the child (copy-on-write: the template's tensors are read, never written),
so the child needs no pickling and no second import.  What makes it safe:

* the child leaves alone every object it inherits (``gc.freeze``): the parent's garbage not yet collected (an
  ONNX Runtime session in a reference cycle, say) is never destroyed there, where its destructor would wait on
  threads that were not forked (seen in the test suite: after such a test, each template child hung until
  ``STALL_SECONDS``);
* the child runs PyTorch on one thread (no OpenMP parallel region, whose pool a forked child must not reuse),
  writes nothing to the terminal, and leaves with ``os._exit`` (no atexit handler, no staged-folder cleanup:
  that is the parent's);
* it dies with the parent (``PR_SET_PDEATHSIG``: a killed export leaves no process behind), and the parent
  kills it when the export fails or is interrupted (``Capture.close``);
* a child that stops using CPU for ``STALL_SECONDS`` is taken for hung and killed, and a child that fails, hangs
  or is killed costs only time: the parent then traces the template itself.

The template's graph comes back as an ONNX file (its tensors in a data file beside it) in the staged export
folder, read once and removed.  ``ELX_CAPTURE_PARALLEL=0`` turns this off.

A model traced whole (3 layers or fewer per stack and no builder for it, or refused by the stitcher) gets the same: the child traces its
step graph (``decoder.onnx``) whole while the parent traces the others, where the model's weights are at most
``WHOLE_BYTES`` (the child's graph holds them all, written and read back).  Measured on the 2-core AMD machine,
``tests/conftest.py``'s tiny models (one process then two, the same graphs byte for byte): T5 34.0 -> 26.6 s,
GPT-2 27.2 -> 20.2 s, Whisper 32.9 -> 23.9 s.

Where the first process has finished its own graphs before the child, it does not sit idle: ``Capture`` runs its
``while_waiting`` job there (the export gives it the verification's PyTorch fp32 and fp64 reference, which needs
the manifest's description of the graphs, not the graphs).  Measured on this 2-core machine, quiet: the real
SmolLM2-135M's export 27.2 -> 23.1 s (the 4 s reference inside a 4 s wait), t5-base 33.7 -> 22.5 s, whisper-base
59.2 -> 41.4 s, and 33.1 s with the job's threads widened to the idle cores once the child is done (its 30 s
cases outlast the template).  The child's time is read from its template file's mtime, so the job's time is not
counted as the child's.
"""
from __future__ import annotations

import ctypes
import gc
import os
import signal
import time
from pathlib import Path

import onnx

STALL_SECONDS = 60.0
POLL_SECONDS = 0.2
# A model traced whole (3 layers or fewer per stack and no builder, or one the stitcher refuses) has its step graph traced by the
# second process too, where its weights take at most this many bytes: that graph holds every weight, written to a
# file by the child and read back (a template's layers are synthetic and few).  Tiny T5, encoder and cross K/V here
# while the decoder traces there (2-core machine): 49 -> 35 s.
WHOLE_BYTES = 512 * 2**20


def parallel_allowed() -> bool:
    return (hasattr(os, "fork") and os.environ.get("ELX_CAPTURE_PARALLEL", "1").strip() != "0"
            and (os.cpu_count() or 1) >= 2)


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _cpu_ticks(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


class TemplateProcess:
    """A forked child tracing one template into ``path``."""

    def __init__(self, pid: int, path: Path, started: float):
        self.pid, self.path, self.started = pid, path, started
        self.started_at = time.time() - (time.perf_counter() - started)  # wall clock, for the file's mtime
        self.seconds = 0.0
        self.done = False
        self._code = None  # the exit code, once reaped

    @classmethod
    def start(cls, make_graph, path: Path) -> "TemplateProcess":
        """Fork; the child writes ``make_graph()`` (an ``onnx.ModelProto``) to ``path`` and exits."""
        path = Path(path)
        parent, started = os.getpid(), time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            # every object inherited from the parent, its uncollected garbage included, out of the collector's
            # reach: a parent's dead ONNX Runtime session torn down here waits forever (or crashes) on thread-pool
            # state whose threads were not forked
            gc.freeze()
            code = 1
            try:
                _die_with_parent(parent)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
                import torch

                torch.set_num_threads(1)
                model = make_graph()
                partial = path.with_name(path.name + ".partial")
                onnx.save_model(model, str(partial), save_as_external_data=True, all_tensors_to_one_file=True,
                                location=path.name + ".data", size_threshold=1024)
                os.replace(partial, path)
                code = 0
            except BaseException as err:  # noqa: BLE001 - whatever it was, the parent traces the template itself
                try:
                    path.with_name(path.name + ".error").write_text(f"{type(err).__name__}: {err}"[:2000])
                except BaseException:  # noqa: BLE001
                    pass
            finally:
                os._exit(code)
        return cls(pid, path, started)

    def running(self) -> bool:
        """Whether the child is still at work (its exit, if it came, is kept for ``result``)."""
        if self.done:
            return False
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.done, self._code = True, os.waitstatus_to_exitcode(status)
        return not self.done

    def _wait(self) -> int | None:
        """The child's exit code; None when it was taken for hung and killed."""
        last, changed = None, time.monotonic()
        while True:
            if not self.running():
                return self._code
            ticks = _cpu_ticks(self.pid)
            if ticks != last:
                last, changed = ticks, time.monotonic()
            elif time.monotonic() - changed > STALL_SECONDS:
                self.stop()
                return None
            time.sleep(POLL_SECONDS)

    def result(self) -> tuple[onnx.ModelProto | None, str]:
        """The traced template (None and why where the child failed, hung or was killed)."""
        try:
            code = self._wait()
            self.seconds = time.perf_counter() - self.started
            if self.path.is_file():  # the child's own end (the parent may have been busy since)
                self.seconds = min(self.seconds, max(0.0, self.path.stat().st_mtime - self.started_at))
            if code is None:
                return None, f"no progress for {STALL_SECONDS:.0f} s"
            if code != 0 or not self.path.is_file():
                error = self.path.with_name(self.path.name + ".error")
                return None, error.read_text()[:300] if error.is_file() else f"exit status {code}"
            from elx.exporter.capture.template_cache import as_saved

            return as_saved(onnx.load(str(self.path))), ""
        finally:
            self._remove_files()

    def stop(self) -> None:
        """Kill the child if it still runs, and remove what it wrote."""
        if not self.done:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.done = True
        self._remove_files()

    def _remove_files(self) -> None:
        for suffix in ("", ".data", ".partial", ".error"):
            self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)
