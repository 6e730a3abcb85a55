"""The template builders (graphs written from the weights instead of traced, issue 41), one module per family.

Each module has ``CLASSES`` (the model classes it describes), ``applies(model)`` (None, or why its templates are traced)
and the builders of its wrappers' templates (``WRAPPERS``; ``build_X(template_model, values)``): decoder-only
modules (Llama, Mistral, Qwen2/3, Gemma, Phi-3; GPT-NeoX; GPT-2; OPT) ``decoder_only.PrefillGraph``'s and
``SharedPromptStepGraph``'s (the per-beam step is traced); encoder-decoder
modules (T5; BART, Marian, mBART, Pegasus, M2M100/NLLB; Whisper) the encoder's, cross K/V's and decoder step's
(``capture/wrappers.py``; their shared parts: ``seq2seq_parts.py``).  ``ELX_TEMPLATE_BUILDER``
(``llama_builder.enabled``) switches them all.  ``exporter/capture/stitched.py`` asks ``for_model`` and ``build``.
"""
from __future__ import annotations

from elx.exporter.capture import bart_builder, gpt2_builder, llama_builder, neox_builder, opt_builder, t5_builder, \
    whisper_builder

MODULES = (llama_builder, neox_builder, gpt2_builder, opt_builder, t5_builder, bart_builder, whisper_builder)
# the wrapper classes whose templates a builder may write, and the function that does (where the module has it)
WRAPPERS = {"PrefillGraph": "build_prefill", "SharedPromptStepGraph": "build_step",  # decoder-only
            "EncoderGraph": "build_encoder", "CrossKVGraph": "build_cross_kv", "DecoderGraph": "build_decoder"}


def for_model(model):
    """The builder module whose classes include ``model``'s, or None."""
    return next((module for module in MODULES if type(model).__name__ in module.CLASSES), None)


def builds(builder, graph_module) -> bool:
    """Whether ``builder`` writes the template of this wrapper (``WRAPPERS``)."""
    return hasattr(builder, WRAPPERS.get(type(graph_module).__name__, "-"))


def build(builder, graph_module, template_model, values: bool = False) -> tuple | None:
    """(the template graph ``trace`` writes for ``graph_module``, a ``decoder_only`` wrapper over ``template_model``;
    its bindings: ``{initializer: Binding}`` as ``exporter/capture/weights.py``'s ``bind`` finds them) by
    ``builder``, or None for a wrapper the builders do not build.  The bound initializers hold no values unless
    ``values`` (stitching binds the model's own tensors; the template's would be copied for nothing: 7-9 s at 1B+)."""
    method = getattr(builder, WRAPPERS.get(type(graph_module).__name__, "-"), None)
    return None if method is None else method(template_model, values)
