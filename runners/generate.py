"""The runner's front door: an export folder + a backend + a search = HF ``generate``'s output.

``Generator.from_folder(folder)`` loads the graphs on a backend (ONNX Runtime by default; no
PyTorch or transformers involved); ``generate(...)`` takes encoder inputs (arrays by role, or
``input_ids`` / ``text`` / ``audio`` when the folder allows) and HF ``generate``'s option names,
and returns the sequences in the layout HF returns them for the model's family, HF's
``sequences_scores`` for beam search, and the decoded text when the folder has a tokenizer.
"""
from __future__ import annotations

import importlib

from functools import cached_property

import numpy as np

from elx.runners.arguments import check_arguments, check_generate_call
from elx.runners.backends.base import Backend
from elx.runners.errors import ElxError
from elx.runners.families import rules_for
from elx.runners.generation_output import GenerationOutput
from elx.runners.search.log_softmax import kernel as log_softmax_kernel
from elx.runners.manifest import Manifest
from elx.runners.model import Model
from elx.runners.hooks import CallArguments, check_family_options, decoder_prefix, graph_may_block, processor_inputs, search_hooks
from elx.runners.search.processors import build_processors
from elx.runners.search.search import beam_search, greedy_search
from elx.runners.search.device import for_search_path
from elx.runners.search.settings import GenerationSettings, resolve_settings
from elx.runners.inputs.chat import Chat, replies
from elx.runners.inputs.languages import choose as choose_languages
from elx.runners.inputs.text import Text, pad_rows
from elx.runners.inputs.validation import check_memory, typed_encoder_inputs

BACKENDS = ("ort", "ort-io", "tensorrt")


def make_backend(manifest: Manifest, backend: str = "ort", device: str = "cpu", device_id: int = 0,
                 threads: int | None = None) -> Backend:
    """The named backend on ``device``: ``ort`` (host arrays; on cuda it binds device buffers), ``ort-io``, ``tensorrt``."""
    if (device != "cpu" or backend == "tensorrt") and "fused-attention" in manifest.pass_names():
        raise ElxError(f"{manifest.folder} was exported with --pass fused-attention, whose ONNX Runtime "
                       "GroupQueryAttention kernel runs on the CPU in fp32 (ONNX Runtime's CUDA kernel takes fp16 only, "
                       "TensorRT has none); run it on the CPU, or export without that pass for the GPU")
    if backend == "ort" and device == "cpu":
        from elx.runners.backends.ort import OrtBackend

        return OrtBackend(manifest, threads=threads)
    if backend in ("ort", "ort-io"):
        from elx.runners.backends.ort_io import OrtIoBackend

        return OrtIoBackend(manifest, device=device, device_id=device_id, threads=threads)
    if backend == "tensorrt":
        try:
            from elx.runners.backends.tensorrt import TensorRTBackend
        except ModuleNotFoundError as err:
            if err.name and err.name.endswith("tensorrt_backend"):
                raise ElxError("this elx build has no TensorRT backend")
            raise
        return TensorRTBackend(manifest, device=device, device_id=device_id)
    raise ElxError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")


