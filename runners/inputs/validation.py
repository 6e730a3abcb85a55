"""Runtime checks of what a caller asks for, before any graph runs or any buffer is allocated.

Each check raises a one-line ``ElxError`` naming the bad value, the limit and what to do, where
ONNX Runtime would otherwise fail with a traceback (token ids outside the vocabulary, positions
past the model's table), silently compute garbage (negative ids wrap around, a NaN length
penalty) or allocate without bound (the search allocates its token buffers for the maximum
length up front).

``check_manifest`` is called by ``elx.runners.manifest.Manifest.validate``, ``check_settings`` by
``elx.runners.search.settings._validate``, ``check_encoder_inputs`` by ``typed_encoder_inputs`` (below),
``check_memory`` by ``elx.runners.generate.Generator.generate``, ``check_threads`` by the ONNX Runtime backends
(``elx.runners.backends.ort.load_sessions``) and ``elx.runners.dataset.pipeline.generate_file``.
"""
from __future__ import annotations

import math
import os
from numbers import Integral, Real
from pathlib import Path

import numpy as np

from elx.runners.errors import ElxError
from elx.runners.wording import arg, on_command_line

# Models without a position table (T5's relative positions) have no length limit of their own;
# the search allocates [rows, max length] token buffers up front, so the total length is capped here.
UNBOUNDED_MAX_LENGTH = 1 << 16
_TOKEN_ROLES = ("input_ids", "attention_mask")
# what the manifest's top-level entries must be (a hand-edited manifest fails here, not deep in a runner)
_MANIFEST_TYPES = {"family": str, "dims": dict, "tokens": dict, "graphs": dict, "stages": list, "step": str,
                   "cache": dict, "passes": list}


# -- manifests -----------------------------------------------------------------------------------------

def _corrupted(where, what: str) -> ElxError:
    return ElxError(f"{where} is corrupted ({what}); re-run 'elx export'")


def check_manifest(data: dict, where) -> None:
    """The shapes of a manifest's entries (types, the cache layout, each graph input's source)."""
    for key, kind in _MANIFEST_TYPES.items():
        if not isinstance(data[key], kind):
            raise _corrupted(where, f"{key} is a {type(data[key]).__name__}, not a {kind.__name__}")
    if not isinstance(data.get("generation_defaults", {}), dict):
        raise _corrupted(where, "generation_defaults is not an object")
    if not isinstance(data["cache"].get("self"), list) or not all(
            isinstance(e, dict) and {"input", "output"} <= e.keys() for e in data["cache"]["self"]):
        raise _corrupted(where, "cache.self is not a list of cache entries")
    if not all(isinstance(p, dict) and isinstance(p.get("name"), str) for p in data["passes"]):
        raise _corrupted(where, "passes is not a list of pass records")
    for name, graph in data["graphs"].items():
        inputs = graph.get("inputs") if isinstance(graph, dict) else None
        if not isinstance(inputs, dict) or not all(isinstance(s, dict) and isinstance(s.get("from"), str)
                                                   for s in inputs.values()):
            raise _corrupted(where, f"graph {name!r} has no valid inputs")
        if not _inside_folder(graph.get("file")):
            raise _corrupted(where, f"graph {name!r} names the file {graph.get('file')!r}, not one inside the folder")
        for input_name, spec in inputs.items():
            if not _known_source(spec["from"], data["graphs"]):
                raise _corrupted(where, f"input {input_name!r} of graph {name!r} comes from {spec['from']!r}")
    step = data["graphs"].get(data["step"])
    if isinstance(step, dict) and not any(s["from"] == "step:input_ids" for s in step["inputs"].values()):
        raise _corrupted(where, f"the step graph {data['step']!r} has no input from 'step:input_ids'")


def _inside_folder(file) -> bool:
    """A relative path that stays inside the export folder."""
    return isinstance(file, str) and bool(file) and not Path(file).is_absolute() and ".." not in Path(file).parts


