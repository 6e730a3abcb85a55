"""What a valid ``manifest.json`` is: a JSON Schema for every field the runners read, and the cross-references
a schema cannot state (a graph input fed from another graph's output, a token id inside the vocabulary).

``check(data, where)`` runs both, once, when ``elx.runners.manifest.Manifest.load`` reads a folder, and raises one
``ElxError`` line naming the first bad field by its JSON path (``graphs.decoder.outputs``,
``cache.self[0].seq_axis``), its value, what it should be, and what to do.  A damaged or hand-edited folder
thus fails at load, never as a ``KeyError`` or an ONNX Runtime error deep in a run.

Written with ``jsonschema`` (Draft 2020-12): the manifest is a JSON document written by one program and
read by another, and a JSON Schema states that contract as data, checks the dict the runners read as it
is (no second, converted copy that could drift from it), and reports JSON paths.  Integers are strict
(``1.0`` and ``true`` are not integers).  Fields the schema does not name are allowed (newer sections,
notes); a field it names is checked wherever it appears.

``check_graph_io`` holds a loaded graph file's inputs and outputs against the manifest's description of
that graph (swapped or replaced ``.onnx`` files).
"""
from __future__ import annotations

import json
import reprlib
from functools import lru_cache

from elx.runners.errors import ElxError

FORMAT = "elx-manifest"
VERSION = 1
DTYPES = ("float32", "float16", "int64", "int32", "bool")
STEP_SOURCES = ("input_ids", "history", "attention_mask", "position_ids")  # runners/plan.py
_ONNX_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64",
                "tensor(int32)": "int32", "tensor(bool)": "bool"}
_FIX = "re-run 'elx export' for this folder"

# -- the schema ----------------------------------------------------------------------------------------
# "description" is what a field must be; messages read "<path> is <value>, not <description>", and
# "{1}" in a description is the path's second element (a graph's name).


def _int(minimum: int = 0, what: str = "a non-negative integer", null: bool = False) -> dict:
    return {"type": ["integer", "null"] if null else "integer", "minimum": minimum,
            "description": what + (" or null" if null else "")}


_TOKEN = _int(0, "a token id (a non-negative integer)", null=True)
_TOKENS = {"type": ["array", "null"], "items": _int(0, "a token id (a non-negative integer)"),
           "description": "a list of token ids"}
_FILE = {"type": "string", "minLength": 1, "pattern": r"^(?!/)(?!.*(^|/)\.\.(/|$))",
         "description": "one inside the folder (a relative file name)"}
_SHAPE = {"type": "array", "description": "a shape (a list of sizes and axis names)",
          "items": {"type": ["integer", "string"], "minimum": 0, "minLength": 1,
                    "description": "a size (a non-negative integer) or an axis name"}}
_TENSOR = {"type": "object", "required": ["dtype", "shape"], "description": "a tensor ({dtype, shape})",
           "properties": {"dtype": {"enum": list(DTYPES), "description": f"one of {', '.join(DTYPES)}"},
                          "shape": _SHAPE}}
_SOURCE = {"type": "string", "pattern": r"^[^:]+:.+$",
           "description": "a source 'input:<role>', 'step:<what>', 'cache:<output>' or '<graph>:<output>'"}
