"""``elx export``: load, export, verify, apply passes, write the folder and its manifest.

Everything is written into a temporary sibling of ``--output`` and renamed into place at the
very end, so the output folder exists only when the whole export (passes and their
verification included) succeeded.
"""
from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from elx.runners import options
from elx.runners.manifest import FORMAT, VERSION, Manifest

from elx._version import __version__
from elx.exporter.atomic import check_output, output_path, staged_folder
from elx.exporter.capture.stitched import Capture
from elx.exporter.tokenizer.chat_template import save_chat_template
from elx.runners.errors import ElxError
from elx.exporter.capture.decoder_only import PROMPT_CACHE_FORMS, export_decoder_only
from elx.exporter.capture.onnx_export import (decoder_spec, describe_decoder, export_cross_kv, export_decoder,
                                             export_encoder)
from elx.exporter.passes import check_model_kind, check_not_applied, parse_passes
from elx.exporter.passes.catalog import precision_refusal, prompt_cache_refusal
from elx.exporter.precision.fp16_export import check_precision, fp16_checks, refuse_fp16
from elx.exporter.progress import WEIGHTS, Progress, pass_lines
from elx.exporter.memory import (check_export_memory, collector_skips_existing_objects, free_weights,
                                 release_memory)
from elx.exporter.source.locate import locate_model
from elx.exporter.capture.shared_weights import folder_bytes, store_weights_once
from elx.exporter.source.load import resolve_model
from elx.exporter.verification.verify import (DRAWS, cases_kept, default_shapes, require_within_tolerance,
                                              tolerance_record, torch_references, verify_export)


def _as_list(value):
    if value is None:
        return None
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _dims(model, family) -> dict:
    dims = family.dims(model.config)
    # Whisper's generate caps the decoder length at its position table (runners/whisper.py)
    if getattr(model.config, "max_target_positions", None) is not None:
        dims.setdefault("max_target_positions", int(model.config.max_target_positions))
    return dims


_TOKEN_FIELDS = ("decoder_start_token_id", "eos_token_id", "pad_token_id", "bos_token_id")  # the manifest's "tokens"


def _jsonable(value):
    """A generation config value as JSON: tuples as lists, sequence_bias's tuple keys as HF's [[ids], bias] pairs,
    config objects (watermarking, compilation) as their dicts."""
    if isinstance(value, dict):
        if value and all(isinstance(k, tuple) for k in value):
            return [[list(k), v] for k, v in value.items()]
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    return value


def generation_defaults(gen) -> dict:
    """Every field of the model's ``generation_config`` that differs from a fresh ``GenerationConfig``'s (special
    tokens aside: the manifest's ``tokens``), JSON-ready; the runners apply each (``runners/search/settings.py``).

    A field elx does not know, or one that selects a decoding mode elx refuses (``runners/options.py``), stops
    the export with one line naming it: nothing of the model's configuration is dropped."""
    from transformers import GenerationConfig

    fresh = GenerationConfig().to_dict()
    out = {}
    for name, value in gen.to_dict().items():
        if name.startswith("_") or name == "transformers_version" or name in _TOKEN_FIELDS or value is None:
            continue
        if name in fresh and value == fresh[name]:
            continue
        if not options.known(name):
            raise ElxError(f"the model's generation_config sets {name}={value!r}, which this elx does not know; "
                           "remove it from generation_config.json (HF's generate of this transformers version "
                           "would not use it either) or upgrade elx")
        out[name] = _jsonable(value)
    refused = options.refusal(out)
    if refused:
        raise ElxError(f"the model's generation_config sets {refused[0]}: {refused[1]} (in generation_config.json)")
    return out


def base_manifest(model, family, source: dict) -> dict:
    gen = model.generation_config
    defaults = generation_defaults(gen)
    if defaults.get("lang_to_id"):  # Whisper: language names for --language english (the runtime has no transformers)
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        defaults["language_codes"] = dict(TO_LANGUAGE_CODE)
    return {
        "format": FORMAT, "version": VERSION, "elx_version": __version__,
        "family": family.name, "architecture": type(model).__name__, "is_encoder_decoder": family.is_encoder_decoder,
        "source": source, "dims": _dims(model, family),
        "tokens": {"decoder_start_token_id": gen.decoder_start_token_id, "eos_token_id": _as_list(gen.eos_token_id),
                   "pad_token_id": gen.pad_token_id, "bos_token_id": gen.bos_token_id},
        "generation_defaults": defaults,
        "graphs": {}, "stages": ["encoder", "cross_kv"], "step": "decoder",
        "cache": {"self": [], "cross": {"kind": "beam-shared", "batch": "batch"}},
        "passes": [], "verification": {}, "precision": "fp32",
    }