def _known_source(source: str, graphs: dict) -> bool:
    """``input:<role>``, ``step:input_ids|history|attention_mask|position_ids``, ``prompt:position_ids``,
    ``cache:<output>`` or ``<graph>:<output>`` (``runners/plan.py``)."""
    kind, sep, name = source.partition(":")
    if not sep or not name:
        return False
    if kind == "step":
        return name in ("input_ids", "history", "attention_mask", "position_ids")
    if kind == "prompt":
        return name == "position_ids"
    return kind in ("input", "cache") or kind in graphs


# -- generation settings -------------------------------------------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int, optional: bool = False) -> None:
    """``value`` is an integer ``>= minimum`` (or None when ``optional``)."""
    if value is None and optional:
        return
    if not _is_int(value):
        raise ElxError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ElxError(f"{name} must be >= {minimum}, got {value}")


def check_length_penalty(value) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ElxError(f"length_penalty must be a finite number, got {value!r}")


def _length_option(s) -> str:
    """The option that set the total length, for messages."""
    if s.max_new_tokens is not None:
        return f"max_new_tokens {s.max_new_tokens}"
    if s.max_length is not None:
        return f"max_length {s.max_length}"
    return "the default length"


def check_total_length(s, prompt_len: int) -> None:
    """The longest sequence the search may build fits the decoder's positions (or elx's cap without a table).

    A decoder with a table of P positions reads positions 0..P-1: the last of L tokens is never fed
    back, so sequences reach at most P + 1 tokens (the decoder prompt included).
    """
    total = s.total_max_length(prompt_len)
    limit = s.max_positions
    if limit is not None and total > int(limit) + 1:
        raise ElxError(f"{_length_option(s)} makes sequences of {total} tokens (with the {prompt_len}-token decoder "
                       f"prompt), past this model's {limit} decoder positions (max_position_embeddings); at most "
                       f"{int(limit) + 1 - prompt_len} new tokens fit: lower it")
    if limit is None and total > UNBOUNDED_MAX_LENGTH:
        raise ElxError(f"{_length_option(s)} makes sequences of {total} tokens; elx caps generation at "
                       f"{UNBOUNDED_MAX_LENGTH} tokens for models without a position table (buffers are "
                       "allocated up front): lower it")


def check_settings(s, prompt_len: int | None) -> None:
    """Types and ranges of every option of a ``GenerationSettings``, then the total length.

    ``prompt_len``: the decoder prompt's length, or None when the inputs set it (decoder-only models: the
    prompt is the input; ``elx.runners.families.DecoderOnlyRules.check_lengths`` checks lengths once it is known)."""
    check_int("decoder_start_token_id", s.decoder_start_token_id, 0, optional=True)  # required by the family's rules
    check_int("num_beams", s.num_beams, 1)
    check_int("num_return_sequences", s.num_return_sequences, 1)
    check_int("input_repeats", s.input_repeats, 1)
    check_int("max_new_tokens", s.max_new_tokens, 1, optional=True)
    check_int("max_length", s.max_length, prompt_len or 1, optional=True)
    check_int("min_new_tokens", s.min_new_tokens, 0, optional=True)
    check_int("min_length", s.min_length, 0)
    check_int("no_repeat_ngram_size", s.no_repeat_ngram_size, 0)
    check_length_penalty(s.length_penalty)
    if s.num_return_sequences > s.num_beams and (s.num_beams > 1 or s.do_sample is not True):  # sampling: any
        raise ElxError(f"num_return_sequences ({s.num_return_sequences}) must be <= num_beams ({s.num_beams})")
    if prompt_len is not None:
        check_total_length(s, prompt_len)


# -- encoder inputs ------------------------------------------------------------------------------------

def vocab_size(manifest) -> int:
    value = manifest.dims.get("vocab_size")
    if not _is_int(value) or value < 1:
        raise ElxError(f"{manifest.folder or 'the manifest'}: dims.vocab_size is {value!r}, not a positive integer; "
                       "re-run 'elx export'")
    return int(value)