_GRAPH = {
    "type": "object", "required": ["file", "inputs", "outputs"],
    "description": "graph {1}'s description ({file, inputs, outputs})",
    "properties": {
        "file": _FILE, "tensorrt_file": _FILE,
        "external_data": {"type": "array", "items": _FILE, "description": "a list of file names"},
        "inputs": {"type": "object", "description": "graph '{1}''s inputs by name",
                   "additionalProperties": {**_TENSOR, "required": ["dtype", "shape", "from"],
                                            "description": "an input of graph '{1}' ({dtype, shape, from})",
                                            "properties": {**_TENSOR["properties"], "from": _SOURCE}}},
        "outputs": {"type": "object", "minProperties": 1, "description": "graph '{1}''s outputs by name",
                    "additionalProperties": {**_TENSOR, "description": "an output of graph '{1}' ({dtype, shape})"}},
        "logits": {"type": "string", "description": "the name of an output"},
        "blocked": {"type": "object", "required": ["output", "ngram_size"],
                    "description": "the n-gram pass's record ({output, ngram_size})",
                    "properties": {"output": {"type": "string", "description": "the name of an output"},
                                   "ngram_size": _int(1, "a positive integer")}},
    },
}
_CACHE_ENTRY = {
    "type": "object", "required": ["input", "output", "dtype", "shape", "seq_axis"],
    "description": "a cache entry ({input, output, dtype, shape, seq_axis})",
    "properties": {"input": {"type": "string", "description": "a step input's name"},
                   "output": {"type": "string", "description": "a step output's name"},
                   "dtype": _TENSOR["properties"]["dtype"], "shape": _SHAPE, "seq_axis": _int(),
                   "init": {"type": "string", "description": "a stage output '<graph>:<output>'"},
                   "in_place": {"type": "boolean", "description": "true or false"}},
}
_GENERATION = {  # generation_config values the runners read (runners/options.py places every field), as HF types them
    "type": "object", "description": "an object of generation options",
    "properties": {
        **{name: _int(1, "a positive integer", null=True) for name in ("max_length", "max_new_tokens", "num_beams",
                                                                         "num_return_sequences")},
        **{name: _int(0, "a non-negative integer", null=True) for name in (
            "min_length", "min_new_tokens", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size")},
        **{name: {"type": ["number", "null"], "description": "a number"} for name in ("length_penalty",
                                                                                    "repetition_penalty")},
        "early_stopping": {"enum": [True, False, "never", None], "description": "true, false or 'never'"},
        **{name: {"type": ["boolean", "null"], "description": "true or false"} for name in (
            "do_sample", "is_multilingual", "return_timestamps")},
        "forced_bos_token_id": _TOKEN, "no_timestamps_token_id": _TOKEN,
        "forced_eos_token_id": {**_TOKENS, "type": ["integer", "array", "null"], "minimum": 0,
                                "description": "a token id or a list of token ids"},
        "suppress_tokens": _TOKENS, "begin_suppress_tokens": _TOKENS,
        "bad_words_ids": {"type": ["array", "null"], "items": _TOKENS, "description": "a list of token id lists"},
        "forced_decoder_ids": {"type": ["array", "null"], "description": "a list of [position, token id] pairs",
                               "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                         "items": _TOKEN, "description": "a [position, token id] pair"}},
        **{name: {"type": "object", "additionalProperties": _int(0, "a token id (a non-negative integer)"),
                  "description": "an object of token ids by name"} for name in ("lang_to_id", "task_to_id")},
        "language_codes": {"type": "object", "additionalProperties": {"type": "string", "description": "a code"},
                           "description": "an object of language codes by name"},
    },
}
_SHARE = {"type": "number", "minimum": 0, "maximum": 1, "description": "a share (a number from 0 to 1)"}
_DIFF = {"type": "number", "minimum": 0, "description": "a non-negative number"}
_INT8_SEARCH = {  # exporter/precision/int8_check.py: one search's recorded agreement with HF fp32
    "type": "object", "description": "a search's recorded agreement with HF fp32",
    "required": ["num_beams", "rows", "rows_identical", "identical_share", "top1_pairs", "top1_agree",
                 "top1_agreement", "max_abs_logits_diff"],
    "properties": {"num_beams": _int(1, "a positive integer"), "rows": _int(), "rows_identical": _int(),
                   "identical_share": _SHARE, "top1_pairs": _int(), "top1_agree": _int(), "top1_agreement": _SHARE,
                   "top1_agreement_per_step": {"type": "array", "items": _SHARE, "description": "a list of shares"},
                   "max_abs_logits_diff": _DIFF}}
_INT8_VERIFICATION = {
    "type": "object", "required": ["draw", "random_inputs", "searches"],
    "description": "the int8 export's recorded agreement ({draw, random_inputs, searches})",
    "properties": {
        "draw": {"type": "object", "required": ["seed", "batch_size", "input_length", "max_new_tokens"],
                 "description": "the seeded draw ({seed, batch_size, input_length, max_new_tokens})",
                 "properties": {"seed": _int(), **{k: _int(1, "a positive integer") for k in (
                     "batch_size", "input_length", "max_new_tokens")}}},
        "random_inputs": {"type": "object", "required": ["max_abs_logits_diff", "max_abs_reference"],
                          "description": "the teacher-forced difference on random inputs",
                          "properties": {"max_abs_logits_diff": _DIFF, "max_abs_reference": _DIFF}},
        "searches": {"type": "object", "required": ["greedy", "beam4"], "description": "the greedy and beam4 records",
                     "additionalProperties": _INT8_SEARCH}}}
_INT8 = {"type": "object", "required": ["graphs", "reduce_range", "lm_head"],
         "description": "the int8 rule's record (exporter/precision/int8.py)",
         "properties": {"graphs": {"type": "object", "description": "MatMul counts per decision, by graph"},
                        "reduce_range": {"type": "boolean", "description": "true or false"},
                        "kernel": {"enum": ["dynamic", "nbits"], "description": "'dynamic' or 'nbits' (absent: dynamic)"},
                        "lm_head": {"enum": ["int8", "fp32"], "description": "'int8' or 'fp32'"}}}
_NAME = {"type": "string", "minLength": 1, "description": "a non-empty string"}
_GGUF = {  # exporter/gguf/metadata.py: the GGUF file an export was made from
    "type": "object", "required": ["file", "sha256", "architecture", "quantization"],
    "description": "the GGUF file's record ({file, sha256, architecture, quantization, file_type, tensor_types})",
    "properties": {"file": _NAME, "architecture": _NAME, "quantization": _NAME,
                   "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$", "description": "a SHA-256 (64 hex digits)"},
                   "file_type": {"type": ["string", "null"], "description": "a string or null"},
                   "tensor_types": {"type": "object", "additionalProperties": _int(1, "a positive integer"),
                                    "description": "tensor counts by type"}}}
_TEMPLATE_IDS = {"type": "array", "description": "a list of token ids and 'language'",
                 "items": {"type": ["integer", "string"], "minimum": 0, "pattern": "^language$",
                           "description": "a token id or 'language'"}}
_TOKENIZER = {  # exporter/tokenizer/export.py: how the runtime tokenizes, and its check against HF
    "type": "object", "description": "the tokenizer's record ({class, runtime, check} or {class, note})",
    "properties": {"class": {"type": "string", "description": "a tokenizer class name"},
                   "runtime": {"enum": ["tokenizer.json", "pieces"], "description": "'tokenizer.json' or 'pieces'"},
                   "check": {"type": "object", "description": "an object of counts",
                             "additionalProperties": _int()},
                   "note": {"type": "string", "description": "a string"}}}
_LANGUAGES = {  # exporter/tokenizer/languages.py: language code -> token id, and how HF uses it
    "type": "object", "required": ["codes", "target"], "description": "the language table ({codes, target, ...})",
    "properties": {
        "tokenizer": {"type": "string", "description": "a tokenizer class name"},
        "codes": {"type": "object", "minProperties": 1, "description": "an object of token ids by language code",
                  "additionalProperties": _int(0, "a token id (a non-negative integer)")},
        "target": {"enum": ["forced_bos_token_id", "decoder_start_token_id", "text_prefix"],
                   "description": "'forced_bos_token_id', 'decoder_start_token_id' or 'text_prefix'"},
        "source": {"type": "object", "required": ["prefix", "suffix"], "description": "a template ({prefix, suffix})",
                   "properties": {"prefix": _TEMPLATE_IDS, "suffix": _TEMPLATE_IDS}},
        "default_source": {"type": "string", "description": "a language code"},
        "source_checked": _int(),
        "source_note": {"type": "string", "description": "a string"}}}
SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["format", "version", "family", "is_encoder_decoder", "dims", "tokens", "graphs", "stages", "step",
                 "cache", "passes"],
    "properties": {
        "format": {"const": FORMAT, "description": f"'{FORMAT}'"},
        "version": {"type": "integer", "description": f"the integer {VERSION}"},
        "family": {"type": "string", "description": "a model family's name"},
        "is_encoder_decoder": {"type": "boolean", "description": "true or false"},
        "source": {"type": "object", "description": "the source model's record",
                   "properties": {"kind": {"type": "string", "description": "a string"},
                                  "model": {"type": ["string", "null"], "description": "a string"},
                                  "path": {"type": ["string", "null"], "description": "a path"},
                                  "random_init": {"type": "boolean", "description": "true or false"},
                                  "seed": _int(null=True), "gguf": _GGUF}},
        "dims": {"type": "object", "required": ["vocab_size"], "description": "an object of model sizes",
                 "properties": {"vocab_size": _int(1, "a positive integer"),
                                "max_position_embeddings": _int(1, "a positive integer", null=True),
                                "max_target_positions": _int(1, "a positive integer", null=True),
                                **{name: _int(1, "a positive integer") for name in ("d_model", "num_heads", "d_kv",
                                                                                    "num_decoder_layers")},
                                "num_encoder_layers": _int()}},
        "tokens": {"type": "object", "description": "an object of special token ids",
                   "properties": {"decoder_start_token_id": _TOKEN, "pad_token_id": _TOKEN, "bos_token_id": _TOKEN,
                                  "eos_token_id": _TOKENS}},
        "generation_defaults": _GENERATION,
        "graphs": {"type": "object", "minProperties": 1, "description": "an object of graphs by name",
                   "additionalProperties": _GRAPH},
        "stages": {"type": "array", "items": {"type": "string", "description": "a graph's name"},
                   "uniqueItems": True, "description": "a list of graph names"},
        "step": {"type": "string", "description": "a graph's name"},
        "cache": {"type": "object", "required": ["self"], "description": "the cache layout ({self, ...})",
                  "properties": {"self": {"type": "array", "items": _CACHE_ENTRY,
                                          "description": "a list of cache entries"},
                                 "cross": {"type": "object", "description": "an object"},
                                 "prompt": {"type": "object", "description": "an object"}}},
        "passes": {"type": "array", "description": "a list of pass records",
                   "items": {"type": "object", "required": ["name"], "description": "a pass record ({name, ...})",
                             "properties": {"name": {"type": "string", "description": "a pass name"}}}},
        "first_step_scores": {"type": "string", "description": "a stage output '<graph>:<output>'"},
        "has_tokenizer": {"type": "boolean", "description": "true or false"},
        "tokenizer": _TOKENIZER,
        "languages": _LANGUAGES,
        "padding_side": {"enum": ["left", "right"], "description": "'left' or 'right'"},
        "chat_template": {  # exporter/tokenizer/chat_template.py; runners/inputs/chat.py renders it
            "type": "object", "required": ["file", "special_tokens"],
            "description": "the chat template's record ({file, special_tokens, split_special_tokens})",
            "properties": {"file": _FILE, "split_special_tokens": {"type": "boolean", "description": "true or false"},
                           "special_tokens": {"type": "object", "description": "an object of token strings by name",
                                              "additionalProperties": {"type": "string", "description": "a string"}}}},
        "precision": {"enum": ["fp32", "fp16", "int8"], "description": "'fp32', 'fp16' or 'int8'"},
        "int8": _INT8,
        "verification": {"type": "object", "description": "the export's verification records",
                         "properties": {"int8": _INT8_VERIFICATION,
                                        "tolerance": {"type": "object", "description": "the fp32 tolerance record",
                                                      "properties": {"atol": {"type": "number", "minimum": 0,
                                                                              "description": "a number >= 0"}}}}},
        "engines": {"type": "object", "required": ["format", "build_id", "folder", "graphs"],
                    "description": "the TensorRT engines record (runners/backends/tensorrt_engines.py)",
                    "properties": {"format": _int(1, "a positive integer"),
                                   "build_id": {"type": "string", "description": "a string"}, "folder": _FILE,
                                   "graphs": {"type": "object", "description": "an object of engines by graph",
                                              "additionalProperties": {
                                                  "type": "object", "required": ["file", "source", "source_bytes"],
                                                  "description": "an engine record ({file, source, source_bytes})",
                                                  "properties": {"file": _FILE, "source": _FILE,
                                                                 "source_bytes": _int()}}}}},
    },
    # an int8 export is judged against its recorded agreement (elx compare): both records must be there
    "if": {"properties": {"precision": {"const": "int8"}}, "required": ["precision"]},
    "then": {"required": ["int8", "verification"],
             "properties": {"verification": {"required": ["int8"]}}},
}


@lru_cache(maxsize=None)
def _validator():
    from jsonschema import Draft202012Validator, validators

    def strict_integer(_, value) -> bool:  # JSON Schema counts 1.0 as an integer; a manifest never holds one
        return isinstance(value, int) and not isinstance(value, bool)

    checker = Draft202012Validator.TYPE_CHECKER.redefine("integer", strict_integer)
    return validators.extend(Draft202012Validator, type_checker=checker)(SCHEMA)


# -- messages ------------------------------------------------------------------------------------------

_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong, _SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 40, 40, 40, 2, 4, 3
_TYPE_NAMES = {dict: "an object", list: "a list", str: "a str", bool: "a bool", int: "an int", float: "a float",
               type(None): "null"}


def json_path(path) -> str:
    """``("cache", "self", 0, "seq_axis")`` → ``cache.self[0].seq_axis``; odd keys in brackets."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out or "the manifest"


def _value(value) -> str:
    """``-1``, ``null``, ``a str ('1')``, ``a list (['rows', 'four'])``: integers as they are, others with their type."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return "null" if value is None else _SHORT.repr(value)
    return f"{_TYPE_NAMES.get(type(value), type(value).__name__)} ({_SHORT.repr(value)})"


def damaged(where, path, value, expected: str) -> ElxError:
    """``<where> is corrupted: <path> is <value>, not <expected>; re-run 'elx export' for this folder``."""
    return ElxError(f"{where} is corrupted: {json_path(path)} is {_value(value)}, not {expected}; {_FIX}")


def _described(schema: dict, path) -> str:
    text = schema.get("description", "what elx writes") if isinstance(schema, dict) else "what elx writes"
    parts = [str(p) for p in path]
    return text.replace("{1}", parts[1] if len(parts) > 1 else "?")


def _schema_error(error, where) -> ElxError:
    path = list(error.absolute_path)
    if error.validator == "required":
        missing = next(name for name in error.validator_value if name not in error.instance)
        return ElxError(f"{where} is corrupted: {json_path([*path, missing])} is missing; {_FIX}")
    return damaged(where, path, error.instance, _described(error.schema, path))


# -- the checks ----------------------------------------------------------------------------------------

def check(data, where) -> None:
    """``data`` (a parsed manifest) is one this elx can run; else one ``ElxError`` line naming the field."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ElxError(f"{where} is not an elx manifest; re-run 'elx export'")
    version = data.get("version", VERSION)
    if isinstance(version, int) and not isinstance(version, bool) and version != VERSION:
        raise ElxError(f"{where} has manifest version {version}; this elx reads version {VERSION}: re-export the "
                       "model with this elx (or run the elx that wrote it)")
    # the shallowest error first: a section of the wrong type, not every field it then lacks
    error = min(_validator().iter_errors(data), key=lambda e: len(e.absolute_path), default=None)
    if error is not None:
        raise _schema_error(error, where)
    problem = first_broken_reference(data)
    if problem is not None:
        raise damaged(where, *problem)


def first_broken_reference(data: dict):
    """What the schema cannot say: names that must point at something. ``(path, value, expected)`` or None."""
    graphs, stages, step = data["graphs"], data["stages"], data["step"]
    for i, name in enumerate(stages):
        if name not in graphs:
            return ("stages", i), name, "a graph named in graphs"
    if step not in graphs:
        return ("step",), step, "a graph named in graphs"
    stage_outputs = {f"{s}:{o}" for s in stages for o in graphs[s]["outputs"]}
    entries = data["cache"]["self"]
    step_graph = graphs[step]
    cached = {(e["input"], e["output"]) for e in entries}
    for i, entry in enumerate(entries):
        problem = _cache_problem(entry, step_graph, stage_outputs, step)
        if problem:
            return ("cache", "self", i, problem[0]), entry.get(problem[0]), problem[1]
    for name, graph in graphs.items():
        for input_name, spec in graph["inputs"].items():
            problem = _source_problem(spec["from"], input_name, name, graphs, stages, stage_outputs, cached)
            if problem:
                return ("graphs", name, "inputs", input_name, "from"), spec["from"], problem
    fed = [n for n, s in step_graph["inputs"].items() if s["from"] == "step:input_ids"]
    if len(fed) != 1:
        return ("graphs", step, "inputs"), sorted(step_graph["inputs"]), "the inputs of a step graph with one " \
                                                                          "input from 'step:input_ids'"
    for key in ("logits",):
        if step_graph.get(key, "logits") not in step_graph["outputs"]:
            return ("graphs", step, key), step_graph.get(key, "logits"), f"an output of graph '{step}'"
    blocked = step_graph.get("blocked")
    if blocked and blocked["output"] not in step_graph["outputs"]:
        return ("graphs", step, "blocked", "output"), blocked["output"], f"an output of graph '{step}'"
    first = data.get("first_step_scores")
    if first is not None and first not in stage_outputs:
        return ("first_step_scores",), first, "a stage output '<graph>:<output>'"
    return _token_problem(data)


def _source_problem(source: str, input_name: str, graph: str, graphs: dict, stages: list, stage_outputs: set,
                    cached: set) -> str | None:
    kind, _, name = source.partition(":")
    if kind == "input":
        return None
    if kind == "step":
        return None if name in STEP_SOURCES else f"one of {', '.join('step:' + s for s in STEP_SOURCES)}"
    if kind == "prompt":
        return None if name == "position_ids" else "'prompt:position_ids'"
    if kind == "cache":
        return None if (input_name, name) in cached else f"a cache.self entry's output for input {input_name!r}"
    if kind not in graphs:
        return "a source 'input:<role>', 'step:<what>', 'cache:<output>' or '<graph>:<output>' of a known graph"
    if source not in stage_outputs:
        return f"an output of stage '{kind}'"
    return None


def _cache_problem(entry: dict, step_graph: dict, stage_outputs: set, step: str):
    if entry["input"] not in step_graph["inputs"]:
        return "input", f"an input of graph '{step}'"
    if entry["output"] not in step_graph["outputs"]:
        return "output", f"an output of graph '{step}'"
    shape, axis = entry["shape"], entry["seq_axis"]
    if axis >= len(shape):
        return "seq_axis", f"an axis of its shape {shape}"
    if any(not (isinstance(d, int) or d == "rows") for i, d in enumerate(shape) if i != axis):
        return "shape", "a shape of 'rows', sizes and an axis name at seq_axis"
    if "init" in entry and entry["init"] not in stage_outputs:
        return "init", "a stage output '<graph>:<output>'"
    return None


def _token_problem(data: dict):
    """Special token ids (and those of the generation defaults) inside the vocabulary."""
    vocab = data["dims"]["vocab_size"]
    found = [(("tokens", key), value) for key, value in data["tokens"].items() if key.endswith("_token_id")]
    defaults = data.get("generation_defaults") or {}
    found += [(("generation_defaults", key), defaults.get(key)) for key in (
        "forced_bos_token_id", "forced_eos_token_id", "no_timestamps_token_id", "suppress_tokens",
        "begin_suppress_tokens")]
    languages = data.get("languages") or {}
    found += [(("languages", "codes", code), index) for code, index in (languages.get("codes") or {}).items()]
    for path, value in found:
        for i, token in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(token, int) and not isinstance(token, bool) and token >= vocab:
                at = (*path, i) if isinstance(value, list) else path
                return at, token, f"an id in the vocabulary (dims.vocab_size is {vocab})"
    return None


def check_graph_io(where, graph: str, described: dict, inputs: dict, outputs: dict) -> None:
    """A loaded graph file's ``inputs`` and ``outputs`` (name → ONNX type, ``tensor(float)``) are the ones the
    manifest describes for ``graph`` (``described``: the graph's entry); else one line naming what differs."""
    for side, found in (("inputs", inputs), ("outputs", outputs)):
        expected = {name: spec["dtype"] for name, spec in described[side].items()}
        actual = {name: _ONNX_DTYPES.get(kind, kind) for name, kind in found.items()}
        if side == "outputs":  # a graph may compute more than the manifest names; it must compute those named
            actual = {name: kind for name, kind in actual.items() if name in expected}
        if actual != expected:
            missing = sorted(set(expected) - set(actual))
            extra = sorted(set(actual) - set(expected))
            typed = sorted(n for n in set(expected) & set(actual) if expected[n] != actual[n])
            what = "; ".join(part for part in (
                f"the file lacks {_names(missing)}" if missing else "",
                f"the manifest lacks {_names(extra)}" if extra else "",
                f"{_names(typed)} of type {', '.join(actual[n] for n in typed[:3])} in the file" if typed else "")
                             if part)
            raise ElxError(f"{where}: the graph file of graphs.{graph} does not match the manifest's {side} ({what}): "
                           f"graph files swapped or replaced? {_FIX}")


def _names(names: list) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def loads(text: str, where):
    """``json.loads`` with one line for what is not JSON, and for JSON nested too deeply to read."""
    try:
        return json.loads(text)
    except ValueError as err:  # JSONDecodeError, or an integer of more digits than Python converts
        raise ElxError(f"{where} is corrupted ({type(err).__name__}); {_FIX}")
    except RecursionError:
        raise ElxError(f"{where} is corrupted (JSON nested too deeply to read); {_FIX}")
