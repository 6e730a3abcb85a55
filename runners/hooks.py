"""HF ``generate``'s call arguments (beside ``GenerationConfig``'s fields) and what a run builds from them.

``CallArguments`` takes ``logits_processor``, ``stopping_criteria``, ``prefix_allowed_tokens_fn``, ``streamer``,
``tokenizer`` and ``decoder_input_ids`` from the options ``Generator.generate`` got (``generation_config`` and
``seed`` are settings: ``runners/search/settings.py``).  ``plan_run`` turns them and the settings into the
processors' inputs and the search's hooks (``runners/search/search_hooks.py``), and refuses what HF refuses
(a streamer with beam search, stop strings without a tokenizer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elx.runners.errors import ElxError
from elx.runners.search.processors import ProcessorInputs
from elx.runners.search.processors.user import UserCriterion
from elx.runners.search.sampling import Sampler
from elx.runners.search.search_hooks import SearchHooks
from elx.runners.search.stopping import MaxTime, Stopping
from elx.runners.inputs.validation import check_total_length

AUDIO = "input_features"


@dataclass
class CallArguments:
    logits_processor: tuple = ()
    stopping_criteria: tuple = ()
    prefix_allowed_tokens_fn: object = None
    streamer: object = None
    tokenizer: object = None
    decoder_input_ids: object = None

    @classmethod
    def of(cls, options: dict) -> "CallArguments":
        def listed(name):
            value = options.get(name)
            if value is None:
                return ()
            if callable(value) and not isinstance(value, (list, tuple)):
                value = [value]
            if not all(callable(v) for v in value):
                raise ElxError(f"{name} must be a list of callables")
            return tuple(value)

        prefix = options.get("prefix_allowed_tokens_fn")
        if prefix is not None and not callable(prefix):
            raise ElxError("prefix_allowed_tokens_fn must be a callable (batch_id, input_ids) -> allowed token ids")
        streamer = options.get("streamer")
        if streamer is not None and not (hasattr(streamer, "put") and hasattr(streamer, "end")):
            raise ElxError("streamer must have put(token_ids) and end() (HF's streamer protocol)")
        return cls(listed("logits_processor"), listed("stopping_criteria"), prefix, streamer,
                   options.get("tokenizer"), options.get("decoder_input_ids"))

    @property
    def sees_all_rows(self) -> bool:
        """The caller's callables may look at every row (HF passes them all, finished ones included)."""
        return bool(self.logits_processor or self.stopping_criteria or self.prefix_allowed_tokens_fn is not None)


def check_family_options(manifest, options: dict, settings) -> None:
    """What a plain audio (Whisper) search does not run: HF's Whisper generate decides sampling from ``temperature``
    (its fallback list, ``runners/whisper_longform.py``, which ``generate``'s options reach) and returns its own
    output structure."""
    if AUDIO not in manifest.encoder_inputs():
        return
    if settings.do_sample or options.get("temperature") is not None:
        raise ElxError("Whisper samples through HF's temperature fallback loop, which Generator.generate runs from its "
                       "options (temperature=...), not from settings=: pass the options instead")
    if settings.return_dict_in_generate:
        raise ElxError("HF's Whisper generate returns its own output structure; return_dict_in_generate is not "
                       "supported for Whisper yet: drop it")


def _stop_tokenizer(args: CallArguments, text):
    if args.tokenizer is not None:  # an HF tokenizer: its tokenizers.Tokenizer
        backend = getattr(args.tokenizer, "backend_tokenizer", args.tokenizer)
        if not hasattr(backend, "get_vocab") or not hasattr(backend, "decoder"):
            raise ElxError("tokenizer must be a fast HF tokenizer or a tokenizers.Tokenizer (for stop_strings)")
        return backend
    if text is None:
        raise ElxError("stop_strings need a tokenizer: this export has none; pass tokenizer=")
    return text.stop_tokenizer()


def processor_inputs(manifest, inputs: dict, args: CallArguments) -> ProcessorInputs:
    """HF's ``encoder_input_ids`` (token inputs without negative ids) and a decoder-only prompt's left padding."""
    ids = inputs.get("input_ids")
    encoder_ids = ids if ids is not None and not (ids < 0).any() else None
    padding = None
    mask = inputs.get("attention_mask")
    if not manifest.data.get("is_encoder_decoder", True) and mask is not None and not (mask == 1).all():
        padding = (mask != 0).argmax(axis=1)
    return ProcessorInputs(encoder_ids, padding, args.logits_processor, args.prefix_allowed_tokens_fn)