def export_graphs(model, family, folder: Path, manifest: dict, progress: Progress, capture=None) -> None:
    """Trace (or stitch: ``exporter/capture``) and save the encoder-decoder graphs, one progress stage each."""
    def traced(name: str, export):
        with progress.stage(f"{name}.onnx", WEIGHTS[name]):
            return export(model, family, folder / f"{name}.onnx", *([capture] if capture is not None else []))

    if capture is not None:  # the decoder's template traced by a second process meanwhile
        capture.prefetch(lambda m: decoder_spec(m, family)[0], folder / "decoder.onnx")
    manifest["graphs"]["encoder"] = traced("encoder", export_encoder)
    manifest["graphs"]["cross_kv"] = traced("cross_kv", export_cross_kv)
    # described before it is traced: the verification's PyTorch reference can run while a second process still
    # traces the decoder's template (``Capture.while_waiting``)
    manifest["graphs"]["decoder"], manifest["cache"]["self"] = describe_decoder(model, family, folder / "decoder.onnx")
    manifest["graphs"]["decoder"], manifest["cache"]["self"] = traced("decoder", export_decoder)


def copy_tokenizer(model_folder: str | None, folder: Path, data: dict | None = None,
                   report: Progress | None = None) -> bool:
    """Save the source's tokenizer/feature extractor next to the graphs, in the form the runtime reads, checked
    against HF (``exporter/tokenizer/export.py``); record ``has_tokenizer``, ``tokenizer`` and ``languages`` in
    ``data`` (the manifest being written) and say each note in one line.

    A Whisper folder's processor (tokenizer + ``WhisperFeatureExtractor``) is saved whole: the
    runners read the feature extractor from ``tokenizer/`` for ``--audio``.
    """
    from elx.exporter.tokenizer.export import export_tokenizer

    data = {} if data is None else data
    exported = export_tokenizer(model_folder, folder, data.get("dims", {}).get("vocab_size"))
    data["has_tokenizer"] = exported.has_tokenizer
    data.update({k: v for k, v in (("tokenizer", exported.record), ("languages", exported.languages)) if v})
    for note in exported.notes if report is not None else ():
        report.say(f"elx: note: {note}")
    return exported.has_tokenizer


def run_passes(folder: Path, manifest: Manifest, requests: list, progress: Progress | None = None,
               after_each=None) -> None:
    """Apply parsed pass requests in order; each verifies itself and records its error in the manifest (one
    progress stage per pass, its verification included).

    ``after_each(manifest, record)`` runs after each pass (the fp16 export checks each pass in fp16)."""
    progress = progress or Progress("elx export", progress="none")
    if requests:
        refuse_fp16(manifest, "apply passes")
    for request in requests:
        with progress.stage(f"pass {request.name}", WEIGHTS["pass"]) as stage, \
                pass_lines(lambda text, name=request.name: progress.say(f"{progress.title}: pass {name}: {text}")):
            record = request.module_for(manifest).apply(folder, manifest, request.argument)
            manifest.data["passes"].append(record)
            stage.detail = f"verified, max abs logits diff {record['max_abs_logits_diff']:.2e}"
        if after_each is not None:
            after_each(manifest, record)


def finish_folder(folder: Path, manifest: Manifest, progress: Progress) -> None:
    """Store every weight once (``exporter/capture/shared_weights.py``) and write the manifest."""
    with progress.stage("store weights once", WEIGHTS["store"]) as stage:
        weights = manifest.data["weights"] = store_weights_once(folder, manifest)
        shared = weights["tensors"] - weights["distinct_tensors"]
        stage.detail = (f"{weights['bytes'] / 1e6:.1f} MB in {weights['file']}, {weights['distinct_tensors']} "
                        f"tensors, {shared} more read from the same bytes" if weights["file"] else "no large tensors")
    with progress.stage("write manifest", WEIGHTS["write"]):
        manifest.save(folder)


def say_written(progress: Progress, output: Path, started: float) -> None:
    """The summary line: the folder, its size on disk and the time taken."""
    files = sum(1 for p in output.rglob("*") if p.is_file())
    progress.say(f"{progress.title}: wrote {output} ({folder_bytes(output) / 1e6:.1f} MB in {files} files) in "
                 f"{time.perf_counter() - started:.1f} s")


