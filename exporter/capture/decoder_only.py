"""Decoder-only models (GPT-2, OPT, the RoPE families): the prefill and step graphs, and their part of the manifest.

The prompt runs once per input (batch B) through the **prefill** graph; each generated token then
runs through the **step** graph at rows = B·beams.  Names follow Optimum's decoder exports
(``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.{i}.key|value`` →
``logits``, ``present.{i}.key|value``); ``logits`` is the last position's, [rows, vocab].
Position ids are inputs, fed as HF ``generate`` derives them from the attention mask
(``runners/inputs/prompt.py``).

* ``prefill``: ``input_ids``, ``attention_mask``, ``position_ids`` [B, P] → ``logits`` [B, vocab]
  (the first step's scores), ``present.{i}.key|value`` [B, h, P, d_k] (the prompt's keys/values;
  h is the key/value head count, fewer than the query heads with GQA/MQA; with RoPE the keys
  are rotated, as HF caches them).

Two forms of the step graph, chosen at export (``prompt_cache``):

* ``shared`` (default; FastSeq §4.1 applied to the prompt): the prompt's keys/values stay at batch
  B as per-input state (``prompt_key_values.{i}.key|value``, with ``prompt_attention_mask``
  [B, P]), read by every beam of the item; the cache holds only the generated tokens'
  keys/values [rows, h, G, d_k], starting empty.  Self-attention is one softmax over
  [shared prompt part ; per-beam generated part] (``exporter/capture/shared_prompt.py``).
* ``per-beam`` (what HF and Optimum do): the cache holds prompt and generated keys/values per row
  [rows, h, P + G, d_k], filled from the prefill's outputs (one copy per beam) at the first step;
  the step takes ``attention_mask`` [rows, P + G + 1].  Kept for verification (the shared form
  is checked against it) and for measuring what sharing saves.

The step graph feeds one token per row (a search never feeds more after the prompt).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.export import Dim
from transformers.cache_utils import DynamicCache

from elx.runners.errors import ElxError

from elx.exporter.families.catalog import Family
from elx.exporter.capture.onnx_export import GraphSpec, export_graph
from elx.exporter.progress import WEIGHTS
from elx.exporter.capture.shared_prompt import PROMPT_KWARG, SharedPrompt
from elx.exporter.capture.wrappers import _Graph

PROMPT_CACHE_FORMS = ("shared", "per-beam")
EXAMPLE = dict(batch=2, beams=3, prompt=7, past=3)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    """A boolean "may attend" mask → HF's additive mask: 0 where allowed, the float minimum elsewhere."""
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _presents(cache) -> list:
    out = []
    for layer in cache.layers:
        out += [layer.keys, layer.values]
    return out


class _DecoderOnlyGraph(_Graph):
    def __init__(self, model, family: Family):
        super().__init__(model, family)
        self.model = model
        self.layers = family.dims(model.config)["num_decoder_layers"]


class PrefillGraph(_DecoderOnlyGraph):
    """The prompt [B, P] → last-position logits [B, vocab] and the prompt's keys/values [B, h, P, d_k]."""

    def forward(self, input_ids, attention_mask, position_ids):
        width = input_ids.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        allowed = causal[None, None, :, :] & attention_mask.bool()[:, None, None, :]
        out = self.model(input_ids=input_ids, attention_mask=_additive(allowed), position_ids=position_ids,
                         past_key_values=DynamicCache(), use_cache=True)
        return (out.logits[:, -1, :], *_presents(out.past_key_values))


class PerBeamStepGraph(_DecoderOnlyGraph):
    """One token per row over the per-row cache [rows, h, P + G, d_k] (prompt and generated parts)."""

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(self.layers)])
        allowed = attention_mask.bool()[:, None, None, :]  # one query: every earlier key, padding excluded
        out = self.model(input_ids=input_ids, attention_mask=_additive(allowed), position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        return (out.logits[:, -1, :], *_presents(out.past_key_values))


class SharedPromptStepGraph(_DecoderOnlyGraph):
    """One token per row: the prompt's keys/values at batch B (shared by the beams), generated ones per row."""

    def forward(self, input_ids, position_ids, prompt_attention_mask, *flat):
        n = self.layers
        prompt_kv, past = flat[: 2 * n], flat[2 * n:]
        prompt = SharedPrompt([prompt_kv[2 * i] for i in range(n)], [prompt_kv[2 * i + 1] for i in range(n)],
                              _additive(prompt_attention_mask.bool()[:, None, None, :]))
        cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(n)])
        rows, generated = input_ids.shape[0], past[0].shape[2]
        own = torch.zeros(rows, 1, 1, generated + 1)  # one query sees every generated key of its row
        out = self.model(input_ids=input_ids, attention_mask=own, position_ids=position_ids, past_key_values=cache,
                         use_cache=True, **{PROMPT_KWARG: prompt})
        return (out.logits[:, -1, :], *_presents(out.past_key_values))