class Generator:
    """An export folder's graphs on a backend, generating as HF ``generate`` does.

    ``Generator.from_folder(folder)`` loads it (ONNX Runtime on the CPU by default; no PyTorch or transformers);
    ``generate(...)`` takes encoder inputs (``input_ids=``, ``text=``, ``messages=``, ``audio=``, or arrays by
    role) and HF ``generate``'s option names, and returns a ``GenerationOutput`` (``sequences``,
    ``sequences_scores``, ``text``, ...).  Errors a caller can fix are ``elx.ElxError``."""

    def __init__(self, model: Model):
        self.model = model
        self.rules = rules_for(model.manifest)
        self._stop_strings = {}  # stop-string tables per tokenizer and strings (runners/hooks.py)

    def __repr__(self) -> str:
        data = self.manifest.data
        passes = ",".join(p["name"] for p in data.get("passes", [])) or "none"
        backend = type(self.model.backend).__name__
        return (f"Generator({str(self.manifest.folder)!r}, family={data.get('family')!r}, "
                f"architecture={data.get('architecture')!r}, precision={data.get('precision', 'fp32')!r}, "
                f"passes={passes!r}, backend={backend})")

    @classmethod
    def from_folder(cls, folder, *, backend: str = "ort", device: str = "cpu", threads: int | None = None,
                    device_id: int = 0) -> "Generator":
        """Load the export in ``folder`` (``elx export``'s output; its manifest is checked once, here) on ``backend``
        ("ort": ONNX Runtime with host arrays, "ort-io": with IOBinding, "tensorrt": the folder's engines) and
        ``device`` ("cpu" or "cuda", ``device_id``), ONNX Runtime with ``threads`` intra-op threads (None: its
        default)."""
        check_arguments("from_folder", locals())  # runners/arguments.py: one line naming a wrong argument
        manifest = Manifest.load(folder)
        return cls(Model(manifest, make_backend(manifest, backend, device, device_id, threads)))

    @property
    def manifest(self) -> Manifest:
        return self.model.manifest

    @cached_property
    def text(self) -> Text | None:
        """The folder's tokenizer (loaded once), or None."""
        return Text.load(self.manifest.folder) if self.manifest.folder else None

    @cached_property
    def chat(self) -> Chat:
        """The folder's chat template with its tokenizer (runners/inputs/chat.py), loaded once; else one line."""
        return Chat.load(self.manifest, self.text)

    def settings(self, **options) -> GenerationSettings:
        return resolve_settings(self.manifest, **options)

    def encoder_inputs(self, inputs: dict | None = None, *, input_ids=None, attention_mask=None, text=None,
                       audio=None, input_features=None, messages=None, languages=None) -> dict:
        """Encoder inputs by role from whichever form the caller used; ``languages``: the source side of
        ``src_lang`` / ``tgt_lang`` (``runners/inputs/languages.py``), for text."""
        given = [name for name, v in (("inputs", inputs), ("input_ids", input_ids), ("text", text), ("audio", audio),
                                      ("input_features", input_features), ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise ElxError(f"pass exactly one of inputs, input_ids, text, audio, input_features, messages (got "
                           f"{', '.join(given) or 'none'})")
        roles = self.manifest.encoder_inputs()
        if audio is not None:
            if "input_features" not in roles:
                raise ElxError("audio input needs a model whose encoder takes audio features (Whisper)")
            from elx.runners.inputs.audio import features_from_files

            return features_from_files(self.manifest.folder, audio)
        if input_features is not None:
            return {"input_features": input_features}
        if languages is not None and languages.needs_text and text is None:
            languages.refuse_without_text()
        if inputs is not None:
            return dict(inputs)
        if "input_ids" not in roles:
            raise ElxError(f"this model's encoder takes {', '.join(roles)}; pass audio= or input_features=")
        if text is not None:
            if self.text is None:
                raise ElxError(f"{self.manifest.folder} has no tokenizer; pass input_ids instead of text")
            texts = [text] if isinstance(text, str) else list(text)
            specials = None
            if languages is not None:
                texts, specials = languages.texts(texts), languages.specials
            input_ids = self.text.encode(texts, specials=specials)
        if messages is not None:  # the prompt as the model's chat template writes it (runners/inputs/chat.py)
            input_ids = self.chat.prompt_ids(messages)
        if attention_mask is None and not isinstance(input_ids, np.ndarray):
            return pad_rows([list(map(int, row)) for row in input_ids], self.rules.pad_token(self.manifest),
                            self.rules.padding_side)
        return {"input_ids": input_ids, **({} if attention_mask is None else {"attention_mask": attention_mask})}

    def generate(self, inputs: dict | None = None, *, text=None, audio=None, input_ids=None, attention_mask=None,
                 input_features=None, messages=None, settings: GenerationSettings | None = None,
                 track_memory: bool = False, decode: bool = True, src_lang: str | None = None,
                 tgt_lang: str | None = None, **options) -> GenerationOutput:
        """Generate as HF ``generate`` does, with its option names (num_beams, max_new_tokens, do_sample, ...) and
        its call arguments (streamer, logits_processor, stopping_criteria, prefix_allowed_tokens_fn, tokenizer,
        decoder_input_ids, generation_config; ``runners/options.py`` lists every option and what elx does with it).

        ``decode=False`` leaves ``text`` None (a caller that detokenizes elsewhere, e.g. the dataset pipeline's
        writer thread).  ``messages``: a conversation ([{"role", "content"}, ...]) or a list of them, prompted through
        the export's chat template as transformers' ``apply_chat_template(..., add_generation_prompt=True)``
        prompts it; ``text`` is then each row's reply (runners/inputs/chat.py).  ``src_lang`` / ``tgt_lang``:
        language codes as the model's HF tokenizer names them (``deu_Latn``, ``de_DE``, ``de``, ``>>deu<<``), used
        as HF uses them (``runners/inputs/languages.py``)."""
        check_generate_call(self.manifest, locals())  # runners/arguments.py: types and shapes of every argument
        languages = choose_languages(self.manifest, src_lang, tgt_lang, options)
        if languages is not None and languages.options:
            if settings is not None:
                (name, value), = languages.options.items()
                raise ElxError(f"tgt_lang sets {name}, which settings= fixes already: give Generator.settings(...) "
                               f"{name}={value}, or drop settings=")
            options = {**options, **languages.options}
        if settings is None and self.rules.loop:  # a family's own loop (Whisper: timestamps, long-form, detection,
            # fallback run HF's loop, runners/whisper_longform.py), when the call needs it (else None)
            looped = importlib.import_module(self.rules.loop).run_loop(
                self, dict(options), inputs=inputs, audio=audio, decode=decode, input_features=input_features,
                attention_mask=attention_mask)
            if looped is not None:
                return looped
        settings = settings or self.settings(**options)
        inputs = self.encoder_inputs(inputs, input_ids=input_ids, attention_mask=attention_mask, text=text,
                                     audio=audio, input_features=input_features, messages=messages,
                                     languages=languages)
        inputs = self.rules.prepare_inputs(typed_encoder_inputs(self.manifest, inputs), settings)
        self.rules.check_lengths(self.manifest, inputs, settings)
        prompt = self.rules.prompt(inputs, settings)
        args = CallArguments.of(options)
        check_family_options(self.manifest, options, settings)
        if args.decoder_input_ids is not None:
            prompt = decoder_prefix(self.manifest, settings, prompt, args.decoder_input_ids, self.rules.causal_prefix)
        check_memory(self.manifest, settings, inputs, prompt.shape[1])  # runners/inputs/validation.py: refuse what cannot fit
        model = self.model.for_run(settings.no_repeat_ngram_size if graph_may_block(settings, args) else None)
        log_softmax_kernel()  # a bad ELX_LOG_SOFTMAX is refused before any graph runs
        processors = build_processors(settings, prompt.shape[1], graph_blocks_ngrams=model.returns_log_probs,
                                      inputs=processor_inputs(self.manifest, inputs, args))
        text = self.text if settings.stop_strings and args.tokenizer is None else None
        hooks = search_hooks(settings, args, text, int(prompt.shape[0]), self._stop_strings)
        model = for_search_path(model, processors, hooks)  # a device search keeps a prompt's scores there
        search = greedy_search if settings.num_beams == 1 else beam_search
        try:
            result = search(model, model.encode(inputs), settings, processors, track_memory=track_memory,
                            prompt=prompt, hooks=hooks)
        finally:  # the run's caches are the search's: nothing of them stays bound to the backend (a model-like
            # object without a backend, e.g. the verification's HF search backends, holds nothing to release)
            release = getattr(self.model, "release_run", None)
            if release is not None:
                release()
        sequences = self.rules.output_sequences(result.sequences, settings)
        text_out = self.text.decode(sequences) if decode and self.text is not None and messages is None else None
        if decode and messages is not None:  # the replies: a decoder-only row begins with its prompt
            text_out = replies(self.text, sequences, self.rules, settings, inputs)
        return GenerationOutput(sequences, result.scores, text_out, result.sequences, settings, result.steps,
                                result.memory, result.step_scores, result.step_logits, result.beam_indices)