def source_vocab_size(manifest) -> int:
    """The encoder's input vocabulary: ``dims.source_vocab_size`` where it differs from the decoder's (FSMT)."""
    value = manifest.dims.get("source_vocab_size")
    if value is None:
        return vocab_size(manifest)
    if not _is_int(value) or value < 1:
        raise ElxError(f"{manifest.folder or 'the manifest'}: dims.source_vocab_size is {value!r}, not a positive "
                       "integer; re-run 'elx export'")
    return int(value)


def check_token_ids(ids: np.ndarray, vocab: int) -> None:
    """Every id in ``[0, vocab)``; the first bad one is named with its row."""
    bad = np.argwhere((ids < 0) | (ids >= vocab))
    if bad.size:
        row, col = (int(i) for i in bad[0])
        raise ElxError(f"input_ids row {row} holds token id {int(ids[row, col])} (position {col}), outside this "
                       f"model's vocabulary of {vocab} tokens (ids 0 to {vocab - 1}); fix the ids")


def check_token_rows(rows: list[list[int]]) -> None:
    """Ids typed by a user fit in int64 (ids beyond it would overflow before the vocabulary check)."""
    limit = np.iinfo(np.int64)
    for row, ids in enumerate(rows):
        bad = next((t for t in ids if not limit.min <= t <= limit.max), None)
        if bad is not None:
            raise ElxError(f"input_ids row {row} holds token id {bad}, far outside any vocabulary; fix the ids")


def check_token_shapes(inputs: dict) -> None:
    ids = inputs["input_ids"]
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise ElxError(f"input_ids has shape {list(ids.shape)}; pass at least one row of at least one token")
    mask = inputs.get("attention_mask")
    if mask is not None and mask.shape != ids.shape:
        raise ElxError(f"attention_mask has shape {list(mask.shape)}, input_ids {list(ids.shape)}; give one mask "
                       "value per token")


def check_source_length(manifest, ids: np.ndarray) -> None:
    """BART-like encoders read learned positions: at most ``max_position_embeddings`` tokens per row."""
    limit = manifest.dims.get("max_position_embeddings")
    if limit is not None and ids.shape[1] > int(limit):
        raise ElxError(f"the input has {ids.shape[1]} tokens; this model reads at most {limit} "
                       "(max_position_embeddings): shorten the input")


def check_features(inputs: dict) -> None:
    for role, array in inputs.items():
        if role in _TOKEN_ROLES:
            continue
        if array.ndim < 1 or array.shape[0] < 1:
            raise ElxError(f"encoder input {role!r} has shape {list(array.shape)}; pass at least one item")
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise ElxError(f"encoder input {role!r} holds NaN or infinite values; check the input")


def check_encoder_inputs(manifest, inputs: dict) -> None:
    """Encoder inputs by role are safe to feed: token ids in the vocabulary, lengths within the positions."""
    inputs = {role: np.asarray(value) for role, value in inputs.items() if value is not None}
    if "input_ids" in inputs:
        check_token_shapes(inputs)
        check_token_ids(inputs["input_ids"], source_vocab_size(manifest))
        check_source_length(manifest, inputs["input_ids"])
    check_features(inputs)


# -- threads -------------------------------------------------------------------------------------------

# ONNX Runtime starts one intra-op thread per requested thread in every session (three or four per export): asked
# for thousands, it starts thousands, which froze the 2-core machine of FACTS.md (load 640, SIGTERM unanswered).
# Threads beyond the cores only compete for them; 4 per core leaves room for oversubscription experiments.
THREADS_PER_CORE = 4


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_threads() -> int:
    return THREADS_PER_CORE * usable_cores()


def _threads(n: int) -> str:
    return f"--threads {n}" if on_command_line() else f"threads={n}"


