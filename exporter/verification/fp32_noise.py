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
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np

NOISE_MULTIPLE = 4.0
NOISE_RULE = ("per verification case: max abs logits diff <= max(magnitude rule, 4 * e), e = max |PyTorch fp32 "
              "logits - PyTorch fp64 logits| on that case")


@contextlib.contextmanager
def in_float64(model):
    """``model`` in float64 inside the block, and back to float32 after it (float32 → float64 → float32 is exact:
    no weight changes).  In place, not a copy, and its layers one at a time: everything outside the layer stacks
    (embeddings, head, norms, buffers) is converted for the block; each layer of a stack (``exporter/capture/
    template.py``: ``stacks_of``) has its float32 tensors copied into float64 buffers just before its forward and
    pointed back at them after it.  The buffers are shared by the layers (same names, same shapes: allocated
    once), so the float64 weights alive at once are the non-layer ones and one layer's, not the model's (a whole
    1.1B model in float64 is 8.8 GB), and nothing is allocated per layer and per forward (converting each layer
    with ``Module.to`` there and back made TinyLlama-1.1B's fp64 reference 3.4x slower, most of it page faults).

    Yields a ``Lockstep``: its ``run(jobs)`` runs several forwards so that each layer is converted once for all of
    them instead of once per forward."""
    import torch

    layers = _layer_modules(model)
    inside = {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    swap = _LayerSwap(torch.float64)
    lockstep = Lockstep(swap)
    hooks = []
    try:
        with torch.no_grad():
            _convert_outside(model, inside, torch.float64)
        for layer in layers:
            hooks.append(layer.register_forward_pre_hook(lockstep.enter))
            hooks.append(layer.register_forward_hook(lockstep.leave))
        yield lockstep
    finally:
        for hook in hooks:
            hook.remove()
        swap.restore()
        with torch.no_grad():  # in place, on the same tensor objects: ``model.to`` would give each buffer a new one,
            _convert_outside(model, set(), torch.float32)  # and a template sharing it would keep the float64 one


class Lockstep:
    """Several forwards of a model ``in_float64`` with each layer converted once for all of them.

    Converting a layer's float32 tensors to float64 costs as much as running a few tokens through it: TinyLlama-1.1B's
    reference, 5 cases of two forwards each, spent 5.0 of its 11.8 s in those copies (22 layers x 10 forwards).
    ``run(jobs)`` runs each job (a callable making forwards) in a thread of its own, one thread at a time: a thread
    reaching a layer waits there, and the layer a waiting thread needs is converted only when no thread waits for
    the one converted now.  Jobs making the same forwards in the same order (the verification's cases: the prompt,
    then one token) go through the stack together: 2 x 22 conversions instead of 10 x 22.  Each job computes
    exactly what it would alone (the same operations in the same order, on as many PyTorch threads as the caller's);
    only when each layer is converted changes.  A forward made outside ``run`` converts each layer on entry."""

    def __init__(self, swap):
        import threading

        self.swap = swap
        self.condition = threading.Condition()
        self.workers = set()  # the threads of the ``run`` under way
        self.current = None  # the layer in float64 now (during a ``run``)
        self.running = None  # the worker allowed to run
        self.waiting = {}  # worker -> the layer it waits at (None: waiting to start)
        self.cancelled = False
        self.threads = None  # how many PyTorch threads a resuming job takes (``run``)

    # -- layer hooks -------------------------------------------------------------------------------------------
    def enter(self, module, args) -> None:
        import threading

        me = threading.get_ident()
        if me not in self.workers:
            self.swap.enter(module, args)
            return
        with self.condition:
            self.waiting[me], self.running = module, None
            self.condition.notify_all()
            self._wait_turn(me)
        import torch

        torch.set_num_threads(self.threads())

    def leave(self, module, args, output) -> None:
        import threading

        if threading.get_ident() not in self.workers:
            self.swap.leave(module, args, output)

    def _wait_turn(self, me) -> None:
        self.condition.wait_for(lambda: self.running == me or self.cancelled)
        if self.cancelled:
            raise RuntimeError("the float64 reference was stopped")

    # -- the scheduler -----------------------------------------------------------------------------------------
    def run(self, jobs: list, threads=None) -> list:
        """Each job's result; the first job's exception is raised once every job has ended.  ``threads()``, if given,
        says how many threads PyTorch takes each time a job resumes (default: as many as the caller's: the count is
        per thread)."""
        import threading

        import torch

        here = torch.get_num_threads()
        self.threads = threads or (lambda: here)
        results, errors, done = [None] * len(jobs), [None] * len(jobs), set()

        def body(i, job):
            me = threading.get_ident()
            try:
                with self.condition:
                    self._wait_turn(me)
                torch.set_num_threads(self.threads())
                results[i] = job()
            except BaseException as err:  # noqa: BLE001 - raised by ``run`` once every job has ended
                errors[i] = err
            finally:
                with self.condition:
                    done.add(me)
                    self.running = None
                    self.condition.notify_all()

        workers = [threading.Thread(target=body, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
        try:
            with self.condition:
                for worker in workers:
                    worker.start()
                    self.workers.add(worker.ident)
                    self.waiting[worker.ident] = None
                while True:
                    self.condition.wait_for(lambda: self.running is None)
                    if len(done) == len(workers):
                        break
                    self.running = self._next()
                    self.condition.notify_all()
        finally:
            with self.condition:
                self.cancelled = len(done) < len(workers)  # the scheduler itself failed: the workers stop
                self.condition.notify_all()
            for worker in workers:
                worker.join()
            self.workers, self.waiting, self.current, self.cancelled = set(), {}, None, False
            self.swap.restore()
        for err in errors:
            if err is not None:
                raise err
        return results

    def _next(self):
        """The worker to run next (the condition held): one starting or waiting at the layer in float64, else the
        layer most workers wait at is converted (of equals, the one the longest-waiting worker needs)."""
        for worker, layer in self.waiting.items():
            if layer is None or layer is self.current:
                del self.waiting[worker]
                return worker
        counts = {}
        for layer in self.waiting.values():
            counts[id(layer)] = counts.get(id(layer), 0) + 1
        layer = max(self.waiting.values(), key=lambda each: counts[id(each)])
        self.swap.enter(layer, ())
        self.current = layer
        return self._next()


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
        inputs = {k: (v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v) for k, v in case.inputs.items()}
        past = {k: v.astype(np.float64) for k, v in past.items()}
        scores, encoder = self.side.run(replace(case, inputs=inputs), past)
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