def search_hooks(settings, args: CallArguments, text, batch: int, stop_cache: dict) -> SearchHooks:
    """The hooks of a run of ``batch`` inputs; ``stop_cache`` keeps stop-string tables between runs."""
    s = settings
    beams = s.num_beams > 1
    if args.streamer is not None and beams:
        raise ElxError("a streamer cannot be used with beam search (HF refuses it too): set num_beams=1")
    criteria = []
    if s.max_time is not None:
        criteria.append(MaxTime(float(s.max_time)))
    if s.stop_strings:
        from elx.runners.search.stop_strings import StopStrings

        tokenizer = _stop_tokenizer(args, text)
        key = (id(tokenizer), tuple(s.stop_strings))
        if key not in stop_cache:
            stop_cache[key] = (tokenizer, StopStrings(s.stop_strings, tokenizer))  # holds the tokenizer: the id stays
        criteria.append(stop_cache[key][1])
    criteria.extend(UserCriterion(fn) for fn in args.stopping_criteria)
    repeats = s.num_return_sequences if s.do_sample and not beams else 1
    per_row = bool(s.stop_strings or args.stopping_criteria)
    return SearchHooks(
        sampler=Sampler(s.seed, batch * repeats) if s.do_sample else None,
        stopping=Stopping(criteria) if criteria else None,
        record_scores=s.returns_scores, record_logits=s.returns_logits,
        beam_indices=s.return_dict_in_generate and beams, streamer=args.streamer,
        keep_rows=(s.returns_scores or s.returns_logits or args.sees_all_rows or (per_row and not s.eos_token_id)),
        repeats=repeats)


def graph_may_block(settings, args: CallArguments) -> bool:
    """Whether a run may read the ``ngram`` pass's blocked log-probs instead of the logits.

    Beam search log-softmaxes first, as the graph does, and the processors HF runs before the n-gram ban
    commute with it (they rescale or ban): the blocked output serves unless the run returns raw logits.
    Greedy runs process raw logits: only when nothing but bans applies (argmax is then the same) and no
    scores are returned."""
    s = settings
    if s.returns_logits:
        return False
    if s.num_beams > 1:
        return True
    rescales = (s.do_sample or s.repetition_penalty != 1.0 or s.encoder_repetition_penalty != 1.0
                or s.sequence_bias is not None or s.exponential_decay_length_penalty is not None
                or s.renormalize_logits or s.remove_invalid_values or s.returns_scores or args.logits_processor)
    return not rescales


def decoder_prefix(manifest, settings, prompt: np.ndarray, ids, causal_prefix: bool = True) -> np.ndarray:
    """HF's ``_prepare_decoder_input_ids_for_generation``: the caller's ``decoder_input_ids`` [B, P], with the
    start token put in front when no row starts with it.  ``causal_prefix`` False (the family's rules: FSMT):
    a prefix of more than one token is refused, HF runs it without a causal mask."""
    if not manifest.data.get("is_encoder_decoder", True):
        raise ElxError("decoder_input_ids apply to encoder-decoder models; a decoder-only model's prompt is input_ids")
    if AUDIO in manifest.encoder_inputs():
        raise ElxError("Whisper builds its decoder prompt itself (language, task); decoder_input_ids are not "
                       "supported for it: use language= and task=")
    ids = _prefix_rows(ids)
    if ids.ndim != 2 or ids.shape[1] < 1 or ids.shape[0] != prompt.shape[0]:
        raise ElxError(f"decoder_input_ids has shape {list(ids.shape)}; pass one row per input ({prompt.shape[0]}) "
                       "of at least one token")
    vocab = int(manifest.dims["vocab_size"])
    if ((ids < 0) | (ids >= vocab)).any():
        raise ElxError(f"decoder_input_ids hold ids outside the vocabulary of {vocab} tokens; fix them")
    start = prompt[:, :1]
    if (ids[:, 0] != start[:, 0]).all():
        ids = np.concatenate([start, ids], axis=1)
    if ids.shape[1] > 1 and not causal_prefix:
        raise ElxError(f"decoder_input_ids of {ids.shape[1]} tokens: HF's {manifest.family} decoder reads a prefix "
                       "without a causal mask (each token sees the later ones), which elx's step graphs do not "
                       "reproduce; pass only the start token, or generate without decoder_input_ids")
    check_total_length(settings, ids.shape[1])  # runners/inputs/validation.py: the decoder's positions
    max_length = settings.total_max_length(ids.shape[1])
    if ids.shape[1] >= max_length:
        raise ElxError(f"decoder_input_ids make a {ids.shape[1]}-token decoder prompt but max_length is {max_length}: "
                       "nothing to generate; raise max_length or set max_new_tokens")
    return ids


def _prefix_rows(value) -> np.ndarray:
    """``decoder_input_ids`` as int64 [rows, P]: rows of ints (one row alone is taken as one input's); floats and
    bools are refused as token ids are everywhere (``runners/arguments.py``), never truncated."""
    from elx.runners.arguments import token_array, token_rows

    name = "decoder_input_ids"
    if hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
        flat = np.asarray(value)
        if flat.ndim == 1:
            value = flat[None, :]
    elif isinstance(value, (list, tuple)) and value and not any(hasattr(v, "__len__") for v in value):
        value = [value]
    array = token_array(name, value)
    if array is None:
        rows = token_rows(name, value)
        if len({len(r) for r in rows}) > 1:
            raise ElxError(f"{name} rows have different lengths; pass rows of equal length")
        array = np.asarray(rows, dtype=np.int64)
    return array.astype(np.int64, copy=False)
