"""Family rules at run time: one strategy object per model family, no ``family ==`` branches elsewhere.

HF ``generate`` treats families differently in a few places: Whisper builds its own decoder
prompt (start, language, task, no-timestamps), suppresses tokens, has its own length rule, runs
``num_return_sequences`` as repeated inputs, and returns the generated tokens without prompt or
EOS.  Each family's ``Rules`` object answers these questions; ``runners.settings``,
``runners.generate`` and ``exporter.compare`` only ever call the rules of the manifest's family.

* ``EncoderDecoderRules`` (T5, BART, Marian, mBART): HF's generic rules; the decoder prompt is
  the start token and HF returns the sequences with it.
* ``WhisperRules``: ``runners/whisper.py`` (transformers' ``WhisperGenerationMixin``).
"""
from __future__ import annotations

import numpy as np

from .errors import ElxError
from .manifest import Manifest


class EncoderDecoderRules:
    """HF ``GenerationMixin.generate`` for encoder-decoder models."""

    options: tuple[str, ...] = ()  # generation options beyond GenerationSettings' fields

    def resolve(self, manifest: Manifest, values: dict, extra: dict) -> dict:
        """Adjust the resolved generation values (model defaults + user options) to the family's rules."""
        return values

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
    options = ("language", "task", "return_timestamps")

    def resolve(self, manifest, values, extra):
        from .whisper import apply_rules

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
        from .whisper import hf_sequences

        return hf_sequences(sequences, settings, self.final_eos(settings))

    def full_sequences(self, hf_sequences, settings):
        from .whisper import full_sequences

        # one more position (a pad token), so that the step after HF's last kept token (its cut EOS) is
        # teacher-forced too, and an output of no tokens at all (EOS first) still has a step to check
        forced = full_sequences(hf_sequences, settings)
        return np.concatenate([forced, np.full((forced.shape[0], 1), settings.pad_token_id or 0, np.int64)], 1)

    def output_fill(self, settings):
        return int(settings.pad_token_id) if settings.pad_token_id is not None else -1

    def hf_options(self, manifest, options):
        from .whisper import hf_language

        language = hf_language(manifest, options.get("language"), options.get("task"))
        return {**options, "language": language} if language is not None else dict(options)


RULES = {"t5": EncoderDecoderRules(), "bart": EncoderDecoderRules(), "whisper": WhisperRules()}


def rules_for(manifest: Manifest) -> EncoderDecoderRules:
    try:
        return RULES[manifest.family]
    except KeyError:
        raise ElxError(f"{manifest.folder or 'this export'} is of family {manifest.family!r}, which this elx cannot "
                       f"run ({', '.join(RULES)}); upgrade elx or re-export")
