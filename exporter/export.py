"""``elx export``: load, export, verify, apply passes, write the folder and its manifest.

Everything is written into a temporary sibling of ``--output`` and renamed into place at the
very end, so the output folder exists only when the whole export (passes and their
verification included) succeeded.
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from runners.manifest import FORMAT, VERSION, Manifest

from elx import __version__
from .atomic import check_output, output_path, staged_folder
from runners.errors import ElxError
from .decoder_only import PROMPT_CACHE_FORMS, export_decoder_only
from .onnx_export import export_cross_kv, export_decoder, export_encoder
from .passes import check_model_kind, check_not_applied, parse_passes
from .precision_export import check_precision, fp16_checks, refuse_fp16
from .sources import resolve_model
from .verify import require_within_tolerance, tolerance_record, verify_export

# generation_config fields the runners implement (anything else set to a non-default value is refused there)
GENERATION_FIELDS = ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "num_beams", "length_penalty",
                     "early_stopping", "num_return_sequences", "no_repeat_ngram_size", "forced_bos_token_id",
                     "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids",
                     "do_sample", "repetition_penalty", "bad_words_ids", "encoder_no_repeat_ngram_size",
                     "is_multilingual", "lang_to_id", "task_to_id", "no_timestamps_token_id", "return_timestamps")


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


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


def base_manifest(model, family, source: dict) -> dict:
    gen = model.generation_config
    defaults = {}
    for name in GENERATION_FIELDS:
        value = getattr(gen, name, None)
        if value is not None:
            defaults[name] = value
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


def export_graphs(model, family, folder: Path, manifest: dict, quiet: bool) -> None:
    def timed(name: str, export):
        started = time.perf_counter()
        result = export(model, family, folder / f"{name}.onnx")
        _log(f"  {name + '.onnx':<13} ({time.perf_counter() - started:.1f} s)", quiet)  # this graph's own time
        return result

    manifest["graphs"]["encoder"] = timed("encoder", export_encoder)
    manifest["graphs"]["cross_kv"] = timed("cross_kv", export_cross_kv)
    manifest["graphs"]["decoder"], manifest["cache"]["self"] = timed("decoder", export_decoder)


def copy_tokenizer(model_folder: str | None, folder: Path) -> bool:
    """Save the source's tokenizer/feature extractor next to the graphs, when it has one.

    A Whisper folder's processor (tokenizer + ``WhisperFeatureExtractor``) is saved whole: the
    runners read the feature extractor from ``tokenizer/`` for ``--audio``.
    """
    names = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json", "sentencepiece.bpe.model",
             "preprocessor_config.json")
    if not model_folder or not any((Path(model_folder) / n).is_file() for n in names):
        return False
    from transformers import AutoFeatureExtractor, AutoProcessor, AutoTokenizer

    for loader in (AutoProcessor, AutoTokenizer, AutoFeatureExtractor):
        try:
            loader.from_pretrained(model_folder, local_files_only=True).save_pretrained(folder / "tokenizer")
            return True
        except Exception:  # noqa: BLE001 - no tokenizer is fine
            continue
    return False


def run_passes(folder: Path, manifest: Manifest, requests: list, quiet: bool = True, after_each=None) -> None:
    """Apply parsed pass requests in order; each verifies itself and records its error in the manifest.

    ``after_each(manifest, record)`` runs after each pass (the fp16 export checks each pass in fp16)."""
    if requests:
        refuse_fp16(manifest, "apply passes")
    for request in requests:
        record = request.module.apply(folder, manifest, request.argument)
        manifest.data["passes"].append(record)
        _log(f"  pass {request.name}: max abs logits diff {record['max_abs_logits_diff']:.2e}", quiet)
        if after_each is not None:
            after_each(manifest, record)


def apply_passes(source, target, passes: str, quiet: bool = True) -> Path:
    """Apply ``passes`` to a copy of the export in ``source``; ``target`` appears only on success."""
    requests = parse_passes(passes)
    with staged_folder(target, force=True) as folder:
        shutil.copytree(source, folder, dirs_exist_ok=True)
        manifest = Manifest.load(folder)
        check_model_kind(requests, manifest.family, manifest.data.get("is_encoder_decoder", True))
        check_not_applied(requests, manifest.pass_names())
        run_passes(folder, manifest, requests, quiet)
        manifest.save(folder)
    return output_path(target)


def _check_decoder_only_options(family, prompt_cache) -> str | None:
    """The prompt cache form of a decoder-only export (None for encoder-decoder models, which refuse the option)."""
    if family.is_encoder_decoder:
        if prompt_cache is not None:
            raise ElxError(f"--prompt-cache applies to decoder-only models; {family.name} is encoder-decoder "
                           "(its cross-attention cache is always shared by the beams); drop the option")
        return None
    return prompt_cache or "shared"


def export_model(model: str, output, random_init: bool = False, passes: str | None = None, seed: int = 0,
                 force: bool = False, quiet: bool = False, precision: str = "fp32",
                 prompt_cache: str | None = None) -> Path:
    """Export, verify (fp32), apply passes; with ``precision="fp16"`` convert and check last
    (``exporter/precision_export.py``).  ``prompt_cache`` (decoder-only models: "shared", the default, or
    "per-beam") picks where the prompt's keys/values live (``exporter/decoder_only.py``)."""
    requests = parse_passes(passes)  # validate before any heavy work
    check_precision(precision)
    if prompt_cache is not None and prompt_cache not in PROMPT_CACHE_FORMS:
        raise ElxError(f"unknown --prompt-cache {prompt_cache!r}; use one of {', '.join(PROMPT_CACHE_FORMS)}")
    output = check_output(output, force)
    with staged_folder(output, force) as folder:  # locked: a second export to the same output is refused
        loaded = resolve_model(model, random_init=random_init, seed=seed)
        check_model_kind(requests, loaded.family.name, loaded.family.is_encoder_decoder)
        form = _check_decoder_only_options(loaded.family, prompt_cache)
        if form is not None and precision != "fp32":
            raise ElxError(f"--precision {precision} is not available for decoder-only exports ({loaded.family.name}) "
                           "yet; export in fp32 (drop --precision)")
        note = " with seeded random weights (--random-init)" if loaded.source["random_init"] else ""
        _log(f"elx export: {model} ({type(loaded.model).__name__}, family {loaded.family.name}){note}", quiet)
        data = base_manifest(loaded.model, loaded.family, loaded.source)
        if form is None:
            export_graphs(loaded.model, loaded.family, folder, data, quiet)
        else:
            export_decoder_only(loaded.model, loaded.family, folder, data, form, lambda m: _log(m, quiet))
        manifest = Manifest(data, folder)
        report = verify_export(loaded.model, manifest)
        require_within_tolerance(report, "exported graphs vs PyTorch")
        data["verification"]["export"] = report
        data["verification"]["tolerance"] = tolerance_record(report["logits_magnitude"])
        encoder = (f", encoder {report['max_abs_encoder_diff']:.2e}" if "max_abs_encoder_diff" in report
                   else " (prefill and step)")
        _log(f"  verified vs PyTorch: max abs logits diff {report['max_abs_logits_diff']:.2e}{encoder} (tolerance "
             f"{report['tolerance']:.2e} at max |logit| {report['logits_magnitude']:.3g})", quiet)
        with fp16_checks(precision, loaded.model, manifest, lambda message: _log(message, quiet)) as fp16:
            run_passes(folder, manifest, requests, quiet, fp16.check_pass if fp16 else None)
            if fp16 is not None:
                fp16.finish(folder, manifest)
        data["has_tokenizer"] = copy_tokenizer(loaded.source.get("path"), folder)
        manifest.save(folder)
    _log(f"wrote {output}", quiet)
    return output