def check_threads(threads) -> None:
    """``threads`` (``--threads``): None (ONNX Runtime's default, one per core) or an integer from 1 to
    ``max_threads()``; ``$OMP_NUM_THREADS`` (read by the search's top-k and PyTorch's log-softmax) within the same
    cap.  Refused before any thread starts."""
    cap, cores = max_threads(), usable_cores()
    why = f"at most {cap} ({THREADS_PER_CORE} per core of the {cores} this process may use; beyond the cores threads " \
          "only compete for them)"
    name = arg("threads")
    if threads is not None:
        if not _is_int(threads):
            raise ElxError(f"{name} must be an integer, got {threads!r}")
        if threads < 1:
            raise ElxError(f"{name} must be >= 1, got {threads}; leave it unset for ONNX Runtime's default (one per "
                           "core)")
        if threads > cap:
            raise ElxError(f"{name} is {threads}, {why}: pass {_threads(cap)} or fewer ({_threads(cores)}, one per "
                           "core, is usually fastest)")
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > cap:
        raise ElxError(f"OMP_NUM_THREADS is {value}, {why}: set it to {cap} or fewer ({cores}, one per core, is "
                       "usually fastest)")


# -- memory --------------------------------------------------------------------------------------------

def available_memory() -> int | None:
    """Bytes this process can still take: MemAvailable, or less under a cgroup limit; None when unknown."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                                        "memory/memory.usage_in_bytes")):
        try:
            limit = Path("/sys/fs/cgroup", limit_file).read_text().strip()
            usage = Path("/sys/fs/cgroup", usage_file).read_text().strip()
            if limit.isdigit() and int(limit) < 1 << 60:
                found.append(int(limit) - int(usage))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def first_step_bytes(manifest, settings, batch: int, prompt_len: int) -> int:
    """What a search allocates before its first step ends, whatever the outputs: its [rows, max length] token
    buffers (beam search keeps about 8 such copies: running, finished, candidates, merged) and the first
    step's [rows, vocab] float32 scores (about 4 copies: logits, log-probs, processors, beam scores)."""
    beams = settings.num_beams
    rows = batch * beams  # ``batch``: the inputs the search runs on (Whisper's repeats included)
    length = settings.total_max_length(prompt_len)
    copies = 8 if beams > 1 else 2
    return rows * length * 8 * copies + rows * vocab_size(manifest) * 4 * 4 + step_activation_bytes(manifest, rows,
                                                                                                    length)


def step_activation_bytes(manifest, rows: int, length: int) -> int:
    """What a decoder step's graph holds for ``rows`` rows besides the cache and the logits: a layer's widest
    activations (the feed-forward's, taken as 4 d_model, and the attention scores and probabilities over ``length``
    positions), float32, an input and an output of a node alive at once."""
    dims = manifest.dims
    d_model, heads = dims.get("d_model"), dims.get("num_heads")
    if not (_is_int(d_model) and _is_int(heads)):
        return 0
    return rows * (4 * int(d_model) + 2 * int(heads) * length) * 4 * 2


_ITEMSIZE = {"float32": 4, "float16": 2, "float64": 8, "int64": 8, "int32": 4}


def self_cache_bound(manifest, batch: int, beams: int, prompt_len: int, length: int) -> int:
    """The self-attention cache of a search at ``length`` positions, twice where a step's past and present coexist:
    every entry of the manifest's cache layout, for ``batch`` x ``beams`` rows; a prompt the export keeps once per
    input (``cache.prompt`` beam-shared: GPT-2's shared prompt) once per input.  An entry the runtime appends in place
    (``in_place``: ``runners/model.py``) lives in a buffer 1.5x its length, copied into the next when full: 2.5x."""
    per_position = 0  # bytes per position, doubled (2.5x for entries in place)
    for entry in manifest.cache_entries:
        shape, seq_axis = entry.get("shape") or [], entry.get("seq_axis")
        dims = [d for axis, d in enumerate(shape) if axis not in (0, seq_axis)]
        if not all(_is_int(d) for d in dims):
            return 0  # a layout this estimate does not know: no bound from it
        copies = 5 if entry.get("in_place") else 4  # in halves
        per_position += int(np.prod(dims, dtype=np.int64)) * _ITEMSIZE.get(entry.get("dtype"), 4) * copies // 2
    prompt = manifest.data.get("cache", {}).get("prompt")
    if isinstance(prompt, dict) and prompt.get("kind") == "beam-shared":
        return per_position * (batch * prompt_len + 2 * batch * beams * (length - prompt_len)) // 2
    return per_position * batch * beams * length


