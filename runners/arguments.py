"""The public Python API's arguments, checked before any work: one ``ElxError`` naming the argument.

``elx.export``, ``elx.Generator.from_folder``, ``Generator.generate``, ``elx.generate_file`` and
``elx.build_engine`` call ``check_arguments(<function>, locals())`` first thing, so a wrong type or shape
(``input_ids="5 6 7"``, ``threads="2"``, ``passes=3``, float token ids, an attention mask of 7s) is refused
in one line instead of surfacing as a ``TypeError`` deep inside, or worse, running on silently converted
values.  Each function's table (``SPECS``) says what each argument must be; choices that other modules
own (backends, precisions, pass names) are left to those modules' own one-line checks, only their types
are checked here.

Generation options (HF ``generate``'s names) are checked for types here only where ``runners/search/settings.py``
does not check them (token ids and token lists, ``early_stopping``, Whisper's ``language``/``task``);
token ids must lie inside the model's vocabulary (``check_generation_options``).
"""
from __future__ import annotations

import os
import reprlib
import sys
from collections.abc import Mapping
from numbers import Integral, Real

import numpy as np

from elx.runners.errors import ElxError

_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong, _SHORT.maxlist, _SHORT.maxlevel = 30, 30, 30, 4, 2
_INT64 = np.iinfo(np.int64).max


def shown(value) -> str:
    """``a str ('5 6 7')``, ``None``, ``2.5 (a float)``: the value and its type, short."""
    if value is None:
        return "None"
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({_SHORT.repr(value)})"


def is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, (bool, np.bool_))


# -- checkers: (name, value) → None, or ElxError naming the argument ------------------------------------

def integer(minimum: int = 0, maximum: int | None = None, optional: bool = False):
    def check(name, value):
        if value is None and optional:
            return
        if not is_int(value):
            raise ElxError(f"{name} must be an integer{' or None' if optional else ''}, got {shown(value)}")
        if value < minimum or maximum is not None and value > maximum:
            bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise ElxError(f"{name} must be {bound}, got {value}")
    return check


