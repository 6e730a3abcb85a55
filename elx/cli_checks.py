"""The command line's argument checks that need more than argparse, run before any heavy import.

Every refusal of a bad command line comes at once (issue 27): these checks read only JSON (the
export's ``manifest.json``, the model's ``config.json`` or preset) and import no PyTorch, transformers,
onnx or ONNX Runtime; the command imports those after they pass.  What a check cannot decide
without the model or the runtime is left to the command, which checks it again in full.
"""
from __future__ import annotations

from elx.runners.errors import ElxError

BENCH_PRECISIONS = ("fp32", "fp16", "int8")  # what may follow '@' in a bench pass set (elx.exporter.bench.bench.split_precision)


def check_export(model: str, random_init: bool, passes: str | None, output, force: bool) -> None:
    """``elx export``: the passes (names, arguments, combinations), the model (a folder, a preset, a cached hub id;
    a supported architecture) and whether the passes apply to it, and the output folder."""
    from elx.exporter.atomic import check_output
    from elx.exporter.families import family_for_architecture
    from elx.exporter.model_source import locate_model
    from elx.exporter.passes import check_model_kind, parse_passes

    requests = parse_passes(passes)
    where = locate_model(model, random_init)
    family = family_for_architecture(where.architecture())
    check_model_kind(requests, family.name, family.is_encoder_decoder, stated_head_counts(where.config()))
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
    resolve_settings(manifest, **options)
    return manifest


def check_bench_model(model: str | None, random_init: bool, pass_sets: list[str]) -> None:
    """``elx bench``: every pass set parses, and the model (when named) is found."""
    from elx.exporter.model_source import locate_model
    from elx.exporter.passes import parse_passes

    for pass_set in pass_sets:
        passes, _, precision = pass_set.partition("@")  # elx.exporter.bench.bench.split_precision's form, without its imports
        if precision and precision not in BENCH_PRECISIONS:
            raise ElxError(f"--pass-sets: unknown precision {precision!r} in {pass_set!r}; after '@' name one of "
                           f"{', '.join(BENCH_PRECISIONS)}")
        parse_passes("" if passes in ("baseline", "base", "none") else passes)
    if model is not None:
        locate_model(model, random_init)


def check_export_folder(folder) -> None:
    """``elx build-engine``: the folder is an elx export."""
    from elx.runners.manifest import Manifest

    Manifest.load(folder)
