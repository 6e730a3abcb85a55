"""Family rules at run time: one strategy object per model family, no ``family ==`` branches elsewhere.

HF ``generate`` treats families differently in a few places: Whisper builds its own decoder
prompt (start, language, task, no-timestamps), suppresses tokens, has its own length rule, runs
``num_return_sequences`` as repeated inputs, and returns the generated tokens without prompt or
EOS.  Each family's ``Rules`` object answers these questions; ``elx.runners.search.settings``,
``elx.runners.generate`` and ``elx.exporter.verification.compare`` only ever call the rules of the manifest's family.

* ``EncoderDecoderRules`` (T5, BART, Marian, mBART, M2M100/NLLB, Pegasus, FSMT): HF's generic rules;
  the decoder prompt is the start token (the BOS where the config sets none, as in HF) and HF
  returns the sequences with it.
* ``WhisperRules``: ``runners/whisper.py`` (transformers' ``WhisperGenerationMixin``).
* ``DecoderOnlyRules`` (GPT-2, OPT; ``RopeDecoderOnlyRules`` for the RoPE families): the prompt is the user's own token ids, left-padded, and HF
  returns the sequences with it; lengths count it (``max_length``, ``min_length``, the length
  penalty and n-gram blocking all see the padded prompt, as in HF); no start token.
"""
from __future__ import annotations

import numpy as np

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from elx.runners.inputs.validation import check_int


class EncoderDecoderRules:
    """HF ``GenerationMixin.generate`` for encoder-decoder models."""

    options: tuple[str, ...] = ()  # generation options beyond GenerationSettings' fields
    fields: tuple[str, ...] = ()  # generation config fields only this family reads (others refuse them from a caller)
    # options of HF generate that do nothing for this family and that a caller who sets them expects to act: why
    # (elx.runners.search.settings refuses them, where HF would ignore them silently)
    inert_options: dict = {}
    temperature_fallback = False  # a list of temperatures (Whisper's fallback) instead of one
    padding_side = "right"  # how rows of different lengths are padded (the encoder's inputs)
    # whether HF's first decoder call over a several-token decoder prefix (decoder_input_ids) is causal; FSMT's
    # cached decoder takes no causal mask, so there each prefix token sees the later ones (elx's graphs are causal)
    causal_prefix = True

    def validate(self, settings) -> None:
        """Family-specific checks of resolved settings (one-line ``ElxError``)."""
        if settings.decoder_start_token_id is None:
            raise ElxError("the manifest names no decoder_start_token_id (nor a bos_token_id, which HF would start "
                           "with); pass decoder_start_token_id or re-export from a model whose config sets it")
        check_int("decoder_start_token_id", settings.decoder_start_token_id, 0)

    def pad_token(self, manifest: Manifest) -> int:
        """The id padding rows of different lengths."""
        return manifest.tokens.get("pad_token_id") or 0

    def prompt_length(self, settings) -> int | None:
        """The decoder prompt's length when the settings fix it (None: the inputs set it)."""
        return len(settings.prompt())

    def prompt(self, inputs: dict, settings) -> np.ndarray:
        """The decoder prompt of each input [B, P] (int64): the start token (and Whisper's task tokens) for all."""
        batch = int(next(iter(inputs.values())).shape[0])
        return np.tile(np.asarray(settings.prompt(), dtype=np.int64), (batch, 1))

    def check_lengths(self, manifest: Manifest, inputs: dict, settings) -> None:
        """Refuse runs HF would refuse or crash on, given the inputs (one-line ``ElxError``)."""

    def resolve(self, manifest: Manifest, values: dict, extra: dict) -> dict:
        """Adjust the resolved generation values (model defaults + user options) to the family's rules.

        HF ``generate`` (``_prepare_special_tokens``) starts an encoder-decoder decoder with the BOS when
        no ``decoder_start_token_id`` is set (mBART's config sets none): mirrored."""
        if values.get("decoder_start_token_id") is None:
            return {**values, "decoder_start_token_id": manifest.tokens.get("bos_token_id")}
        return values

    def settings_options(self, options: dict) -> dict:
        """The options a plain search's settings take (``elx generate`` checks them before loading graphs)."""
        return options

    # a family's own loop around the search (Whisper): the module whose ``run_loop(generator, options, **given)``
    # returns its ``GenerationOutput``, or None where the call needs the plain search (named, not imported: the
    # loop runs searches, which read these rules)
    loop: str | None = None

    def prepare_inputs(self, inputs: dict, settings) -> dict:
        """The encoder inputs the search runs on (Whisper repeats them for num_return_sequences)."""
        return inputs

    def rows_per_input(self, settings) -> int:
        return settings.num_return_sequences

    def output_sequences(self, sequences: np.ndarray, settings) -> np.ndarray:
        """elx's sequences (decoder prompt included) in the layout HF ``generate`` returns."""
        return sequences

    def full_sequences(self, hf_sequences: np.ndarray, settings) -> np.ndarray:
        """HF's returned rows → prompt + tokens, the sequences to teacher-force (compare)."""
        return hf_sequences

    def hf_options(self, manifest: Manifest, options: dict) -> dict:
        """The options to pass HF ``generate`` so that it runs what elx runs (compare)."""
        return options

    def output_fill(self, settings) -> int:
        """The token HF pads finished rows with in what ``generate`` returns (-1: none; compare).

        HF's beam search pads with ``pad_token_id or eos_token_id[0]``: a pad id of 0 (T5) is falsy
        and gives the EOS (a quirk, mirrored); greedy search pads with ``pad_token_id``."""
        if settings.num_beams > 1:
            return int(settings.pad_token_id or settings.eos_token_id[0]) if settings.eos_token_id else -1
        return int(settings.pad_token_id) if settings.pad_token_id is not None else -1