def encoder_bytes(manifest, inputs: dict) -> int:
    """The attention scores and probabilities of one encoder (or prompt) layer over token inputs: [B, heads, N, N]
    float32, twice; 0 for feature inputs (Whisper's length is fixed by the model)."""
    ids = inputs.get("input_ids")
    heads = manifest.dims.get("num_heads")
    if ids is None or not _is_int(heads):
        return 0
    batch, length = (int(d) for d in np.shape(ids)[:2])
    return 2 * batch * heads * length * length * 4


def check_memory(manifest, settings, inputs: dict, prompt_len: int) -> None:
    """Refuse a run that cannot fit in the memory left (instead of an ONNX Runtime allocation error deep in a graph,
    or the OOM killer): the encoder's attention over the inputs, or the search's buffers with the self-attention
    cache at the longest length it may reach (``self_cache_bound``).

    ``inputs``: the inputs as the search gets them (after the family's repeats); ``prompt_len``: the
    decoder prompt's length (padded)."""
    available = available_memory()
    if available is None or not inputs:
        return
    gib = 1 << 30
    encoder = encoder_bytes(manifest, inputs)
    if encoder > available:
        batch, length = (int(d) for d in np.shape(inputs["input_ids"])[:2])
        raise ElxError(f"{batch} input(s) of {length} tokens need about {encoder / gib:.1f} GiB for the attention "
                       f"scores of one layer ({manifest.dims['num_heads']} heads x {length}^2), more than the "
                       f"{available / gib:.1f} GiB of memory available; shorten the input or lower the batch")
    batch = int(next(iter(inputs.values())).shape[0])
    length = settings.total_max_length(prompt_len)
    needed = first_step_bytes(manifest, settings, batch, prompt_len) + \
        self_cache_bound(manifest, batch, settings.num_beams, prompt_len, length)
    if needed > available:
        raise ElxError(f"{batch} inputs x {settings.num_beams} beams x {length} tokens need about {needed / gib:.1f} "
                       f"GiB (search buffers and the self-attention cache), more than the {available / gib:.1f} GiB "
                       "of memory available; lower num_beams, the batch or the length")


def typed_encoder_inputs(manifest, inputs: dict) -> dict:
    """The encoder inputs the manifest names, as contiguous arrays of its dtypes (an all-ones mask where only
    ``input_ids`` came), checked: one ``ElxError`` naming a missing input or a wrong shape or value."""
    expected = manifest.encoder_inputs()
    out = {}
    for role, spec in expected.items():
        if role not in inputs or inputs[role] is None:
            if role == "attention_mask" and "input_ids" in inputs:
                out[role] = np.ones_like(np.asarray(inputs["input_ids"]), dtype=np.int64)
                continue
            raise ElxError(f"this model needs encoder input {role!r}; provide it")
        dtype = np.int64 if spec["dtype"] == "int64" else np.float32
        out[role] = np.ascontiguousarray(np.asarray(inputs[role], dtype=dtype))
        shape = spec.get("shape") or []
        actual = out[role].shape
        if shape and len(actual) != len(shape) or any(isinstance(d, int) and d != a for d, a in zip(shape, actual)):
            expected_shape = ", ".join(str(d) for d in shape)
            raise ElxError(f"encoder input {role!r} has shape {list(actual)}; this model takes [{expected_shape}]")
    check_encoder_inputs(manifest, out)  # runners/inputs/validation.py: token ids in the vocabulary, lengths, values
    return out