def boolean(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ElxError(f"{name} must be True or False, got {shown(value)}")


def string(optional: bool = False):
    def check(name, value):
        if value is None and optional:
            return
        if not isinstance(value, str):
            raise ElxError(f"{name} must be a string{' or None' if optional else ''}, got {shown(value)}")
    return check


def path(what: str = "a path (a str or pathlib.Path)"):
    def check(name, value):
        if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
            raise ElxError(f"{name} must be {what}, got {shown(value)}")
        if not os.fspath(value):
            raise ElxError(f"{name} is an empty path; name a file or folder")
    return check


def strings(name, value):
    """A string, or a list of strings (``compute_capabilities``)."""
    if value is None or isinstance(value, str):
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ElxError(f"{name} must be a string like '8.0,8.6' or a list of strings, got {shown(value)}")


def generator(name, value):
    # a Generator exists only once its module is loaded: looked up there, so that this module imports none of
    # the runner (elx.runners.generate imports this one)
    loaded = sys.modules.get("elx.runners.generate")
    if value is not None and (loaded is None or not isinstance(value, loaded.Generator)):
        raise ElxError(f"{name} must be an elx.Generator (from Generator.from_folder) or None, got {shown(value)}")


def settings_object(name, value):
    from elx.runners.search.settings import GenerationSettings

    if value is not None and not isinstance(value, GenerationSettings):
        raise ElxError(f"{name} must be a GenerationSettings (Generator.settings(...)) or None, got {shown(value)}")


def ray_target(name, value):
    if value is not None and not isinstance(value, (bool, str)):
        raise ElxError(f"{name} must be True, False, None or a cluster address (a str), got {shown(value)}")


_POSITIVE, _OPTIONAL_POSITIVE = integer(1), integer(1, optional=True)
SPECS = {
    "export": {"model": path("a model folder, a hub id or a preset name (a str or pathlib.Path)"), "output": path(), "passes": string(optional=True), "random_init": boolean,
               "seed": integer(0, 2 ** 63 - 1), "force": boolean, "quiet": boolean, "precision": string(),
               "prompt_cache": string(optional=True), "fp32_draws": string()},
    "from_folder": {"folder": path(), "backend": string(), "device": string(), "threads": _OPTIONAL_POSITIVE,
                    "device_id": integer(0)},
    "generate": {"settings": settings_object, "track_memory": boolean, "decode": boolean,
                 "src_lang": string(optional=True), "tgt_lang": string(optional=True)},
    "generate_file": {"folder": path(), "input_file": path(), "output_file": path(), "batch_size": _POSITIVE,
                      "max_tokens_per_batch": _OPTIONAL_POSITIVE, "sort": boolean, "window": _OPTIONAL_POSITIVE,
                      "pipeline": boolean, "resume": boolean, "force": boolean, "skip_bad": boolean,
                      "progress": string(), "threads": _OPTIONAL_POSITIVE, "backend": string(), "device": string(),
                      "generator": generator, "ray": ray_target, "ray_actors": _OPTIONAL_POSITIVE,
                      "ray_ship": boolean},
    "build_engine": {"folder": path(), "precision": string(), "max_batch_size": _POSITIVE, "max_beams": _POSITIVE,
                     "max_input_length": _POSITIVE, "max_new_tokens": _POSITIVE, "runtime": string(),
                     "compute_capabilities": strings, "ngram": string(), "quiet": boolean},
}


# arguments the command line also passes, under another name: messages name both
_FLAGS = {"generate": {"src_lang": "--src-lang", "tgt_lang": "--tgt-lang"},
          "generate_file": {"batch_size": "--batch-size", "max_tokens_per_batch": "--max-tokens-per-batch",
                            "window": "--sort-window", "ray_actors": "--ray-actors"},
          "build_engine": {"max_batch_size": "--max-batch-size", "max_beams": "--max-beams",
                           "max_input_length": "--max-input-length", "max_new_tokens": "--max-new-tokens"}}


def check_arguments(function: str, values: dict) -> None:
    """Each argument of ``function`` (``values``: its ``locals()`` on entry) against ``SPECS[function]``."""
    flags = _FLAGS.get(function, {})
    for name, check in SPECS[function].items():
        check(f"{name} ({flags[name]})" if name in flags else name, values[name])


def check_generate_call(manifest, values: dict) -> None:
    """``Generator.generate``'s arguments (``values``: its ``locals()`` on entry): the encoder inputs in whichever
    form, the generation options (token ids inside ``manifest``'s vocabulary), the flags."""
    check_arguments("generate", values)
    check_encoder_arguments(manifest.encoder_inputs(), **{name: values[name] for name in (
        "inputs", "input_ids", "attention_mask", "text", "audio", "input_features")})
    check_generation_options(values["options"], manifest.dims["vocab_size"])


def check_generate_file_call(values: dict) -> None:
    """``generate_file``'s arguments (``values``: its ``locals()`` on entry); token ids given as generation options
    are held against the export's vocabulary (its manifest is read once more for that)."""
    check_arguments("generate_file", values)
    options = values["options"]
    check_generation_options(options)
    if any(options.get(name) is not None for name in (*_TOKEN_OPTIONS, *_TOKEN_OR_LIST_OPTIONS,
                                                      *_TOKEN_LIST_OPTIONS)):
        from elx.runners.manifest import Manifest

        check_generation_options(options, Manifest.load(values["folder"]).dims["vocab_size"])


# -- generation options that runners/search/settings.py does not type-check ---------------------------------------

_TOKEN_OPTIONS = ("pad_token_id", "decoder_start_token_id", "forced_bos_token_id")
_TOKEN_OR_LIST_OPTIONS = ("eos_token_id", "forced_eos_token_id")
_TOKEN_LIST_OPTIONS = ("suppress_tokens", "begin_suppress_tokens", "decoder_prompt")


def _token(name: str, value, vocab: int | None, where: str = "") -> None:
    if not is_int(value):
        raise ElxError(f"{name}{where} must be a token id (an int), got {shown(value)}")
    if value < 0 or vocab is not None and value >= vocab:
        limit = f"0 to {vocab - 1}" if vocab is not None else ">= 0"
        raise ElxError(f"{name}{where} is {_SHORT.repr(value)}, outside this model's token ids ({limit})")


def _token_list(name: str, value, vocab: int | None, single: bool) -> None:
    if single and not isinstance(value, (list, tuple, np.ndarray)):
        _token(name, value, vocab)
        return
    if not isinstance(value, (list, tuple, np.ndarray)) or isinstance(value, np.ndarray) and value.ndim != 1:
        what = "a token id or a list of token ids" if single else "a list of token ids"
        raise ElxError(f"{name} must be {what}, got {shown(value)}")
    for i, token in enumerate(value):
        _token(name, token, vocab, f"[{i}]")


def check_generation_options(options: dict, vocab: int | None = None) -> None:
    """Types (and, given ``vocab``, ranges) of the options HF ``generate`` takes as token ids, of
    ``early_stopping`` and of Whisper's ``language``/``task``/``return_timestamps``; None means "the default"."""
    for name, value in options.items():
        if value is None:
            continue
        if name in _TOKEN_OPTIONS:
            _token(name, value, vocab)
        elif name in _TOKEN_OR_LIST_OPTIONS or name in _TOKEN_LIST_OPTIONS:
            _token_list(name, value, vocab, single=name in _TOKEN_OR_LIST_OPTIONS)
        elif name == "early_stopping" and not (isinstance(value, bool) or value == "never"):
            raise ElxError(f"early_stopping must be True, False or 'never', got {shown(value)}")
        elif name in ("language", "task") and not isinstance(value, str):
            raise ElxError(f"{name} must be a string, got {shown(value)}")
        elif name == "return_timestamps":
            boolean(name, value)
        elif name == "length_penalty" and (isinstance(value, bool) or not isinstance(value, Real)):
            raise ElxError(f"length_penalty must be a number, got {shown(value)}")


# -- encoder inputs -------------------------------------------------------------------------------------

def token_array(name: str, value, kinds: str = "iu", what: str = "token ids") -> np.ndarray | None:
    """``value`` as a 2-D array of dtype kind ``kinds`` when it is an array (numpy, torch, ...); None for Python
    rows; else an error."""
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__") and not hasattr(value, "__array__"):
        raise ElxError(f"{name} must be rows of {what} (a list of lists of ints, or a 2-D integer array), got "
                       f"{shown(value)}")
    if isinstance(value, (list, tuple)):
        return None
    array = np.asarray(value)
    if array.dtype == object:
        raise ElxError(f"{name} is an array of Python objects (rows of different lengths?); pass a list of lists of "
                       "ints, or a 2-D integer array")
    if array.ndim != 2:
        raise ElxError(f"{name} must be 2-D [rows, tokens], got an array of shape {list(array.shape)}")
    if array.dtype.kind not in kinds:
        advice = (f"; {what} are integers (convert whole numbers with .astype(int))" if array.dtype.kind == "f"
                  else "")
        raise ElxError(f"{name} must hold integers, got an array of {array.dtype}{advice}")
    if array.dtype.kind == "u" and array.size and array.max() > _INT64:
        raise ElxError(f"{name} holds {int(array.max())}, far outside any vocabulary; fix the ids")
    return array


def token_rows(name: str, value, what: str = "token ids") -> list:
    """The rows of ``value`` (a list of rows of ints), each checked; a one-line error for the first bad one."""
    rows = value.tolist() if isinstance(value, np.ndarray) else value
    if not len(rows):
        raise ElxError(f"{name} has no rows; pass at least one row of {what}")
    for i, row in enumerate(rows):
        if isinstance(row, np.ndarray) and row.ndim == 1:
            row = row.tolist()
        if not isinstance(row, (list, tuple)):
            raise ElxError(f"{name} row {i} is {shown(row)}, not a list of {what} (pass a list of rows)")
        for j, token in enumerate(row):
            if not is_int(token):
                advice = f" ({what} are integers)" if isinstance(token, Real) else ""
                raise ElxError(f"{name} row {i} holds {shown(token)} at position {j}{advice}; pass ints")
    return rows


def _mask(value, ids_shape: tuple | None) -> None:
    array = token_array("attention_mask", value, kinds="iub", what="mask values")
    if array is None:
        rows = token_rows("attention_mask", value, what="mask values")
        if len({len(r) for r in rows}) > 1:
            raise ElxError("attention_mask rows have different lengths; give one mask value per token")
        array = np.asarray(rows, dtype=np.int64)
    if ids_shape is not None and tuple(array.shape) != ids_shape:
        raise ElxError(f"attention_mask has shape {list(array.shape)}, input_ids {list(ids_shape)}; give one mask "
                       "value per token")
    bad = np.argwhere((array != 0) & (array != 1))
    if bad.size:
        row, col = (int(i) for i in bad[0])
        raise ElxError(f"attention_mask holds {int(array[row, col])} (row {row}, position {col}); a mask is 1 for "
                       "a token and 0 for padding")
    empty = np.flatnonzero(array.sum(axis=1) == 0)
    if empty.size:
        raise ElxError(f"attention_mask row {int(empty[0])} masks every token; each input needs at least one")


def check_token_inputs(input_ids, attention_mask) -> None:
    """``input_ids`` (rows of ints, ragged only without a mask) and ``attention_mask`` (0/1, one per token)."""
    array = token_array("input_ids", input_ids)
    shape = tuple(array.shape) if array is not None else None
    if array is None:
        rows = token_rows("input_ids", input_ids)
        lengths = sorted({len(r) for r in rows})
        if attention_mask is not None and len(lengths) > 1:
            raise ElxError(f"input_ids rows have different lengths ({', '.join(map(str, lengths))}) and an "
                           "attention_mask is given: pad the rows to one length (the mask marks the padding), or "
                           "leave attention_mask out and elx pads them")
        shape = (len(rows), lengths[0]) if len(lengths) == 1 else None
    if attention_mask is not None:
        _mask(attention_mask, shape)


def check_features(name: str, value) -> None:
    if isinstance(value, (str, bytes, Mapping)):
        raise ElxError(f"{name} must be a numeric array [batch, ...], got {shown(value)}")
    try:
        array = np.asarray(value)
    except ValueError:  # ragged nested lists
        raise ElxError(f"{name} must be a numeric array [batch, ...] (rows of one length), got {shown(value)}")
    if array.dtype.kind not in "fiu":
        raise ElxError(f"{name} must hold numbers, got an array of {array.dtype}")


def check_text(value) -> None:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, (list, tuple)) or not texts:
        raise ElxError(f"text must be a string or a non-empty list of strings, got {shown(value)}")
    for i, item in enumerate(texts):
        if not isinstance(item, str):
            raise ElxError(f"text[{i}] is {shown(item)}, not a string")


