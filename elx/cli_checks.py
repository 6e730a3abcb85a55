"""The command line's argument checks that need more than argparse, run before any heavy import.

Every refusal of a bad command line comes at once (issue 27): these checks read only JSON (the
export's ``manifest.json``, the model's ``config.json`` or preset) and import no PyTorch, transformers,
onnx or ONNX Runtime; the command imports those after they pass.  What a check cannot decide
without the model or the runtime is left to the command, which checks it again in full.
"""
from __future__ import annotations

from elx.runners.errors import ElxError

BENCH_PRECISIONS = ("fp32", "fp16", "int8")  # what may follow '@' in a bench pass set (elx.exporter.bench.bench.split_precision)


def check_export(model: str, random_init: bool, passes: str | None, output, force: bool,
                 prompt_cache: str | None = None, precision: str | None = None) -> None:
    """``elx export``: the passes (names, arguments, combinations), the model (a folder, a preset, a cached hub id;
    a supported architecture) and whether the passes and ``--prompt-cache`` apply to it, and the output folder."""
    from elx.exporter.atomic import check_output
    from elx.exporter.families.catalog import family_for_architecture
    from elx.exporter.source.locate import locate_model
    from elx.exporter.passes import check_model_kind, parse_passes
    from elx.exporter.passes.catalog import precision_refusal

    requests = parse_passes(passes)
    refusal = precision_refusal([r.name for r in requests], precision)
    if refusal:
        raise ElxError(refusal)
    where = locate_model(model, random_init)
    family = family_for_architecture(where.architecture())
    check_model_kind(requests, family.name, family.is_encoder_decoder, stated_head_counts(where.config()))
    check_prompt_cache([prompt_cache] if prompt_cache is not None else [], family)
    check_pass_layout([r.name for r in requests], [prompt_cache], family)
    check_output(output, force)


def stated_head_counts(config: dict) -> dict | None:
    """The query and key/value head counts when ``config.json`` states both (HF's config classes default the
    key/value heads to the query heads, so a stated pair is what the loaded model has); None otherwise, and the
    refusals that need them wait for the loaded model."""
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int):
        return {"num_heads": heads, "num_kv_heads": kv}
    return None


def check_generation(folder, options: dict):
    """``elx generate`` / ``elx compare``: the folder is an export, and the generate options resolve against its
    manifest (token ids inside its vocabulary, lengths, beams, sampling knobs) as ``Generator.generate`` resolves
    them.  Returns the manifest."""
    from elx.runners.arguments import check_generation_options
    from elx.runners.manifest import Manifest
    from elx.runners.search.settings import resolve_settings

    manifest = Manifest.load(folder)
    check_generation_options(options, manifest.dims.get("vocab_size"))
    from elx.runners.families import rules_for

    resolve_settings(manifest, **rules_for(manifest).settings_options(options))  # Whisper: its loop's own go aside
    return manifest


def check_bench_model(model: str | None, random_init: bool, pass_sets: list[str], prompt_caches=(None,),
                      text: str | None = None) -> None:
    """``elx bench``: at least one pass set, none twice, every one parses and applies to the model (its family and
    the head counts its config states: slim on a GQA Llama is refused here, not after the baseline's export),
    and the prompt cache forms fit it.  ``model`` None: the default preset (t5-small); ``text``: the
    ``--pass-sets`` value as given, for the messages."""
    from elx.exporter.families.catalog import family_for_architecture
    from elx.exporter.source.locate import locate_model
    from elx.exporter.passes import check_model_kind, parse_passes

    shown = repr(text) if text is not None else "--pass-sets"
    if not pass_sets:
        raise ElxError(f"--pass-sets {shown} names no pass set; pass e.g. 'baseline|el' (sets separated by '|' or "
                       "spaces, passes in a set by ',')")
    requests = []
    for pass_set in pass_sets:
        passes, _, precision = pass_set.partition("@")  # elx.exporter.bench.bench.split_precision's form, without its imports
        if precision and precision not in BENCH_PRECISIONS:
            raise ElxError(f"--pass-sets: unknown precision {precision!r} in {pass_set!r}; after '@' name one of "
                           f"{', '.join(BENCH_PRECISIONS)}")
        requests.append(parse_passes("" if passes in ("baseline", "base", "none") else passes))
    keys = [_pass_set_key(s) for s in pass_sets]
    twice = next((s for i, s in enumerate(pass_sets) if keys[i] in keys[:i]), None)
    if twice is not None:
        raise ElxError(f"--pass-sets names the pass set {twice or 'baseline'!r} twice; name each once")
    where = locate_model(model or "t5-small", random_init or model is None)
    family = family_for_architecture(where.architecture())
    heads = stated_head_counts(where.config())
    for request in requests:
        check_model_kind(request, family.name, family.is_encoder_decoder, heads)
    check_prompt_cache([form for form in prompt_caches if form is not None], family)
    check_pass_layout([r.name for request in requests for r in request], prompt_caches, family)


