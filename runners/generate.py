"""The runner's front door: a manifest folder + a backend + a search = generated token ids."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runners.errors import ElxError

from .backend import Backend
from .manifest import Manifest
from .processors import build_processors
from .search import SearchResult, beam_search, greedy_search
from .settings import GenerationSettings, resolve_settings
from .validation import check_encoder_inputs, check_memory


@dataclass
class Generator:
    backend: Backend

    @classmethod
    def from_folder(cls, folder, backend: str = "ort", threads: int | None = None) -> "Generator":
        manifest = Manifest.load(folder)
        if backend == "ort":
            from .ort_backend import OrtBackend

            return cls(OrtBackend(manifest, threads=threads))
        raise ElxError(f"unknown backend {backend!r}; available: ort")

    @property
    def manifest(self) -> Manifest:
        return self.backend.manifest

    def settings(self, **options) -> GenerationSettings:
        return resolve_settings(self.manifest, **options)

    def generate(self, inputs: dict, settings: GenerationSettings | None = None, track_memory: bool = False,
                 **options) -> SearchResult:
        """``inputs`` by role (``input_ids``/``attention_mask`` or ``input_features``), batch B."""
        settings = settings or self.settings(**options)
        inputs = _check_inputs(self.manifest, inputs)
        check_memory(self.manifest, settings, inputs)  # runners/validation.py: refuse what cannot fit
        if settings.input_repeats > 1:  # Whisper's num_return_sequences (runners/whisper.py)
            inputs = {k: np.repeat(v, settings.input_repeats, axis=0) for k, v in inputs.items()}
        prompt_len = len(settings.prompt())
        graph_ngrams = any(p.get("blocks_ngrams") for p in self.manifest.passes)
        processors = build_processors(settings, prompt_len, graph_blocks_ngrams=graph_ngrams)
        state = self.backend.encode(inputs)
        search = greedy_search if settings.num_beams == 1 else beam_search
        return search(self.backend, state, settings, processors, track_memory=track_memory)


def _check_inputs(manifest: Manifest, inputs: dict) -> dict:
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
            expected = ", ".join(str(d) for d in shape)
            raise ElxError(f"encoder input {role!r} has shape {list(actual)}; this model takes [{expected}]")
    check_encoder_inputs(manifest, out)  # runners/validation.py: token ids in the vocabulary, lengths, values
    return out