def apply_passes(source, target, passes: str, quiet: bool = True, progress=None) -> Path:
    """Apply ``passes`` to a copy of the export in ``source``; ``target`` appears only on success.
    ``progress``: see ``exporter/progress.py`` (``quiet`` says nothing, whatever ``progress`` says)."""
    requests = parse_passes(passes)
    started = time.perf_counter()
    with Progress("elx passes", len(requests) * WEIGHTS["pass"] + WEIGHTS["store"] + WEIGHTS["write"],
                  "none" if quiet else progress) as report:
        with staged_folder(target, force=True) as folder:
            shutil.copytree(source, folder, dirs_exist_ok=True)
            manifest = Manifest.load(folder)
            check_model_kind(requests, manifest.family, manifest.data.get("is_encoder_decoder", True), manifest.dims)
            check_not_applied(requests, manifest.pass_names())
            run_passes(folder, manifest, requests, report)
            finish_folder(folder, manifest, report)
        say_written(report, output_path(target), started)
    return output_path(target)


def _case_reporter(progress: Progress, stage):
    """The verification's progress: the bar moves per case (its ETA), a line per side once its cases are done
    (its time from the previous side's end: the graphs' includes loading their sessions)."""
    since = [time.perf_counter()]

    def report(side: str, done: int, total: int) -> None:
        stage.step(f"{side} case {done + 1} of {total}" if done < total else None)
        if done == total:
            progress.say(f"{progress.title}: verify: {side}, {total} cases in {time.perf_counter() - since[0]:.1f} s")
            since[0] = time.perf_counter()
    return report


def _side_lines(progress: Progress):
    """A line per side of the verification run outside its stage (``torch_references`` while the template of the step
    graph, decoder.onnx, traces in a second process)."""
    since = [time.perf_counter()]

    def report(side: str, done: int, total: int) -> None:
        if done == total:
            progress.say(f"{progress.title}: verify: {side}, {total} cases in {time.perf_counter() - since[0]:.1f} s "
                         "(while the step graph traces in a second process)")
            since[0] = time.perf_counter()
    return report


class ReferenceThreads:
    """How many threads PyTorch's reference takes for its next case (or layer: ``fp32_noise.in_float64``): the cores
    idle when it starts, and once the export's own other work has ended (``busy``: callables true while a second
    process traces a template, or while ``weights.data`` is still being written), the cores idle then.

    On two cores, a PyTorch reference on two threads beside the weights' writer took 4x as long (TinyLlama-1.1B
    dims, fp32 cases 3.9 -> 16.4 s: OpenMP's barriers wait for the thread the writer displaces), on one thread 2x;
    whisper-base's 30 s cases outlast its template's trace."""

    def __init__(self, *busy):
        self.busy = [each for each in busy if each is not None]
        self.count = idle_threads()
        self.widened = not self.busy

    def __call__(self) -> int:
        if not self.widened and not any(each() for each in self.busy):
            self.widened = True
            self.count = idle_threads()
        return self.count


def idle_cores(window: float = 0.1) -> float:
    """How many of the machine's cores were idle over the last ``window`` seconds (``/proc/stat``); the core count
    where that cannot be read."""
    def ticks():
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    cores = os.cpu_count() or 1
    try:
        idle0, all0 = ticks()
        time.sleep(window)
        idle1, all1 = ticks()
    except (OSError, ValueError, IndexError):
        return float(cores)
    return cores * (idle1 - idle0) / max(1, all1 - all0)


def idle_threads() -> int:
    """A thread per idle core now, at least one."""
    return max(1, min(os.cpu_count() or 1, round(idle_cores())))


