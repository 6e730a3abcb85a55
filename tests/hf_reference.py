"""HF references for the tests: elx's searches fed HF's own PyTorch logits (``exporter/verification/hf_reference.py``, where the
stability rule of ``elx compare`` uses them too), and transformers' Whisper features on its numpy path.

``hf_numpy_features`` runs transformers' ``WhisperFeatureExtractor`` on its numpy path, the
reference elx's own log-mel features are bit-equal to.
"""
from __future__ import annotations

from unittest import mock

from elx.exporter.verification.hf_reference import HfDecoderOnlyLogitsBackend, HfLogitsBackend  # noqa: F401 - the tests' names


def hf_numpy_features(extractor, audio: list, **kwargs):
    """``extractor(audio, sampling_rate=…, return_tensors="np")`` on HF's numpy path.

    With torch installed HF computes the STFT through ``torch.stft`` (float32) instead; its numpy path,
    the one it takes without torch, is what elx reproduces bit for bit.  Returns HF's BatchFeature.
    """
    from transformers.models.whisper import feature_extraction_whisper

    with mock.patch.object(feature_extraction_whisper, "is_torch_available", lambda: False):
        return extractor(audio, sampling_rate=extractor.sampling_rate, return_tensors="np", **kwargs)
