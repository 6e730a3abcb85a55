"""The template a graph is traced from: the user's model with ``TEMPLATE_LAYERS`` layers per stack.

Same class, same config but the layer counts (and ``layer_types``, cut to the template's layers), built on
PyTorch's meta device (nothing allocated), then given its tensors:

* the parameters outside the layers (embeddings, final norms, the head) and every buffer (RoPE frequencies,
  position tables) are the user's model's own tensors, shared, not copied: constants the exporter folds from
  them are already the model's;
* the layers' parameters are synthetic, every value drawn at random (seeded), so that each initializer the
  exporter derives from one of them names it unambiguously (``exporter/capture/weights.py``); the stitcher
  then points it at the user's layer (``exporter/capture/stitch.py``).

A model whose stacks have ``TEMPLATE_LAYERS`` layers or fewer has nothing to stitch: built whole from its own weights where a
builder describes it (``stitched._whole_model_template``), else traced whole.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from elx.exporter.capture.stitch import NotStitchable, TooShallow

TEMPLATE_LAYERS = 3  # layer 0 may differ from the others; layer 1 is the witness the copied layer 2 is checked against
SEED = 20261128
# config keys that count layers (a family's config names one or two of them)
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")
# the first layer stack in a parameter's name: model.layers.3.mlp → model.layers; T5's encoder.block.3.layer.0 →
# encoder.block; GPT-2's transformer.h.3 → transformer.h
STACK = re.compile(r"^(.*?\.(?:layers|layer|h|block|blocks))\.(\d+)\.")


def stacks_of(model) -> dict:
    """{stack path in the HF model: its layer count} from the model's parameter names."""
    counts = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        match = STACK.match(name)
        if match:
            counts[match.group(1)] = max(counts.get(match.group(1), 0), int(match.group(2)) + 1)
    return counts


@dataclass
class Template:
    model: torch.nn.Module  # the few-layer HF model (its layers' weights synthetic)
    stacks: dict  # {stack path in the HF model: (template layers, the user's model's layers)}
    whole: bool = False  # the model itself, shallow enough to be built whole (``capture/stitched.py``)

    @property
    def layers(self) -> int:
        return max(real for _, real in self.stacks.values())


def template_config(config, layers: int = TEMPLATE_LAYERS):
    """The config with every layer count cut to ``layers`` (and ``layer_types`` to its first ``layers``)."""
    data = config.to_dict()
    for key in LAYER_KEYS:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > layers:
            data[key] = layers
    types = data.get("layer_types")
    if isinstance(types, list) and len(types) > layers:
        if len(set(types[1:])) > 1:
            raise NotStitchable(f"its layers are of several types ({', '.join(sorted(set(types)))})")
        data["layer_types"] = types[:layers]
    data.pop("transformers_version", None)
    cut = type(config).from_dict(data)
    cut._attn_implementation = config._attn_implementation
    return cut


def make_template(model, layers: int = TEMPLATE_LAYERS) -> Template:
    """The template of ``model`` (module docstring); ``NotStitchable`` when it cannot be built or has nothing to
    save."""
    real_stacks = stacks_of(model)
    if not real_stacks or max(real_stacks.values()) <= layers:
        raise TooShallow(f"it has {max(real_stacks.values(), default=0)} layers or fewer per stack")
    config = template_config(model.config, layers)
    with torch.device("meta"):
        template = type(model)(config)
    stacks = stacks_of(template)
    if set(stacks) != set(real_stacks):
        raise NotStitchable(f"its template has the layer stacks {sorted(stacks)}, the model {sorted(real_stacks)}")
    for stack, count in stacks.items():
        if count != min(layers, real_stacks[stack]):
            raise NotStitchable(f"its template has {count} layers in {stack}, expected {min(layers, real_stacks[stack])}")
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    generator = torch.Generator().manual_seed(SEED)
    given = {}
    for prefix, module in template.named_modules(remove_duplicate=False):
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            name = f"{prefix}.{key}" if prefix else key
            if id(param) not in given:
                if name not in params or params[name].shape != param.shape:
                    raise NotStitchable(f"its template's parameter {name} is not the model's")
                if STACK.match(name):
                    value = torch.randn(param.shape, generator=generator).to(param.dtype)
                else:
                    value = params[name].detach()
                given[id(param)] = torch.nn.Parameter(value, requires_grad=False)
            module._parameters[key] = given[id(param)]
        for key, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            name = f"{prefix}.{key}" if prefix else key
            if name not in buffers or buffers[name].shape != buffer.shape:
                raise NotStitchable(f"its template's buffer {name} is not the model's")
            module._buffers[key] = buffers[name]
    for name, tensor in list(template.named_parameters()) + list(template.named_buffers()):
        if tensor.is_meta:
            raise NotStitchable(f"its template's {name} was not given a value")
    template.generation_config = model.generation_config
    return Template(template.eval(), {s: (stacks[s], real_stacks[s]) for s in stacks})