@contextmanager
def reference_threads(threads: int):
    """PyTorch's reference forward of the verification on ``threads`` threads (restored after; ``ReferenceThreads``
    says how many).

    On a busy machine a second thread costs more than it gains (OpenMP's barriers wait for a descheduled thread):
    the real SmolLM2-135M, one forward [2, 11] on this 2-core machine at load 7, fp32 0.32 s on one thread, 1.36-1.65
    s on two.  On idle cores it halves the reference (same machine, quiet, the export's five cases: SmolLM2-135M
    fp32 1.1 -> 0.7 s, fp64 3.2 -> 2.0 s; TinyLlama-1.1B fp32 7.5 -> 3.8 s, fp64 32.5 -> 15.3 s).  While the second
    process traces a template, one core is busy: one thread."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextmanager
def _unless_closed(weights):
    """Leaving the block by an error: ``weights`` (a ``WeightsFile`` still being written, or None) aborted."""
    try:
        yield
    except BaseException:
        if weights is not None:
            weights.abort()
        raise


def _check_decoder_only_options(family, prompt_cache) -> str | None:
    """The prompt cache form of a decoder-only export (None for encoder-decoder models, which refuse the option)."""
    if family.is_encoder_decoder:
        if prompt_cache is not None:
            raise ElxError(f"--prompt-cache applies to decoder-only models; {family.name} is encoder-decoder "
                           "(its cross-attention cache is always shared by the beams); drop the option")
        return None
    return prompt_cache or "shared"


def _total_weight(requests: list, precision: str) -> float:
    """The export's stages' weights (``WEIGHTS``), graphs counted as an encoder-decoder export's."""
    graphs = WEIGHTS["encoder"] + WEIGHTS["cross_kv"] + WEIGHTS["decoder"]
    fp16 = {"fp16": WEIGHTS["fp16"] * (2 + len(requests)), "int8": WEIGHTS["fp16"] * 3}.get(precision, 0)
    return (WEIGHTS["load"] + graphs + WEIGHTS["verify"] + WEIGHTS["pass"] * len(requests) + fp16 + WEIGHTS["store"]
            + WEIGHTS["write"])