def check_audio(value) -> None:
    files = [value] if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(files, (list, tuple)) or not files:
        raise ElxError(f"audio must be a WAV path or a non-empty list of them, got {shown(value)}")
    for i, item in enumerate(files):
        path("a WAV path (a str or pathlib.Path)")(f"audio[{i}]", item)


def check_inputs(inputs, roles) -> None:
    """``inputs=``: encoder inputs by role, each role one the model takes."""
    if not isinstance(inputs, Mapping):
        raise ElxError(f"inputs must be a dict of encoder inputs by role ({', '.join(roles)}), got {shown(inputs)}")
    for role in inputs:
        if role not in roles:
            raise ElxError(f"inputs has {role!r}, which this model does not take (it takes {', '.join(roles)})")
    if inputs.get("input_ids") is not None:
        check_token_inputs(inputs["input_ids"], inputs.get("attention_mask"))
    for role, value in inputs.items():
        if role not in ("input_ids", "attention_mask") and value is not None:
            check_features(f"inputs[{role!r}]", value)


def check_encoder_arguments(roles, *, inputs=None, input_ids=None, attention_mask=None, text=None, audio=None,
                            input_features=None) -> None:
    """``Generator.generate``'s input forms (``roles``: the encoder inputs the model takes)."""
    if attention_mask is not None and input_ids is None and input_features is None:
        raise ElxError("attention_mask goes with input_ids (or, for Whisper's long-form audio, input_features); pass "
                       "them too (or inputs={...} with both)")
    if attention_mask is not None and input_features is not None:
        check_frame_mask(attention_mask, input_features)
    if inputs is not None:
        check_inputs(inputs, roles)
    if input_ids is not None:
        check_token_inputs(input_ids, attention_mask)
    if text is not None:
        check_text(text)
    if audio is not None:
        check_audio(audio)
    if input_features is not None:
        check_features("input_features", input_features)


def check_frame_mask(mask, features) -> None:
    """Whisper's long-form ``attention_mask``: [batch, frames] of 0/1 beside ``input_features`` [batch, mel, frames]."""
    array, shape = np.asarray(mask), np.shape(features)
    if array.ndim != 2 or len(shape) != 3 or array.shape != (shape[0], shape[2]):
        raise ElxError(f"attention_mask must be [batch, frames] = {[shape[0], shape[-1]]} beside input_features, got "
                       f"shape {list(array.shape)}")
    if array.dtype.kind not in "biu" or not np.isin(array, (0, 1)).all():
        raise ElxError("attention_mask must hold 0 and 1 (1 on each clip's frames)")