class WhisperRules(EncoderDecoderRules):
    # language/task/return_timestamps, and HF Whisper generate's own arguments, which runners/whisper_longform.py
    # runs or refuses (a plain search gets them unset)
    options = ("language", "task", "return_timestamps", "return_segments", "compression_ratio_threshold",
               "logprob_threshold", "no_speech_threshold", "condition_on_prev_tokens", "prompt_ids",
               "prompt_condition_type", "return_token_timestamps")

    fields = ("is_multilingual", "lang_to_id", "task_to_id", "language_codes", "no_timestamps_token_id",
              "alignment_heads", "max_initial_timestamp_index", "prev_sot_token_id")
    temperature_fallback = True

    loop = "elx.runners.whisper_longform"

    def settings_options(self, options):
        from elx.runners.whisper import plain_options

        return plain_options(options)

    def resolve(self, manifest, values, extra):
        from elx.runners.whisper import apply_rules

        return apply_rules(manifest, values, **extra)

    def prepare_inputs(self, inputs, settings):
        if settings.input_repeats > 1:  # HF repeats each input and searches each copy with one return sequence
            return {k: np.repeat(v, settings.input_repeats, axis=0) for k, v in inputs.items()}
        return inputs

    def rows_per_input(self, settings):
        return settings.num_return_sequences * settings.input_repeats

    def final_eos(self, settings) -> int | None:
        """The EOS id HF Whisper cuts from the end of each returned row; None when it cuts none.

        HF quirk, mirrored: ``generate_with_fallback`` compares each row's last token with
        ``generation_config.eos_token_id`` in the form the caller gave it.  A list (even of one id)
        makes ``tensor == list`` plain ``False`` in PyTorch: no final EOS is cut, and ``pad == eos``
        never holds, so every pad token counts as padding.  Defaults from the manifest count as an
        int (every Whisper checkpoint's config has one); ``settings.eos_listed`` records the form.
        """
        if settings.eos_listed or not settings.eos_token_id:
            return None
        return int(settings.eos_token_id[0])

    def output_sequences(self, sequences, settings):
        from elx.runners.whisper import hf_sequences

        return hf_sequences(sequences, settings, self.final_eos(settings))

    def full_sequences(self, hf_sequences, settings):
        from elx.runners.whisper import full_sequences

        # one more position (a pad token), so that the step after HF's last kept token (its cut EOS) is
        # teacher-forced too, and an output of no tokens at all (EOS first) still has a step to check
        forced = full_sequences(hf_sequences, settings)
        return np.concatenate([forced, np.full((forced.shape[0], 1), settings.pad_token_id or 0, np.int64)], 1)

    def output_fill(self, settings):
        return int(settings.pad_token_id) if settings.pad_token_id is not None else -1

    def hf_options(self, manifest, options):
        from elx.runners.whisper import hf_language

        language = hf_language(manifest, options.get("language"), options.get("task"))
        return {**options, "language": language} if language is not None else dict(options)