def kv_heads(dims: dict) -> int:
    """The key/value heads of the cache (fewer than the query heads with GQA/MQA)."""
    return dims.get("num_kv_heads") or dims["num_heads"]


def kv_names(prefix: str, layers: int) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def _prompt_example(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 100, (batch, width))
    mask = torch.ones(batch, width, dtype=torch.int64)
    mask[1:, :2] = 0  # left padding
    positions = ((mask.cumsum(-1) - 1) * mask).to(torch.int64)
    return ids, mask, positions


def _prefill_spec(model, family: Family) -> GraphSpec:
    dims = family.dims(model.config)
    batch, width = Dim("batch"), Dim("prompt_sequence")
    args = _prompt_example(EXAMPLE["batch"], EXAMPLE["prompt"])
    presents = kv_names("present", dims["num_decoder_layers"])
    names = ["input_ids", "attention_mask", "position_ids"]
    axes = {0: batch, 1: width}
    return GraphSpec(PrefillGraph(model, family), list(args), {n: axes for n in names}, names, ["logits", *presents])


def export_prefill(model, family: Family, path: Path, capture=None) -> dict:
    dims = family.dims(model.config)
    presents = kv_names("present", dims["num_decoder_layers"])
    extra = export_graph(lambda m: _prefill_spec(m, family), model, path, capture)
    prompt_shape = ["batch", "prompt_sequence"]
    kv_shape = ["batch", kv_heads(dims), "prompt_sequence", dims["d_kv"]]
    return {
        "file": path.name, "external_data": extra,
        "inputs": {"input_ids": {"dtype": "int64", "shape": prompt_shape, "from": "input:input_ids"},
                   "attention_mask": {"dtype": "int64", "shape": prompt_shape, "from": "input:attention_mask"},
                   "position_ids": {"dtype": "int64", "shape": prompt_shape, "from": "prompt:position_ids"}},
        "outputs": {"logits": {"dtype": "float32", "shape": ["batch", dims["vocab_size"]]},
                    **{name: {"dtype": "float32", "shape": kv_shape} for name in presents}},
    }


def _step_spec(model, family: Family, form: str) -> tuple[GraphSpec, dict, list]:
    """The step graph's spec, its inputs' manifest entries and its cache entries."""
    dims = family.dims(model.config)
    layers, heads, d_kv = dims["num_decoder_layers"], kv_heads(dims), dims["d_kv"]
    b, beams, width, past = (EXAMPLE[k] for k in ("batch", "beams", "prompt", "past"))
    rows = b * beams
    row_dim, batch_dim, width_dim, past_dim = Dim("rows"), Dim("batch"), Dim("prompt_sequence"), Dim("past_sequence")
    past_shape = ["rows", heads, "past_sequence", d_kv]
    inputs = {"input_ids": {"dtype": "int64", "shape": ["rows", 1], "from": "step:input_ids"}}
    tokens, positions = torch.randint(3, 100, (rows, 1)), torch.randint(0, 50, (rows, 1))
    pasts = [torch.randn(rows, heads, past, d_kv) for _ in range(2 * layers)]
    past_names, present_names = kv_names("past_key_values", layers), kv_names("present", layers)
    if form == "per-beam":
        module = PerBeamStepGraph(model, family)
        mask = torch.ones(rows, past + 1, dtype=torch.int64)
        mask[3:, :2] = 0
        args = [tokens, mask, positions, *pasts]
        dynamic = {"input_ids": {0: row_dim}, "attention_mask": {0: row_dim, 1: past_dim + 1},
                   "position_ids": {0: row_dim}, "past": tuple({0: row_dim, 2: past_dim} for _ in pasts)}
        names = ["input_ids", "attention_mask", "position_ids", *past_names]
        inputs["attention_mask"] = {"dtype": "int64", "shape": ["rows", "past_sequence + 1"],
                                    "from": "step:attention_mask"}
        inputs["position_ids"] = {"dtype": "int64", "shape": ["rows", 1], "from": "step:position_ids"}
    elif form == "shared":
        module = SharedPromptStepGraph(model, family)
        mask = torch.ones(b, width, dtype=torch.int64)
        mask[1:, :2] = 0
        prompt_kv = [torch.randn(b, heads, width, d_kv) for _ in range(2 * layers)]
        args = [tokens, positions, mask, *prompt_kv, *pasts]
        dynamic = {"input_ids": {0: row_dim}, "position_ids": {0: row_dim},
                   "prompt_attention_mask": {0: batch_dim, 1: width_dim},
                   "flat": tuple([{0: batch_dim, 2: width_dim}] * len(prompt_kv) + [{0: row_dim, 2: past_dim}] * len(pasts))}
        prompt_names = kv_names("prompt_key_values", layers)
        names = ["input_ids", "position_ids", "prompt_attention_mask", *prompt_names, *past_names]
        inputs["position_ids"] = {"dtype": "int64", "shape": ["rows", 1], "from": "step:position_ids"}
        inputs["prompt_attention_mask"] = {"dtype": "int64", "shape": ["batch", "prompt_sequence"],
                                           "from": "input:attention_mask"}
        for name, present in zip(prompt_names, present_names):
            inputs[name] = {"dtype": "float32", "shape": ["batch", heads, "prompt_sequence", d_kv],
                            "from": f"prefill:{present}"}
    else:
        raise ElxError(f"unknown prompt cache form {form!r}; use one of {', '.join(PROMPT_CACHE_FORMS)}")
    cache = []
    for name, present in zip(past_names, present_names):
        inputs[name] = {"dtype": "float32", "shape": past_shape, "from": f"cache:{present}"}
        entry = {"input": name, "output": present, "dtype": "float32", "shape": past_shape, "seq_axis": 2}
        if form == "per-beam":
            entry["init"] = f"prefill:{present}"  # the prompt's keys/values, one copy per beam
        cache.append(entry)
    return GraphSpec(module, args, dynamic, names, ["logits", *present_names]), inputs, cache


