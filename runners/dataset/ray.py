"""The generate stage on Ray Data: ``elx generate DIR --input-file IN --output-file OUT --ray [ADDRESS]``.

The driver does what it does in a local run (``runners/dataset/pipeline.py``): scans IN, checks OUT, reads
and tokenizes the inputs and cuts them into the same length-sorted batches; each batch becomes
one row of a Ray dataset (``ray.data.from_items``, one block per batch so the pool balances the
load).  ``map_batches`` with a fixed pool of actors (``ActorPoolStrategy(size=actors)``, one
``Generator`` each, ONNX Runtime with ``threads`` intra-op threads on ``threads`` CPUs) generates each batch,
loads audio for Whisper (paths must be readable on the workers), detokenizes and returns the
finished JSON lines; the driver appends them to OUT as they arrive (``preserve_order`` off), so
the output is written by the same code, crash-safe and resumable in the same way, and put into
input order at the end.  Same batches, same code: the same OUT as a local run.

The export folder is read by each actor at the same path (shared storage) by default;
``ship=True`` puts its files in Ray's object store and each actor unpacks them into a temporary
folder of its node.  When elx starts or connects to Ray itself it ships its own ``elx`` package
(``elx.runners`` inside it, ``shipped_elx``) with the job (``runtime_env`` ``py_modules``), so the
workers run the driver's code; they
need numpy, onnxruntime and tokenizers installed.  The prepared batches (token ids) are held in
the object store for the whole run: split inputs much larger than the cluster's memory.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np

from elx.runners.dataset.job import Batch, DatasetSummary, Failed, Job, iter_work, result_text
from elx.runners.dataset.writer import Progress, Writer, _finish
from elx.runners.dataset.io import Record, error_line, where
from elx.runners.dataset.run_record import record_fingerprint
from elx.runners.errors import ElxError
from elx.runners.wording import arg

MAX_BLOCKS = 10_000
CONNECT_SECONDS = 10.0  # how long a cluster address may take to answer


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ElxError(f"{arg('ray')} needs Ray Data: pip install 'elx[ray]'")
    return ray


def shipped_elx(scratch: str) -> str:
    """The folder Ray ships as the workers' ``elx`` package (``runtime_env`` ``py_modules``): an installed
    ``elx`` as it is (``elx/runners`` inside it), or for a source checkout, where ``runners/`` sits beside
    ``elx/``, a copy of ``elx/`` with ``runners/`` inside, under ``scratch``.  The exporter is not shipped."""
    import elx
    import elx.runners

    package = Path(elx.__file__).parent
    runners_dir = Path(elx.runners.__file__).parent
    if runners_dir.parent == package:
        return str(package)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    target = Path(scratch) / "elx"
    shutil.copytree(package, target, ignore=skip)
    shutil.copytree(runners_dir, target / "runners", ignore=skip)
    return str(target)


def _folder_files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class GenerateActor:
    """One Ray actor: a Generator for the export, turning batch rows into finished result lines."""

    def __init__(self, folder: str, shipped=None, options: dict | None = None, threads: int | None = None,
                 skip_bad: bool = True):
        from elx.runners.generate import Generator

        self.tmp = None
        if shipped is not None:
            import ray

            files = ray.get(shipped[0])  # a list holding the ref: not resolved (nor kept) as a constructor argument
            self.tmp = tempfile.mkdtemp(prefix="elx-export-")
            for name, data in files.items():
                path = Path(self.tmp) / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            folder = self.tmp
        elif not (Path(folder) / "manifest.json").is_file():
            raise ElxError(f"export folder {folder} not found on Ray node {socket.gethostname()}; put it on storage "
                           f"every node reads at the same path, or pass {arg('ray_ship', True)}")
        self.generator = Generator.from_folder(folder, threads=threads)
        self.settings = self.generator.settings(**(options or {}))
        self.several = self.generator.rules.rows_per_input(self.settings) > 1
        self.extractor = None
        if "input_features" in self.generator.manifest.encoder_inputs():
            from elx.runners.inputs.audio import load_feature_extractor

            self.extractor = load_feature_extractor(folder)

    def __call__(self, rows: dict) -> dict:
        from elx.runners.dataset.job import _features, run_batch

        out = {"index": [], "line": [], "new_tokens": [], "error": []}
        for payload in rows["records"]:
            records = [Record(index, line, rid, kind, value) for index, line, rid, kind, value in json.loads(payload)]
            good = []
            for record in records:
                if self.extractor is not None:
                    try:
                        record.features = _features(self.extractor, record.value)
                    except ElxError as err:
                        record.error = str(err)
                        self._add(out, record.index, error_line(record), 0, True)
                        continue
                else:
                    record.tokens = record.value
                good.append(record)
            if not good:
                continue
            if self.extractor is not None:
                inputs = {"input_features": np.stack([r.features for r in good])}
            else:
                inputs = {"input_ids": [r.tokens for r in good]}
            for result in run_batch(self.generator, self.settings, Batch(good, inputs)):
                self._add(out, result.record.index, result_text(result, self.generator.text, self.several),
                          result.new_tokens, False)
        return {"index": np.asarray(out["index"], dtype=np.int64), "line": np.asarray(out["line"], dtype=object),
                "new_tokens": np.asarray(out["new_tokens"], dtype=np.int64),
                "error": np.asarray(out["error"], dtype=bool)}

    @staticmethod
    def _add(out: dict, index: int, line: str, new_tokens: int, error: bool) -> None:
        out["index"].append(index)
        out["line"].append(line)
        out["new_tokens"].append(new_tokens)
        out["error"].append(error)

    def __del__(self):
        if getattr(self, "tmp", None):
            shutil.rmtree(self.tmp, ignore_errors=True)


_ELX_ERROR = re.compile(r"^(?:runners\.errors\.)?ElxError: (.+)$", re.M)


def _elx_error(err: BaseException) -> ElxError | None:
    """The user's error (an ElxError raised on a worker) inside Ray's wrappers, as a plain one-line ElxError.

    Ray hands the driver its own exception types (``ActorDiedError`` for a constructor, ``RayTaskError`` for a
    call) whose text ends with the worker's traceback; the last ``ElxError: ...`` line there is the message."""
    seen, stack = set(), [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if type(e) is ElxError:
            return e
        found = _ELX_ERROR.findall(str(e))
        if found:
            return ElxError(found[-1])
        stack.extend([getattr(e, "cause", None), e.__cause__, e.__context__])
    return None


def check_reachable(address, timeout: float = CONNECT_SECONDS) -> None:
    """A cluster ``ADDRESS`` (``host:port``, ``ray://host:port``) answers on its port within ``timeout`` seconds;
    else one line, instead of Ray retrying for minutes.  None, ``auto`` and ``local`` start or find a local one."""
    if address in (None, True, "auto", "local"):
        return
    text = str(address).removeprefix("ray://")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ElxError(f"{arg('ray')} {address}: a cluster address is HOST:PORT (or ray://HOST:PORT for Ray Client)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        reason = "timed out" if isinstance(err, TimeoutError) else (err.strerror or type(err).__name__)
        raise ElxError(f"cannot reach the Ray cluster at {address} ({reason} within {timeout:.0f} s); check the "
                       "address and that the cluster is up, or drop the address to start a local Ray") from None


def run_on_ray(job: Job, text, *, address=None, actors: int | None = None, ship: bool = False,
               threads: int | None = None, progress: str = "auto") -> DatasetSummary:
    ray = _import_ray()
    if actors is not None and actors < 1:
        raise ElxError(f"{arg('ray_actors')} must be >= 1, got {actors}")
    progress_bar = Progress(job.remaining, progress)
    writer = Writer(job, text, progress_bar)
    started = False
    errors = []
    try:
        rows, failed, fingerprints = [], [], {}  # fingerprints: of the records sent out, by index (dataset_run)
        for work in iter_work(job, text, load_audio=False):
            if isinstance(work, Failed):
                failed.append(work)
            else:
                rows.append({"records": json.dumps([[r.index, r.line, r.id, "tokens" if r.tokens is not None
                                                     else r.kind, r.tokens if r.tokens is not None else r.value]
                                                    for r in work.records])})
                fingerprints.update((r.index, record_fingerprint(r)) for r in work.records)
        for work in failed:
            writer.write(work)
        if rows:
            if not ray.is_initialized():
                logging.getLogger("ray").setLevel(logging.ERROR)
                with tempfile.TemporaryDirectory(prefix="elx-ray-") as scratch:  # uploaded by ray.init
                    ray.init(address=address, include_dashboard=False, logging_level=logging.ERROR,
                             log_to_driver=False, configure_logging=True,
                             runtime_env={"py_modules": [shipped_elx(scratch)]})
                started = True
            context = ray.data.DataContext.get_current()
            context.enable_progress_bars = False
            context.execution_options.preserve_order = False
            for name in ("ray.data", "ray.data._internal"):
                logging.getLogger(name).setLevel(logging.ERROR)
            cpus = max(1, threads or 1)
            if actors is None:
                actors = max(1, int(ray.cluster_resources().get("CPU", 1)) // cpus)
            shipped = [ray.put(_folder_files(job.folder))] if ship else None
            dataset = ray.data.from_items(rows, override_num_blocks=min(len(rows), MAX_BLOCKS))
            results = dataset.map_batches(
                GenerateActor, batch_size=1, compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=cpus,
                batch_format="numpy",
                fn_constructor_kwargs=dict(folder=str(job.folder.resolve()), shipped=shipped, options=job.options,
                                           threads=cpus))
            for out in results.iter_batches(batch_size=None, batch_format="numpy"):
                for index, line, new_tokens, error in zip(out["index"], out["line"], out["new_tokens"], out["error"]):
                    if error and not job.skip_bad:
                        bad = json.loads(line)
                        raise ElxError(f"{where(job.input, bad['line'])}: {bad['error']}; fix it (finished lines are "
                                       f"kept: rerun with {arg('resume', True)}) or pass {arg('skip_bad', True)}")
                    writer.write_line(int(index), str(line), fingerprints[int(index)], int(new_tokens), bool(error))
                writer.checkpoint()
    except KeyboardInterrupt as err:
        errors = [err]
    except ElxError as err:
        errors = [err]
    except Exception as err:  # noqa: BLE001 - Ray wraps worker errors; the user's own is reported as one line
        user = _elx_error(err)
        errors = [user if user is not None else err]
    finally:
        writer.close()
        progress_bar.close()
        if started:
            ray.shutdown()
    return _finish(job, writer, errors)


def ray_available() -> bool:
    try:
        import ray.data  # noqa: F401
    except ImportError:
        return False
    return True

