"""What float32 itself can do on this model: PyTorch fp32 against fp64 on the export's verification cases.

An fp32 tolerance is only meaningful next to the error fp32 arithmetic makes on the same model and the same
inputs.  A fixed bar (1e-4, or 64 ulps of the largest logit: ``exporter/verification/verify.py``'s magnitude rule) was set
on shallow random models; on a deep trained model the rounding errors of thirty layers add up, and some
inputs amplify them.  Measured on SmolLM2-135M-Instruct (30 layers, max |logit| 31), verification case
batch 2 × beams 3, prompt 9, 4 generated: PyTorch's own fp32 logits are 9.0e-4 from its fp64 logits (sdpa;
6.5e-4 eager), while the other cases stay at 4e-5 to 3e-4.  The magnitude rule's 1.2e-4 is below what
PyTorch itself achieves there, so it refused a correct export.

So the export measures it: the same HF model, converted in place to float64 (exact: every float32 is a
float64) and back, runs the same cases, and each case's fp32 error ``e = max |z_fp32 − z_fp64|`` sets that
case's bar::

    bar(case) = max(magnitude rule, NOISE_MULTIPLE · e(case))

elx's graphs and PyTorch's kernels are two float32 evaluations of the same network; each errs from the exact
(fp64) result by about ``e``, so they differ by up to about ``2·e`` when elx is exactly as accurate as PyTorch.
``NOISE_MULTIPLE = 4`` lets elx's graphs err up to about three times as much as PyTorch's own fp32 on any
case and no more; the bar is per case, so a case on which fp32 is accurate stays strict, and an error that
shows on every case (a wrong weight, a wrong RoPE table) is refused where fp32 is accurate.  Shallow models
whose fp32 error is small keep the magnitude rule unchanged.  The manifest records, per case, the three
errors (elx vs fp32, fp32 vs fp64, elx vs fp64) and the bar.

``e`` is the largest of several fp32 evaluations (``verify.fp32_spread``), not of the one the reference ran.  On an
amplifying case one evaluation is one draw of fp32's rounding: on SmolLM2-135M's batch 2 x beams 3 case, on an
Intel Xeon VM, PyTorch's fp32 erred 1.1e-4 batched with the other cases on two threads and 8.3e-5 to 3.7e-4 in the
seven other evaluations (sdpa or eager attention, batched or alone, one or two threads; the AMD VM: 9.0e-4), while
elx's graphs erred 5.9e-4: a bar from the first draw (4.4e-4) refused that correct export on every run.  The other
evaluations are PyTorch's attention kernels (sdpa and eager, where the model takes both) and, for decoder-only
models, the cases run alone as well as batched: the same function, other rounding orders.  They can only widen
bars, so an export runs them only where the graphs are outside a bar of the first draw, and judges those cases
again by the bars of all of them (``verify.LaterDraws``: the verdict is the one all draws give); an export whose
passes follow (their bar is the export's largest) runs all of them first.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np

NOISE_MULTIPLE = 4.0
# the other evaluations run where the first one's bar reaches 1/8 of the magnitude rule on some case: the draws
# measured differ by up to 4.5x on one case, so below that no draw can set a bar (tiny models: 0.005-0.05)
SPREAD_RELEVANT = 1 / 8
NOISE_RULE = ("per verification case: max abs logits diff <= max(magnitude rule, 4 * e), e = max |PyTorch fp32 "
              "logits - PyTorch fp64 logits| on that case, the largest over PyTorch's fp32 evaluations (attention sdpa "
              "and eager; decoder-only: the cases batched and alone; beyond the first only where the graphs are "
              "outside a bar of the first, or passes follow: 'draws')")


def other_attention(model) -> str | None:
    """The attention implementation, besides the one ``model`` runs, that computes the same function with another
    rounding ("eager" for "sdpa" and back), where the model takes it; else None."""
    current = getattr(model.config, "_attn_implementation", None)
    other = {"sdpa": "eager", "eager": "sdpa"}.get(current)
    if other is None or not hasattr(model, "set_attn_implementation"):
        return None
    try:
        with attention_as(model, other):
            pass
    except (ValueError, ImportError, NotImplementedError):  # transformers: this model does not take it
        return None
    return other


@contextlib.contextmanager
def attention_as(model, implementation: str | None):
    """``model`` with attention ``implementation`` inside the block (None: as it is), as it was after it."""
    current = getattr(model.config, "_attn_implementation", None)
    if implementation is None or implementation == current:
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(current)


@contextlib.contextmanager
def in_float64(model, threads=None):
    """``model`` in float64 inside the block, and back to float32 after it (float32 → float64 → float32 is exact:
    no weight changes).  In place, not a copy, and its layers one at a time: everything outside the layer stacks
    (embeddings, head, norms, buffers) is converted for the block; each layer of a stack (``exporter/capture/
    template.py``: ``stacks_of``) has its float32 tensors copied into float64 buffers just before its forward and
    pointed back at them after it.  The buffers are shared by the layers (same names, same shapes: allocated
    once), so the float64 weights alive at once are the non-layer ones and one layer's, not the model's (a whole
    1.1B model in float64 is 8.8 GB), and nothing is allocated per layer and per forward (converting each layer
    with ``Module.to`` there and back made TinyLlama-1.1B's fp64 reference 3.4x slower, most of it page faults).

    A forward converts every layer once, so the float64 reference makes as few forwards as it can: the
    decoder-only cases all in two (``verify.DecoderOnlyTorchSide.run_together``).  ``threads()``, if given, says
    how many threads PyTorch takes for each layer (``export.ReferenceThreads``: the cores another task leaves)."""
    import torch

    layers = _layer_modules(model)
    inside = {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    swap = _LayerSwap(torch.float64)
    hooks, tables = [], []
    try:
        tables = _tables_in_float32(model, inside)  # their modules compute in float64 from the float32 weights
        for module, forward in tables:
            module.forward = forward
        with torch.no_grad():
            _convert_outside(model, inside | {id(module.weight) for module, _ in tables}, torch.float64)
        for layer in layers:
            hooks.append(layer.register_forward_pre_hook(swap.enter))
            hooks.append(layer.register_forward_hook(swap.leave))
        with per_layer_threads(model, threads):
            yield
    finally:
        for hook in hooks:
            hook.remove()
        for module, _ in tables:
            del module.forward  # the class's again
        swap.restore()
        with torch.no_grad():  # in place, on the same tensor objects: ``model.to`` would give each buffer a new one,
            _convert_outside(model, set(), torch.float32)  # and a template sharing it would keep the float64 one


@contextlib.contextmanager
def per_layer_threads(model, threads=None):
    """PyTorch's thread count read from ``threads()`` before each layer of ``model``'s stacks runs, inside the block
    (a batched reference is one forward: the cores another task frees mid-way are taken at the next layer);
    nothing when ``threads`` is None."""
    import torch

    hooks = []
    if threads is not None:
        for layer in _layer_modules(model):
            hooks.append(layer.register_forward_pre_hook(lambda module, args: torch.set_num_threads(threads())))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


class _LayerSwap:
    """A layer's floating tensors pointed at shared buffers of ``dtype`` (filled from them) while it runs."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.buffers = {}  # name in the layer → tensor of ``dtype``
        self.saved = []  # (tensor, its own data) of the layer running now

    def enter(self, module, args) -> None:  # a pre-hook returning something would replace the layer's inputs
        import torch

        self.restore()
        with torch.no_grad():
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                if not tensor.is_floating_point() or tensor.dtype == self.dtype:
                    continue
                buffer = self.buffers.get(name)
                if buffer is None or buffer.shape != tensor.shape:
                    buffer = self.buffers[name] = torch.empty(tensor.shape, dtype=self.dtype)
                self.saved.append((tensor, tensor.data))
                tensor.data = buffer.copy_(tensor.data)

    def leave(self, module, args, output) -> None:
        self.restore()

    def restore(self) -> None:
        for tensor, data in self.saved:
            tensor.data = data
        self.saved = []


def _layer_modules(model) -> list:
    """The layers of every stack ``stacks_of`` finds (a stack with no layer modules by those names: none)."""
    from elx.exporter.capture.template import stacks_of

    found = []
    for stack in stacks_of(model):
        try:
            modules = model.get_submodule(stack)
        except AttributeError:
            continue
        found.extend(modules.children())
    return found


TABLE_VALUES = 1 << 20  # a weight outside the layers larger than this (4 MiB) stays float32 in the float64 block
HEAD_CHUNK_BYTES = 64 << 20  # the float64 rows of a head's weight made at once


def _tables_in_float32(model, inside: set) -> list:
    """[(module, its float64 forward)] for the large weights outside the layers (token embeddings, heads: NLLB's
    256206 x 1024 table is 45% of the model) that ``in_float64`` leaves in float32: an embedding gathers its float32
    rows and casts them (exact: every float32 is a float64), a head multiplies in float64 by its weight cast a block
    of rows at a time.  The same float64 numbers as the weight converted (the head's blocks: a float64 GEMM per
    block, its rounding 1e-16 of the logits), without the converted copy: converting NLLB's table to float64 and
    back (3 GB at once, beside the model) was the export's peak, past its memory bound.  A weight stays float32 only
    where every module holding it is a plain ``nn.Linear`` or an ``nn.Embedding`` (scaled by ``embed_scale``: BART's,
    mBART's, M2M100's), so that nothing else reads it in float64."""
    holders = {}
    for module in model.modules():
        for key, tensor in module._parameters.items():
            if (tensor is not None and id(tensor) not in inside and tensor.is_floating_point()
                    and tensor.numel() > TABLE_VALUES):
                holders.setdefault(id(tensor), []).append((module, key))
    chosen = []
    for found in holders.values():
        forwards = [_float64_forward(module) if key == "weight" else None for module, key in found]
        if all(forward is not None for forward in forwards):
            chosen.extend((module, forward) for (module, _), forward in zip(found, forwards))
    return chosen


def _float64_forward(module):
    """``module``'s forward in float64 over its float32 weight, or None where it is not a plain linear layer or
    embedding."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if type(module).forward is nn.Linear.forward and isinstance(module, nn.Linear):
        block = []  # one float64 buffer of HEAD_CHUNK_BYTES, reused by every block and forward (fresh ones: page faults)

        def linear(x):
            weight, bias = module.weight, module.bias
            rows = min(weight.shape[0], max(1, HEAD_CHUNK_BYTES // (8 * weight.shape[1])))
            if not block:
                block.append(torch.empty((rows, weight.shape[1]), dtype=torch.float64))
            parts = []
            for i in range(0, weight.shape[0], rows):
                cast = block[0][: min(rows, weight.shape[0] - i)].copy_(weight[i: i + rows])
                parts.append(F.linear(x, cast, None if bias is None else bias[i: i + rows]))
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return linear
    if not isinstance(module, nn.Embedding) or module.max_norm is not None:
        return None
    scaled = type(module).__name__.endswith("ScaledWordEmbedding") and hasattr(module, "embed_scale") \
        and type(module).__mro__[1] is nn.Embedding
    if type(module).forward is not nn.Embedding.forward and not scaled:
        return None

    def embedding(ids):
        rows = F.embedding(ids, module.weight, module.padding_idx).to(torch.float64)
        return rows * module.embed_scale if scaled else rows
    if scaled:  # a subclass's forward read as "the rows times embed_scale": held to it on a few rows first
        probe = torch.arange(min(4, module.num_embeddings))
        with torch.no_grad():
            expected, got = module(probe), embedding(probe)
        if expected.shape != got.shape or not torch.allclose(got.to(expected.dtype), expected, rtol=2e-7, atol=0):
            return None
    return embedding


def _convert_outside(model, inside: set, dtype) -> None:
    """Every floating parameter and buffer of ``model`` not in ``inside`` (ids) converted to ``dtype`` in place."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is None or id(tensor) in inside or not tensor.is_floating_point():
                    continue
                tensor.data = tensor.data.to(dtype)


class Float64Side:
    """A PyTorch side run in float64: the case's floating inputs (Whisper's features) and random past cast up."""

    def __init__(self, side):
        self.side = side

    def run(self, case, past: dict):
        return self._result(self.side.run(*self._cast(case, past)))

    def forget(self) -> None:
        """The side's ``forget`` (``verify.TorchSide``: its kept encoder outputs), where it has one."""
        forget = getattr(self.side, "forget", None)
        if forget is not None:
            forget()

    def run_together(self, items: list) -> list:
        """The side's ``run_together`` (decoder-only: every case in two forwards) on the cast cases."""
        return [self._result(found) for found in self.side.run_together([self._cast(*item) for item in items])]

    @staticmethod
    def _cast(case, past: dict):
        inputs = {k: (v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v) for k, v in case.inputs.items()}
        return replace(case, inputs=inputs), {k: v.astype(np.float64) for k, v in past.items()}

    @staticmethod
    def _result(found):
        scores, encoder = found
        return (np.asarray(scores, dtype=np.float64),
                None if encoder is None else np.asarray(encoder, dtype=np.float64))


def case_bars(noise_report: dict, magnitude_bar: float) -> list[float]:
    """Each case's bar from its fp32 error (``noise_report``: fp64 reference, fp32 candidate); a case whose fp32
    error is not finite (fp64 gave NaN or inf) keeps the magnitude rule."""
    bars = []
    for entry in noise_report["shapes"]:
        e = entry["max_abs_logits_diff"]
        bars.append(max(magnitude_bar, NOISE_MULTIPLE * e) if np.isfinite(e) else magnitude_bar)
    return bars