def describe_step(model, family: Family, path: Path, form: str) -> tuple[dict, list[dict]]:
    """The step graph's manifest entry (its data files still unknown) and its cache entries, before it is traced."""
    dims = family.dims(model.config)
    layers, heads, d_kv = dims["num_decoder_layers"], kv_heads(dims), dims["d_kv"]
    _, inputs, cache = _step_spec(model, family, form)
    present_names = kv_names("present", layers)
    graph = {
        "file": path.name, "external_data": [], "inputs": inputs, "logits": "logits",
        "outputs": {"logits": {"dtype": "float32", "shape": ["rows", dims["vocab_size"]]},
                    **{p: {"dtype": "float32", "shape": ["rows", heads, "past_sequence + 1", d_kv]}
                       for p in present_names}},
    }
    return graph, cache


def export_step(model, family: Family, path: Path, form: str, capture=None) -> tuple[dict, list[dict]]:
    graph, cache = describe_step(model, family, path, form)
    graph["external_data"] = export_graph(lambda m: _step_spec(m, family, form)[0], model, path, capture)
    return graph, cache


def export_decoder_only(model, family: Family, folder: Path, manifest: dict, form: str, progress,
                        capture=None) -> None:
    """Write prefill.onnx and decoder.onnx into ``folder`` and describe them in ``manifest`` (one
    ``exporter/progress.py`` stage each); ``capture``: ``exporter/capture``'s (stitched from a template)."""
    if form not in PROMPT_CACHE_FORMS:
        raise ElxError(f"unknown prompt cache form {form!r}; use one of {', '.join(PROMPT_CACHE_FORMS)}")
    if capture is not None:  # the step graph's template traced by a second process while the prefill is exported
        capture.prefetch(lambda m: _step_spec(m, family, form)[0], folder / "decoder.onnx")
    with progress.stage("prefill.onnx", WEIGHTS["prefill"]):
        manifest["graphs"]["prefill"] = export_prefill(model, family, folder / "prefill.onnx", capture)
    # the manifest is complete but for the step graph's data files before that graph is traced: the verification's
    # PyTorch reference can run while a second process still traces the step's template (``Capture.while_waiting``)
    manifest["graphs"]["decoder"], manifest["cache"]["self"] = describe_step(model, family, folder / "decoder.onnx",
                                                                             form)
    manifest.update(stages=["prefill"], step="decoder", first_step_scores="prefill:logits", padding_side="left")
    manifest["cache"]["prompt"] = ({"kind": "beam-shared", "batch": "batch"} if form == "shared"
                                   else {"kind": "per-beam", "batch": "rows"})
    manifest["cache"].pop("cross", None)
    with progress.stage("decoder.onnx", WEIGHTS["decoder"]) as stage:
        manifest["graphs"]["decoder"], manifest["cache"]["self"] = export_step(model, family, folder / "decoder.onnx",
                                                                               form, capture)
        stage.detail = f"prompt cache {form}"
