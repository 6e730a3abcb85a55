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

    def output_sequences(self, sequences, settings):
        from .whisper import hf_sequences

        return hf_sequences(sequences, settings)

    def full_sequences(self, hf_sequences, settings):
        from .whisper import full_sequences

        return full_sequences(hf_sequences, settings)

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