class DecoderOnlyRules(EncoderDecoderRules):
    """HF ``GenerationMixin.generate`` for decoder-only models (transformers 5.23)."""

    padding_side = "left"  # HF: "decoder-only models must use left-padding for batched generation"
    inert_options = {"decoder_start_token_id": "a decoder-only model has no decoder start token (its prompt is the "
                                               "input ids, which HF continues)"}

    def validate(self, settings) -> None:
        pass  # no decoder start token: the prompt is the user's input

    def resolve(self, manifest, values, extra):
        return values  # no decoder start token (nor HF's BOS fallback for one)

    def pad_token(self, manifest: Manifest) -> int:
        # HF generate pads with eos_token_id[0] when the model has no pad token (GPT-2)
        pad = manifest.tokens.get("pad_token_id")
        eos = manifest.tokens.get("eos_token_id") or []
        return int(pad) if pad is not None else (int(eos[0]) if eos else 0)

    def prompt_length(self, settings):
        return None  # the prompt is the user's input

    def prompt(self, inputs, settings):
        return np.ascontiguousarray(inputs["input_ids"], dtype=np.int64)

    def check_lengths(self, manifest, inputs, settings):
        """HF raises when the prompt is not shorter than ``max_length``; past the position table its
        embedding lookup fails: both are one-line errors here, before any work."""
        width = int(inputs["input_ids"].shape[1])
        max_length = settings.total_max_length(width)
        if width >= max_length:
            raise ElxError(f"the prompt is {width} tokens (padded) but max_length is {max_length}: nothing to "
                           "generate; raise max_length or set max_new_tokens")
        self.check_positions(manifest, inputs, width, max_length)

    def check_positions(self, manifest, inputs, width: int, max_length: int) -> None:
        """Learned positions (GPT-2, OPT): every position the run looks up is in the table."""
        from elx.runners.inputs.prompt import sequence_positions

        positions = manifest.dims.get("max_position_embeddings")
        if positions:
            mask = inputs.get("attention_mask", np.ones_like(inputs["input_ids"]))
            # the last token is generated but never fed: positions up to index max_length - 2 are looked up
            needed = int(sequence_positions(mask, max_length - 1).max()) + 1
            if needed > positions:
                raise ElxError(f"this run needs {needed} positions (prompt of {width} tokens + up to "
                               f"{max_length - width} new tokens) but the model has {positions} (n_positions); "
                               "shorten the prompt or lower max_new_tokens / max_length")


RULES = {"t5": EncoderDecoderRules(), "bart": EncoderDecoderRules(), "whisper": WhisperRules(),
         "gpt2": DecoderOnlyRules(), "opt": DecoderOnlyRules()}
# the translation families (issue 25): HF's generic encoder-decoder rules; their language codes are token ids
# (``forced_bos_token_id``, ``decoder_start_token_id``), their positions computed inside the graphs
class FsmtRules(EncoderDecoderRules):
    causal_prefix = False


RULES.update({"m2m100": EncoderDecoderRules(), "pegasus": EncoderDecoderRules(), "fsmt": FsmtRules()})


# -- decoder-only families with rotary positions (issue 24) -------------------------------------------

class RopeDecoderOnlyRules(DecoderOnlyRules):
    """Llama, Mistral, Qwen2/Qwen3, Phi-3, Gemma, GPT-NeoX: HF's decoder-only rules; positions are rotations
    computed from the position ids (no table to run past), and a sliding window is refused where it would act.

    HF applies ``sliding_window`` W by sequence index (left padding counts): the query at index q
    sees keys q − W + 1 .. q.  The last token of ``max_length`` is never fed, so a run feeds at most
    ``max_length − 1`` tokens and the window changes nothing while that is ≤ W; the exported graphs
    attend to every earlier position, so a longer run is refused (one line naming the config key)."""

    def check_positions(self, manifest, inputs, width, max_length):
        passes = getattr(manifest, "data", {}).get("passes", [])  # (a manifest's dims alone: no pass)
        table = next((p.get("rotary_positions") for p in passes if p.get("name") == "fused-attention"), None)
        if table:  # --pass fused-attention with RoPE in the kernel: its cos/sin tables end there
            from elx.runners.inputs.prompt import sequence_positions

            mask = inputs.get("attention_mask", np.ones_like(inputs["input_ids"]))
            needed = int(sequence_positions(mask, max_length - 1).max()) + 1
            if needed > int(table):
                raise ElxError(f"this run needs {needed} positions (prompt of {width} tokens + up to "
                               f"{max_length - width} new tokens) but the export's fused attention holds RoPE tables "
                               f"for {table} (max_position_embeddings); shorten the prompt or lower max_new_tokens / "
                               "max_length")
        window = manifest.dims.get("sliding_window")
        if window is not None and max_length - 1 > int(window):
            raise ElxError(f"this run feeds up to {max_length - 1} tokens (prompt of {width} + new tokens) but the "
                           f"model's sliding_window is {window} (config.json), which elx's graphs do not apply; "
                           f"keep prompt + new tokens within {int(window) + 1}")


RULES.update({family: RopeDecoderOnlyRules() for family in
              ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt_neox")})


def rules_for(manifest: Manifest) -> EncoderDecoderRules:
    try:
        return RULES[manifest.family]
    except KeyError:
        raise ElxError(f"{manifest.folder or 'this export'} is of family {manifest.family!r}, which this elx cannot "
                       f"run ({', '.join(RULES)}); upgrade elx or re-export")