def _pass_set_key(pass_set: str) -> tuple:
    """What a bench pass set exports: its passes in order, and its precision ('' for the bench's own)."""
    passes, _, precision = pass_set.partition("@")
    return ("" if passes in ("baseline", "base", "none") else passes), precision


PROMPT_CACHE_FORMS = ("shared", "per-beam")  # elx.exporter.capture.decoder_only.PROMPT_CACHE_FORMS, without its imports


def check_prompt_cache(forms: list[str], family) -> None:
    """``--prompt-cache`` (export, bench): known forms, and only for a decoder-only model's export."""
    unknown = next((form for form in forms if form not in PROMPT_CACHE_FORMS), None)
    if unknown is not None:
        raise ElxError(f"--prompt-cache: unknown form {unknown!r}; use one of {', '.join(PROMPT_CACHE_FORMS)}")
    if forms and family.is_encoder_decoder:
        raise ElxError(f"--prompt-cache applies to decoder-only models; {family.name} is encoder-decoder (its "
                       "cross-attention cache is always shared by the beams); drop the option")


def check_pass_layout(names: list[str], forms, family) -> None:
    """Passes that need one cache per row (``--pass fused-attention``) with every ``--prompt-cache`` form asked
    (None: the default, shared) of a decoder-only model."""
    from elx.exporter.passes.catalog import prompt_cache_refusal

    if family.is_encoder_decoder:
        return  # the passes' own refusal of the model kind says why
    for form in forms or [None]:
        reason = prompt_cache_refusal(names, form)
        if reason:
            raise ElxError(reason)


def check_export_folder(folder) -> None:
    """``elx build-engine``: the folder is an elx export."""
    from elx.runners.manifest import Manifest

    Manifest.load(folder)


def check_subtitles(manifest, form: str, source: dict, options: dict) -> None:
    """``--format srt|vtt``: subtitles of one Whisper transcription, with timestamps (turned on here)."""
    if form not in ("srt", "vtt"):
        return
    if "input_features" not in manifest.encoder_inputs():
        raise ElxError(f"--format {form} writes the subtitles of a Whisper transcription; this model ({manifest.family}) "
                       "takes tokens: use --format human or jsonl")
    if len(source.get("audio") or []) != 1:
        raise ElxError(f"--format {form} writes one subtitle file: pass one --audio file per run (or use --format "
                       "jsonl, which gives every file's segments)")
    if (options.get("num_return_sequences") or 1) > 1:
        raise ElxError(f"--format {form} writes one transcription: drop --num-return-sequences (or use --format jsonl)")
    if options.get("return_timestamps") is False:
        raise ElxError(f"--format {form} needs segment times: drop --no-return-timestamps")
    options["return_timestamps"] = True


def check_audio_files(manifest, files: list, options: dict) -> None:
    """``--audio``: each file's header read (a missing, unreadable or damaged file, or one over 4 h, is refused before
    the runtime loads); a file over one window (30 s) runs HF's long-form generation, which needs timestamps: they
    are turned on, as ``--help`` says (HF's ``generate`` refuses long-form features under a generation config with
    ``return_timestamps: false``, openai's own, until ``return_timestamps=True`` is passed: the CLI passes it)."""
    from elx.runners.inputs.audio import LONG_FORM_LIMIT, audio_info, load_feature_extractor, resampled_length

    infos = [audio_info(file) for file in files]  # the files' own faults first
    for info in infos:
        if info.seconds > LONG_FORM_LIMIT:
            raise ElxError(f"{info.path} lasts {info.seconds:.1f} s; elx transcribes up to {LONG_FORM_LIMIT} s per "
                           "file: split it")
    extractor = load_feature_extractor(manifest.folder)
    longest = None
    for info in infos:
        if resampled_length(info.frames, info.rate, extractor.sampling_rate) > extractor.n_samples:
            longest = info if longest is None or info.seconds > longest.seconds else longest
    if longest is None:
        return
    if options.get("return_timestamps") is False:
        raise ElxError(f"{longest.path} lasts {longest.seconds:.1f} s: over {extractor.chunk_length} s Whisper runs "
                       "HF's long-form generation, which needs timestamps; drop --no-return-timestamps (or "
                       "return_timestamps from --generation-config)")
    options["return_timestamps"] = True
