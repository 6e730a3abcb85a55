"""``elx build-engine DIR``: a TensorRT engine for every graph the runner runs, recorded in the manifest.

    build_engine(folder, precision="fp32", max_batch_size=8, max_beams=4, max_input_length=512,
                 max_new_tokens=128, runtime="auto") -> DIR/engines

Design:

* **Which graphs**: ``manifest.stages`` + ``manifest.step`` (encoder, cross_kv when present, the
  decoder; pass graphs included, since the manifest already names them).  For ``--pass ngram=N`` the
  decoder is built from its TensorRT sibling (plugin node) or, failing that, without blocking
  (``exporter/tensorrt/ngram.py``).
* **Profiles**: one optimization profile per engine covering the axes the runner feeds
  (``exporter/tensorrt/profiles.py``: batch, rows = batch·beams, source length, step length, past
  length from 0, history length).
* **Precision**: strongly typed networks; fp16 is an ONNX rewrite (the rule of ``exporter/precision/fp16.py``)
  verified on ONNX Runtime before TensorRT sees it (``exporter/tensorrt/precision.py``); TF32 is off.
  Engines are built from fp32 exports (an ``--precision fp16`` export is refused).
* **Where TensorRT runs**: each engine is built by ``python -m elx.exporter.tensorrt.worker`` in its own
  process (crash isolation, ``LD_LIBRARY_PATH`` for TensorRT for RTX's plugin import).  TensorRT for
  RTX builds ahead of time without a GPU, for the compute capabilities asked for (default: all its
  RTX-class targets from Ampere on); NVIDIA's TensorRT builds for the GPU it runs on.
* **Atomic**: everything is built into ``DIR/.engines.PID-XXXXXXXX.partial``; only when every engine is
  built, a new manifest is written next to the old one, the folder is renamed to ``DIR/engines`` and the
  manifest replaced.  A failure leaves the folder as it was.  The build holds the export's lock
  (``.DIR.lock``, the one ``elx export`` holds): what a killed build left is removed by the next one, and
  ``elx export --force`` replaces a folder holding it (``exporter/atomic.py``: ``build_leftovers``).  ``engines/build.json`` and the manifest
  share a build id that the backend checks (``runners/backends/tensorrt_engines.py``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import elx
from elx.runners.arguments import check_arguments
from elx.runners.errors import ElxError
from elx.runners.manifest import FILENAME, Manifest
from elx.runners.backends.tensorrt_engines import BUILD_FILE, FORMAT, SECTION
from elx.runners.backends.tensorrt_runtime import library_shim, load, resolve, version
from elx.runners.output_lock import output_lock, temp_sibling

from elx.exporter.atomic import build_leftovers
from elx.exporter.tensorrt import ngram as ngram_engines
from elx.exporter.precision.fp16_export import refuse_fp16
from elx.exporter.progress import Progress
from elx.exporter.tensorrt.precision import convert as convert_fp16
from elx.exporter.tensorrt.precision import verify as verify_fp16
from elx.exporter.tensorrt.profiles import Limits, axis_ranges, input_profiles

ENGINES = "engines"
PRECISIONS = ("fp32", "fp16")
RTX_TARGETS = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")  # TensorRT for RTX 1.7's ComputeCapability values
RTX_DEFAULT_TARGETS = ("8.0", "8.6", "8.9", "12.0")  # Ampere and later, as TensorRT for RTX builds by default
NGRAM_MODES = ("auto", "engine", "host")
ENGINE_WEIGHT = 10  # ETA weight of one engine build beside writing the manifest (exporter/progress.py)


def _targets(runtime: str, requested) -> list[str]:
    if runtime == "tensorrt":
        if requested:
            raise ElxError("NVIDIA TensorRT builds for the GPU it runs on; leave out --compute-capability "
                           "(or use --runtime tensorrt-rtx to build ahead of time)")
        return [_current_capability()]
    items = requested.split(",") if isinstance(requested, str) else list(requested or RTX_DEFAULT_TARGETS)
    targets = [str(c).strip().replace("sm_", "").replace("sm", "") for c in items if str(c).strip()]
    targets = [f"{t[:-1]}.{t[-1]}" if "." not in t and t.isdigit() else t for t in targets]
    bad = [t for t in targets if t not in RTX_TARGETS]
    if bad or not targets:
        raise ElxError(f"TensorRT for RTX cannot target compute capability {', '.join(bad) or '(none)'}; "
                       f"choose from {', '.join(RTX_TARGETS)}")
    return sorted(set(targets), key=lambda t: [int(x) for x in t.split(".")])


def _current_capability() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}.{minor}"
    except ImportError:
        pass
    raise ElxError("NVIDIA TensorRT builds engines on a GPU and none was found (with PyTorch CUDA); use "
                   "--runtime tensorrt-rtx to build ahead of time without one")


def _worker_env(shim: Path | None) -> dict:
    env = dict(os.environ)
    root = str(Path(elx.__file__).resolve().parents[1])  # the folder that holds the elx package
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if shim is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(shim)] + ([env["LD_LIBRARY_PATH"]]
                                                                if env.get("LD_LIBRARY_PATH") else []))
    return env


def _run_worker(job: dict, env: dict, label: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "elx.exporter.tensorrt.worker"], input=json.dumps(job),
                          capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    said = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    status = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    return {"ok": False, "error": {"stage": "crash", "desc": f"{label} crashed ({status}): "
                                                             f"{said[-1] if said else 'no output'}"}}


def _error_text(graph: str, source: str, result: dict) -> str:
    error = result["error"]
    if error.get("op"):
        return (f"{graph} ({source}): node {error.get('node')!r} (op {error['op']}) is not supported: "
                f"{' '.join(str(error.get('desc', '')).split())}")
    return f"{graph} ({source}): {error['stage']} failed: {' '.join(str(error.get('desc', '')).split())}"


class _Build:
    """One build: settings, temporary folders, and the per-graph results."""

    def __init__(self, folder: Path, manifest: Manifest, runtime, trt, targets, limits, precision, progress):
        self.folder, self.manifest, self.runtime, self.trt = folder, manifest, runtime, trt
        self.targets, self.limits, self.precision, self.progress = targets, limits, precision, progress
        self.axes = axis_ranges(manifest, limits)
        self.work = Path(tempfile.mkdtemp(prefix="elx-engines-"))
        self.staging = temp_sibling(folder / ENGINES, "partial")  # .engines.PID-XXXXXXXX.partial
        self.staging.mkdir()
        self.env = _worker_env(library_shim(trt, self.work))
        self.fp16_counts, self.fp16_twins = {}, {}

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        if self.staging.exists():
            shutil.rmtree(self.staging, ignore_errors=True)

    def prepared(self, graph: str, source: Path, ort_twin: Path | None = None) -> Path:
        """The ONNX file to hand to TensorRT: ``source``, rewritten to fp16 if asked.

        ``ort_twin``: an ONNX Runtime-runnable graph computing the same as ``source`` (which may hold a plugin
        node); its fp16 rewrite is what the verification runs."""
        if self.precision == "fp32":
            return source
        converted, counts = convert_fp16(self.manifest, {graph: source}, self.work / "fp16")
        self.fp16_counts[graph] = counts[graph]
        self.fp16_twins[graph] = converted[graph]
        if ort_twin is not None:
            twin, _ = convert_fp16(self.manifest, {graph: ort_twin}, self.work / "fp16-ort")
            self.fp16_twins[graph] = twin[graph]
        return converted[graph]

    def engine(self, graph: str, onnx_file: Path, plugin: dict | None = None) -> dict:
        profiles = input_profiles(self.manifest, graph, self.axes)
        job = {"runtime": self.runtime.name, "onnx": str(onnx_file), "engine": str(self.staging / f"{graph}.plan"),
               "profiles": {name: spec["profiles"] for name, spec in profiles.items()},
               "compute_capabilities": self.targets if self.runtime.name == "tensorrt_rtx" else [],
               "plugin": plugin}
        result = _run_worker(job, self.env, f"{self.runtime.label} building {graph}")
        if result["ok"]:
            result["profiles"] = {n: p for n, p in profiles.items() if n in result["inputs"]}
        return result


def _record(graph: str, source: str, folder: Path, result: dict) -> dict:
    inputs = {}
    for name, spec in result["profiles"].items():
        reported = result["inputs"][name]
        if reported["dtype"] != spec["dtype"]:
            raise ElxError(f"the {graph} engine takes {name!r} as {reported['dtype']}, the manifest says "
                           f"{spec['dtype']}; re-run 'elx export'")
        inputs[name] = {"dtype": spec["dtype"], "axes": spec["axes"], "shape": reported["shape"],
                        "profiles": reported["profiles"]}
    return {"file": f"{ENGINES}/{graph}.plan", "source": source, "source_bytes": (folder / source).stat().st_size,
            "bytes": result["bytes"], "build_seconds": round(result["seconds"], 3), "inputs": inputs,
            "outputs": result["outputs"]}


def _build_step_with_ngram(build: _Build, mode: str, n: int) -> tuple[dict, str, dict]:
    """The decoder engine of an ngram export: plugin in the engine, else (auto) blocking on the host."""
    manifest, folder = build.manifest, build.folder
    step = manifest.graphs[manifest.step]
    reason = None
    if mode != "host":
        try:
            if not step.get("tensorrt_file"):
                raise ElxError(f"{step['file']} has no TensorRT sibling graph (an export from an older elx); "
                               "re-export with --pass ngram")
            if build.runtime.name == "tensorrt_rtx":
                library = ngram_engines.compiled_library("kernel", build.targets, build.staging)
                plugin = {"kind": "python"}
                how = "Python IPluginV3 (runners/backends/tensorrt_ngram.py) launching the CUDA kernel of plugins_cuda/"
            else:
                library = ngram_engines.compiled_library("plugin", build.targets, build.staging)
                plugin = {"kind": "library", "path": str(library)}
                how = "C++ IPluginV3 library of plugins_cuda/"
            source = step["tensorrt_file"]
            onnx_file = build.prepared(manifest.step, folder / source, ort_twin=folder / step["file"])
            result = build.engine(manifest.step, onnx_file, plugin)
            if result["ok"]:
                record = {"size": n, "blocking": "engine", "plugin": how, "library": f"{ENGINES}/{library.name}"}
                return result, source, record
            reason = _error_text(manifest.step, source, result)
        except ElxError as err:
            reason = str(err)
        if mode == "engine":
            raise ElxError(f"n-gram blocking cannot go into the engine: {reason}")
        for name in (ngram_engines.KERNEL_LIBRARY, ngram_engines.PLUGIN_LIBRARY):
            (build.staging / name).unlink(missing_ok=True)
        build.progress.say(f"{build.progress.title}: n-gram blocking stays on the host: {reason}")
    # host blocking: the same graph without the plugin node, verified against the export's ORT graph
    source = step["tensorrt_file"] if step.get("tensorrt_file") else step["file"]
    stripped = ngram_engines.strip_blocking(folder / source, build.work / "decoder.host.onnx")
    stripped_ort = ngram_engines.strip_blocking(folder / step["file"], build.work / "decoder.host.ort.onnx")
    check = ngram_engines.verify_stripped(manifest, stripped_ort, n)
    onnx_file = build.prepared(manifest.step, stripped, ort_twin=stripped_ort)
    result = build.engine(manifest.step, onnx_file)
    if not result["ok"]:
        raise ElxError("cannot build the engine " + _error_text(manifest.step, source, result))
    record = {"size": n, "blocking": "host", "reason": reason or "asked for (--ngram host)",
              "removed_inputs": ngram_engines.history_inputs(manifest), "removed_outputs": [step["blocked"]["output"]],
              "verification": check}
    return result, source, record


def _verify_fp16(build: _Build, step_host_file: Path | None) -> dict:
    """The fp16 rewrites (their ORT-runnable twins) against the fp32 graphs they replace, on ONNX Runtime."""
    manifest = build.manifest
    reference = manifest
    if step_host_file is not None:  # host blocking: the reference is the unblocked decoder the engine comes from
        reference = ngram_engines.host_manifest(manifest, step_host_file)
    return verify_fp16(reference, build.fp16_twins)


def _commit(folder: Path, staging: Path, data: dict) -> Path:
    """Rename the finished engines folder into place and replace the manifest; old engines go last."""
    tmp = temp_sibling(folder / FILENAME, "tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    target, old = folder / ENGINES, None
    try:
        if target.exists():
            old = temp_sibling(folder / ENGINES, "old")
            target.rename(old)
        staging.rename(target)
        os.replace(tmp, folder / FILENAME)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ElxError(f"cannot write the engines into {folder} ({err.strerror}); check the folder's permissions")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def clean_leftovers(folder: Path) -> None:
    """Remove what killed builds left in ``folder`` (call it holding the export's lock): staging folders, manifest
    copies, and replaced engines, put back first when the engines folder is missing (a build killed between the
    two renames of ``_commit``: the manifest still names the old engines)."""
    for entry in build_leftovers(folder):
        replaced = entry.name.endswith(".old") or entry.name.startswith(f".{ENGINES}.old-")
        if entry.is_dir() and replaced and not (folder / ENGINES).exists():
            entry.rename(folder / ENGINES)
        elif entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def build_engine(folder, *, precision: str = "fp32", max_batch_size: int = 8, max_beams: int = 4,
                 max_input_length: int = 512, max_new_tokens: int = 128, runtime: str = "auto",
                 compute_capabilities=None, ngram: str = "auto", quiet: bool = False, progress=None) -> Path:
    """Build TensorRT engines for the export in ``folder`` into ``folder/engines`` and record them in its manifest.

    ``compute_capabilities``: TensorRT for RTX targets, e.g. ``["8.6"]`` or ``"8.0,12.0"`` (default: 8.0, 8.6,
    8.9, 12.0).  ``ngram`` (``--pass ngram`` exports): ``auto`` puts the blocking into the engine when it can and
    otherwise keeps it on the host (said on stderr unless ``quiet``, and in the manifest), ``engine`` fails
    instead, ``host`` does not try.  ``progress``: one stage per engine as a bar, plain lines or nothing
    (``exporter/progress.py``; None: a bar when stderr is a terminal); ``quiet`` says nothing.  Returns the
    engines folder."""
    check_arguments("build_engine", locals())  # runners/arguments.py: one line naming a wrong argument
    folder = Path(folder).expanduser().absolute()
    manifest = Manifest.load(folder)
    refuse_fp16(manifest, "build engines")
    if "fused-attention" in manifest.pass_names():
        raise ElxError("TensorRT has no layer for --pass fused-attention's ONNX Runtime GroupQueryAttention nodes; build "
                       "engines from an export without that pass")
    if "fused-norm" in manifest.pass_names():
        raise ElxError("TensorRT has no layer for --pass fused-norm's ONNX Runtime (Skip)SimplifiedLayerNormalization "
                       "nodes; build engines from an export without that pass")
    if precision not in PRECISIONS:
        raise ElxError(f"unknown precision {precision!r}; choose fp32 or fp16")
    if ngram not in NGRAM_MODES:
        raise ElxError(f"unknown n-gram mode {ngram!r}; choose auto, engine or host")
    limits = Limits(max_batch_size, max_beams, max_input_length, max_new_tokens).checked()
    info = resolve(runtime)
    if info.name != "tensorrt" and "unpad" in manifest.pass_names():
        raise ElxError("TensorRT for RTX has no NonZero layer, which --pass unpad's packed rows are indexed by; build "
                       "engines from an export without --pass unpad (or with NVIDIA TensorRT: --runtime tensorrt)")
    trt = load(info)
    targets = _targets(info.name, compute_capabilities)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ElxError(f"cannot write in {folder} (permission denied); build the engines in a writable export folder")
    order = [manifest.step, *manifest.stages]  # the step first: its plugin is the likeliest failure
    total = len(order) * ENGINE_WEIGHT + (precision == "fp16") + 1
    with Progress("elx build-engine", total, "none" if quiet else progress) as report, \
            output_lock(folder, "export folder"):  # elx export --force of the same folder waits for no one: refused
        clean_leftovers(folder)
        build = _Build(folder, manifest, info, trt, targets, limits, precision, report)
        try:
            graphs, ngram_record, step_host = {}, None, None
            n = ngram_engines.ngram_size(manifest)
            for graph in order:
                with report.stage(f"{graph} engine", ENGINE_WEIGHT) as stage:
                    if graph == manifest.step and n:
                        result, source, ngram_record = _build_step_with_ngram(build, ngram, n)
                        if ngram_record["blocking"] == "host":
                            step_host = build.work / "decoder.host.ort.onnx"
                    else:
                        source = manifest.graphs[graph]["file"]
                        result = build.engine(graph, build.prepared(graph, folder / source))
                        if not result["ok"]:
                            raise ElxError("cannot build the engine " + _error_text(graph, source, result))
                    graphs[graph] = _record(graph, source, folder, result)
                    stage.detail = f"{result['bytes'] / 1e6:.1f} MB from {source} ({precision})"
            graphs = {name: graphs[name] for name in [*manifest.stages, manifest.step]}
            build_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
            section = {"format": FORMAT, "build_id": build_id, "folder": ENGINES, "runtime": info.name,
                       "runtime_version": version(trt), "precision": precision, "tf32": False,
                       "compute_capabilities": targets, "limits": limits.as_dict(), "axes": build.axes,
                       "graphs": graphs}
            if ngram_record is not None:
                section["ngram"] = ngram_record
            if precision == "fp16":
                with report.stage("fp16 engines checked on ONNX Runtime") as stage:
                    checked = _verify_fp16(build, step_host)
                    stage.detail = (f"relative max abs logits diff {checked['relative_diff']:.2e} (tolerance "
                                    f"{checked['relative_tolerance']:.2e})")
                section["fp16"] = {"rule": "exporter/precision/fp16.py", "graphs": build.fp16_counts,
                                   "verification": checked}
            with report.stage("write engines and manifest"):
                (build.staging / BUILD_FILE).write_text(json.dumps({"build_id": build_id, "runtime": info.name,
                                                                    "runtime_version": version(trt)}, indent=1) + "\n")
                data = json.loads(json.dumps(manifest.data))
                data[SECTION] = section
                return _commit(folder, build.staging, data)
        finally:
            build.close()
