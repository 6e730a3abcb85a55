"""The template builders (graphs written from the weights instead of traced, issue 41), one module per family.

Each module has ``CLASSES`` (the model classes it describes), ``applies(model)`` (None, or why its templates are traced)
and ``build_prefill`` / ``build_step(template_model, values)``: the templates of ``decoder_only.PrefillGraph`` and
``SharedPromptStepGraph`` (the per-beam step and the other wrappers are traced).  ``ELX_TEMPLATE_BUILDER``
(``llama_builder.enabled``) switches them all.  ``exporter/capture/stitched.py`` asks ``for_model`` and ``build``.
"""
from __future__ import annotations

from elx.exporter.capture import gpt2_builder, llama_builder, opt_builder

MODULES = (llama_builder, gpt2_builder, opt_builder)
WRAPPERS = {"PrefillGraph": "build_prefill", "SharedPromptStepGraph": "build_step"}


def for_model(model):
    """The builder module whose classes include ``model``'s, or None."""
    return next((module for module in MODULES if type(model).__name__ in module.CLASSES), None)


def builds(graph_module) -> bool:
    """Whether the builders write the template of this wrapper (prefill and shared-prompt step)."""
    return type(graph_module).__name__ in WRAPPERS


def build(builder, graph_module, template_model, values: bool = False) -> tuple | None:
    """(the template graph ``trace`` writes for ``graph_module``, a ``decoder_only`` wrapper over ``template_model``;
    its bindings: ``{initializer: Binding}`` as ``exporter/capture/weights.py``'s ``bind`` finds them) by
    ``builder``, or None for a wrapper the builders do not build.  The bound initializers hold no values unless
    ``values`` (stitching binds the model's own tensors; the template's would be copied for nothing: 7-9 s at 1B+)."""
    method = WRAPPERS.get(type(graph_module).__name__)
    return None if method is None else getattr(builder, method)(template_model, values)