def export_model(model: str, output, random_init: bool = False, passes: str | None = None, seed: int = 0,
                 force: bool = False, quiet: bool = False, precision: str = "fp32",
                 prompt_cache: str | None = None, progress=None, fp32_draws: str = "needed") -> Path:
    """Export, verify (fp32), apply passes; with ``precision="fp16"`` convert and check last
    (``exporter/precision/fp16_export.py``); store each weight once (``exporter/capture/shared_weights.py``).
    ``prompt_cache`` (decoder-only models: "shared", the default, or "per-beam") picks where the prompt's
    keys/values live (``exporter/capture/decoder_only.py``).  ``progress``: the stages as a bar, plain lines or
    nothing (``exporter/progress.py``; None: a bar when stderr is a terminal); ``quiet`` says nothing.
    ``fp32_draws``: "needed" runs fp32's other rounding draws only where the graphs are outside a bar of the first
    (``exporter/verification/verify.py``: ``LaterDraws``, the same verdict), "all" always; passes, fp16 and int8
    run all of them (the passes' bar is the export's largest)."""
    requests = parse_passes(passes)  # validate before any heavy work
    if fp32_draws not in DRAWS:
        raise ElxError(f"unknown fp32_draws {fp32_draws!r}; use one of {', '.join(DRAWS)}")
    draws = fp32_draws if not requests and precision == "fp32" else "all"
    check_precision(precision)
    refusal = precision_refusal([r.name for r in requests], precision)
    if refusal:
        raise ElxError(refusal)
    if prompt_cache is not None and prompt_cache not in PROMPT_CACHE_FORMS:
        raise ElxError(f"unknown --prompt-cache {prompt_cache!r}; use one of {', '.join(PROMPT_CACHE_FORMS)}")
    output = check_output(output, force)
    started = time.perf_counter()
    with (collector_skips_existing_objects(), cases_kept(),
          Progress("elx export", _total_weight(requests, precision), "none" if quiet else progress) as report):
        with staged_folder(output, force) as folder:  # locked: a second export to the same output is refused
            with report.stage(f"load {model}", WEIGHTS["load"]) as stage:
                check_export_memory(locate_model(model, random_init), precision)  # before any weight is read
                loaded = resolve_model(model, random_init=random_init, seed=seed)
                check_model_kind(requests, loaded.family.name, loaded.family.is_encoder_decoder,
                                 loaded.family.dims(loaded.model.config))
                form = _check_decoder_only_options(loaded.family, prompt_cache)
                refusal = form and prompt_cache_refusal([r.name for r in requests], form)
                if refusal:
                    raise ElxError(refusal)
                note = ", seeded random weights (--random-init)" if loaded.source["random_init"] else ""
                stage.detail = f"{type(loaded.model).__name__}, family {loaded.family.name}{note}"
            data = base_manifest(loaded.model, loaded.family, loaded.source)
            capture = Capture(loaded.model, loaded.family, folder, report=lambda line: report.say(f"{report.title}: {line}"))
            early = {}  # PyTorch's reference, computed while a second process traces the step's template

            def references(still_tracing):
                threads = ReferenceThreads(still_tracing, capture.weights_writing)
                with reference_threads(threads()):
                    early["sides"] = torch_references(loaded.model, Manifest(data, folder), report=_side_lines(report),
                                                      threads=threads, draws=draws)
            capture.while_waiting = references
            try:
                if form is None:
                    export_graphs(loaded.model, loaded.family, folder, data, report, capture)
                else:
                    export_decoder_only(loaded.model, loaded.family, folder, data, form, report, capture)
            except BaseException:
                capture.abort()
                raise
            # weights.data is still being written by a thread (exporter/capture/weights_writer.py) while PyTorch's
            # reference runs; every byte is on disk before the graphs' sessions load (``before_graphs``)
            writing = capture.hand_over_weights()
            capture.close()
            with _unless_closed(writing):  # a failure before the weights are all written drops the rest
                for spec in data["graphs"].values():
                    if spec["file"] in capture.records:
                        spec["capture"] = capture.records[spec["file"]]
                manifest = Manifest(data, folder)
                release_memory()  # the traces' garbage, before the verification's sessions load

                def before_graphs():
                    if writing is not None:
                        waited = time.perf_counter()
                        writing.close()  # the weights on disk (a failed write raised here)
                        waited = time.perf_counter() - waited
                        if waited >= 1:  # part of the "graphs" line that follows: the disk, not ONNX Runtime
                            report.say(f"{report.title}: weights.data: waited {waited:.1f} s for its last bytes "
                                       "on disk before the graphs' sessions")
                    if precision == "fp32":  # HF's model is not needed after its reference logits
                        free_weights(loaded.model)
                cases = len(default_shapes(manifest))
                sides = early.get("sides")
                threads = ReferenceThreads(writing.writing if writing is not None else None)
                with (report.stage("verify vs PyTorch", WEIGHTS["verify"], steps=(1 if sides else 3) * cases) as stage,
                      reference_threads(threads())):
                    # fp32's other rounding draws, where the graphs need them, run on the model loaded again
                    again = (lambda: resolve_model(model, random_init=random_init, seed=seed).model) \
                        if draws == "needed" else None
                    verification = verify_export(loaded.model, manifest, release_model=before_graphs,
                                                 report=_case_reporter(report, stage), references=sides,
                                                 threads=threads, reload_model=again)
                    require_within_tolerance(verification, "exported graphs vs PyTorch")
                    data["verification"]["export"] = verification
                    v = verification
                    data["verification"]["tolerance"] = tolerance_record(v["logits_magnitude"], v)
                    encoder = (f"; encoder output {v['max_abs_encoder_diff']:.2e} (tolerance "
                               f"{v['encoder_tolerance']:.2e})" if "encoder_tolerance" in v else " (prefill and step)")
                    noise = v["fp32_noise"]["max_torch_fp32_vs_fp64"]
                    stage.detail = (f"max abs logits diff {v['max_abs_logits_diff']:.2e} (tolerance "
                                    f"{v['tolerance']:.2e} at max |logit| {v['logits_magnitude']:.3g}; "
                                    f"PyTorch fp32 vs fp64 {noise:.2e}){encoder}")
            if precision == "fp32":  # passes verify graphs against graphs: HF's model goes first (6.8 GB at
                loaded.model = None  # SmolLM2-1.7B, beside the passes' sessions and the weights stored once)
                release_memory()
            with fp16_checks(precision, loaded.model, manifest, report) as fp16:
                run_passes(folder, manifest, requests, report, fp16.check_pass if fp16 else None)
                if fp16 is not None:
                    fp16.finish(folder, manifest)
            if precision == "int8":  # exporter/precision/int8.py: converted last, measured and recorded
                from elx.exporter.precision.int8_export import finish as finish_int8

                finish_int8(loaded.model, folder, manifest, report)
            if loaded.save_tokenizer is None:
                copy_tokenizer(loaded.source.get("path"), folder, data, report)
            else:  # GGUF: no folder
                data["has_tokenizer"] = bool(loaded.save_tokenizer(folder / "tokenizer"))
            chat = save_chat_template(folder, loaded.source.get("path")) if data["has_tokenizer"] else None
            if chat is not None:
                data["chat_template"] = chat
            finish_folder(folder, manifest, report)
        say_written(report, output, started)
    return output
