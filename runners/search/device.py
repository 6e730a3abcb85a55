"""The vocabulary-wide part of a search step, on the device that holds the logits (issue 26).

Mechanism, and why
------------------
A search step has two parts of very different sizes.  The *vocabulary-wide* part reads every score of
every row: the float32 cast, the log-softmax, the processors, the beams' running scores added, and the
first top-k (HF's ``2·beams`` candidates per item over ``beams · vocab`` scores; the argmax of greedy
search).  The *bookkeeping* reads only the candidates: which hit EOS or the maximum length, the running
beams, the merge of finished hypotheses by length-penalized score, the early-stop heuristic, the token
sequences.  ``runners/search/search.py`` keeps one implementation of the bookkeeping, on the host in numpy
(O(rows · k) values a step), and asks a *scorer* for the vocabulary-wide part:

* the host path (no scorer): numpy on host logits, as before: the runtime needs no PyTorch;
* ``DeviceScorer`` (this module): PyTorch tensors on the backend's device (the CPU, or CUDA), computing
  with the very operators HF's ``_beam_search`` / ``_sample`` call (``log_softmax``, ``+``, ``topk``,
  ``argmax``, index assignment of -inf): on the device HF runs on, the same values and the same tie
  order, exact by construction rather than by emulation.  On CPU tensors (CI, tests, ``ELX_SEARCH=device``)
  it computes in place and takes the top-k with ``runners/search/topk.py`` on the tensor's memory (``torch.topk``'s
  CPU order, emulated and tested; several times faster than its CPU kernel on [items, beams · 32128]);
  ``DeviceScorer.hf_ops_on_cpu`` runs the CUDA branch on the CPU, which the tests do too.

Per step the host then receives the candidates (``[items, 2·beams]`` scores and flat indices, or one token
per row for greedy search) and sends the step's token ids, the rows' running scores and the beam reorder's
parent rows: O(rows) values up, O(rows · k) down; the logits and the cache stay on the device.  A search
written wholly against an array namespace would also move the O(rows · k · length) bookkeeping to the
device, where it is latency-bound small kernels and a host synchronisation per step anyway (EOS and
early stopping decide the loop), and would duplicate the exactness argument for the tie order of every
small top-k; keeping it on the host keeps one search and its tests.

Device values come from the backend (``Backend.as_tensor``: ORT IOBinding outputs read through DLPack,
no copy, on the CPU EP as on CUDA; TensorRT's values are torch tensors already).  Every crossing goes
through the backend seam (``Backend.tensor_to_host`` / ``tensor_from_host``), so a counting backend
(``tests/counting_backend.py``) sees what a GPU run moves.

Which processors run on the device: no-repeat n-gram (HF's ``NoRepeatNGramLogitsProcessor`` semantics on a
token history kept on the device: each step appends the tokens and follows the beam reorder), repetition
penalty (without a left-padded prompt), min length / min new tokens, forced BOS / EOS, suppress tokens
(always, at the beginning).  A run that needs anything
else (another processor, sampling, output_scores / output_logits, a graph that reads the token history,
``ELX_LOG_SOFTMAX=numpy``) runs the host path: ``device_scorer`` returns None and says why
(``host_reason``), never different tokens.

``ELX_SEARCH`` picks the path: ``auto`` (default: the device path for backends whose values live on a
device, ``ort-io`` and ``tensorrt``, when PyTorch imports), ``host`` (always the numpy path), ``device``
(the device path on every backend: on the host backend with torch tensors on the CPU; a comparison mode).
"""
from __future__ import annotations

import os

import numpy as np

from elx.runners.errors import ElxError
from elx.runners.search.log_softmax import _torch, kernel
from elx.runners.search.topk import topk
from elx.runners.search.processors.masks import BanUntilLength, ForceTokenAt, NoRepeatNGram, Suppress
from elx.runners.search.processors.penalties import RepetitionPenalty

ENV = "ELX_SEARCH"
MODES = ("auto", "host", "device")


def search_mode() -> str:
    mode = os.environ.get(ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        raise ElxError(f"{ENV}={mode!r} is not a search path: set it to one of {', '.join(MODES)}")
    return mode


class HostTensors:
    """The transfers of a model without a device backend (tests' HF-logits models, the ``ort`` backend):
    torch tensors on the CPU, sharing the host arrays."""

    torch_device = "cpu"

    def as_tensor(self, value):
        return _torch().from_numpy(value) if isinstance(value, np.ndarray) else value

    def tensor_to_host(self, tensor) -> np.ndarray:
        return tensor.numpy()

    def tensor_from_host(self, array: np.ndarray):
        return _torch().from_numpy(np.ascontiguousarray(array))


class TorchTensors(HostTensors):
    """The transfers of values held as torch tensors on ``device`` ("cuda", "cuda:1", "cpu"): a model that
    computes its logits in PyTorch, and the tests and tools that put the search's tensors on a GPU without a
    device backend (``tests/test_device_search.py``, ``tools/measure_search_host.py --device cuda``)."""

    device_tensors = True

    def __init__(self, device: str):
        self.torch_device = device

    def as_tensor(self, value):
        return super().as_tensor(value).to(self.torch_device)

    def tensor_to_host(self, tensor) -> np.ndarray:
        return tensor.cpu().numpy()

    def tensor_from_host(self, array: np.ndarray):
        return super().tensor_from_host(array).to(self.torch_device)


# -- processors on the device: HF's semantics, torch operators ------------------------------------------
class _NoRepeatNGram:
    """HF's ``NoRepeatNGramLogitsProcessor`` (``runners/search/ngram_reference.py`` states it): every window of the
    row's history whose first n-1 tokens equal the row's last n-1 tokens bans its last token.  Vectorized
    over rows and windows; the bans are a scatter of ``amin`` (min(x, -inf) = -inf, min(x, +inf) = x) so
    nothing waits for the device."""

    uses_history = True

    def __init__(self, n: int):
        self.n = n

    def __call__(self, torch, history, scores):
        n, length = self.n, history.shape[1]
        if length < n:
            return scores
        windows = history.unfold(1, n, 1)  # [rows, length - n + 1, n]
        last = windows[:, :, n - 1]
        match = (windows[:, :, : n - 1] == history[:, length - n + 1:].unsqueeze(1)).all(dim=2)
        vocab = scores.shape[1]
        match &= (last >= 0) & (last < vocab)  # ids outside the vocabulary are ignored (the reference's rule)
        src = torch.where(match, float("-inf"), float("inf")).to(scores.dtype)
        scores.scatter_reduce_(1, last.clamp(0, vocab - 1), src, reduce="amin")
        return scores


class _SetColumns:
    """Ban (-inf) ``ids`` while ``applies(length)``; with ``force``, everything else -inf and ``ids`` 0.

    The ids go to the device once, with the scorer; ids outside the vocabulary are ignored without a host
    round trip: a scatter of ``amin`` (bans) or ``amax`` (forced zeros) whose out-of-range entries are no-ops."""

    uses_history = False

    def __init__(self, ids, upload, applies, force: bool = False):
        self.ids, self.applies, self.force = upload(np.asarray(ids, dtype=np.int64).reshape(1, -1)), applies, force

    def __call__(self, torch, history, scores):
        if not self.applies(history.shape[1]):
            return scores
        rows, vocab = scores.shape
        valid = (self.ids >= 0) & (self.ids < vocab)
        index = self.ids.clamp(0, vocab - 1).expand(rows, -1)
        if self.force:
            scores.fill_(float("-inf"))
            src = torch.where(valid, 0.0, float("-inf")).to(scores.dtype).expand(rows, -1)
            return scores.scatter_reduce_(1, index, src, reduce="amax")
        src = torch.where(valid, float("-inf"), float("inf")).to(scores.dtype).expand(rows, -1)
        return scores.scatter_reduce_(1, index, src, reduce="amin")


class _RepetitionPenalty:
    """HF's ``RepetitionPenaltyLogitsProcessor`` without prompt padding, HF's operators in HF's order: ids
    clamped to a spare column, gather, ``where(score < 0, score * p, score / p)``, scatter, the column dropped."""

    uses_history = True

    def __init__(self, penalty: float):
        # the user's Python float, not its float32 rounding: PyTorch's CUDA division by a Python scalar
        # multiplies by float32(1 / penalty), the reciprocal taken in double; from the rounded penalty that is
        # 1 ulp off HF's (seen on an H200 with 1.05; the CPU divides by the float32 penalty either way)
        self.penalty = float(penalty)

    def __call__(self, torch, history, scores):
        vocab = scores.shape[1]
        ids = history.clamp(max=vocab)
        padded = torch.nn.functional.pad(scores, (0, 1))
        score = torch.gather(padded, 1, ids)
        score = torch.where(score < 0, score * self.penalty, score / self.penalty)
        return padded.scatter(1, ids, score)[..., :vocab]


def _portable(processor) -> bool:
    """Whether ``_on_device`` has a device version of this host processor."""
    if isinstance(processor, RepetitionPenalty):
        return processor.padding is None  # a left-padded prompt's positions are per item: the host path
    return isinstance(processor, (NoRepeatNGram, BanUntilLength, ForceTokenAt, Suppress))


def _on_device(processor, upload):
    """The device version of a host processor (``upload``: host int64 ids → device), or None where there is none."""
    if not _portable(processor):
        return None
    if isinstance(processor, NoRepeatNGram):
        return _NoRepeatNGram(processor.n)
    if isinstance(processor, RepetitionPenalty):
        return _RepetitionPenalty(processor.value)
    if isinstance(processor, BanUntilLength):
        return _SetColumns(processor.eos, upload, lambda length, m=processor.min_total_length: length < m)
    if isinstance(processor, ForceTokenAt):
        return _SetColumns(processor.tokens, upload, lambda length, at=processor.at_length: length == at, force=True)
    if isinstance(processor, Suppress):
        at = processor.at_length
        return _SetColumns(processor.ids, upload, (lambda length: True) if at is None else (lambda length: length == at))
    return None


# -- the scorer -----------------------------------------------------------------------------------------
class DeviceScorer:
    """The vocabulary-wide part of greedy and beam search steps on the device (see the module doc)."""

    hf_ops_on_cpu = False  # tests: run the CUDA branch (HF's operators as HF calls them) on CPU tensors

    def __init__(self, transfers, processors: list, returns_log_probs: bool, prompt: np.ndarray, per_row: int,
                 reads_device_values: bool = False):
        self.torch = _torch()
        self.transfers = transfers
        self.returns_log_probs = returns_log_probs
        self.processors = processors
        # the transfers are the model's own backend, whose step may leave its scores on the device: the search
        # asks it to (``Model.step(..., device=True)``) and the scorer reads them there, with no round trip
        self.reads_device_values = reads_device_values
        self.history = None
        if any(p.uses_history for p in processors):  # the prompt of each row, once, before the first step
            self.history = transfers.tensor_from_host(np.repeat(np.asarray(prompt, dtype=np.int64), per_row, axis=0))

    def _processed(self, scores, length: int):
        history = self.history
        if history is None:  # the processors read only the length
            history = _Length(length)
        for processor in self.processors:
            scores = processor(self.torch, history, scores)
        return scores

    def greedy_tokens(self, logits, length: int) -> np.ndarray:
        """HF's ``_sample`` without sampling: argmax of the processed float32 logits, per row (int64, host)."""
        scores = self._processed(self._float32(logits), length)
        return self.transfers.tensor_to_host(scores.argmax(dim=-1))

    def beam_candidates(self, logits, length: int, running_scores: np.ndarray, keep: int):
        """HF's ``_beam_search`` candidates: log-softmax, processors, + running scores [n, k], top ``keep`` of
        each item's k · vocab scores.  Returns host (scores [n, keep] float32, flat indices [n, keep] int64)
        and the vocabulary size.

        On CUDA: HF's operators as HF calls them.  On the CPU (tests, CI, a CPU-only run with ``ELX_SEARCH``):
        the log-softmax and the sum in place (PyTorch's CPU kernel either way: the same values bit for bit,
        without fresh [rows, vocab] buffers), and the top-k of ``elx.runners.search.topk`` on the tensor's memory:
        ``torch.topk``'s CPU order, ties included (``tests/test_topk.py``), several times faster than its CPU
        kernel on [items, k · 32128] rows here."""
        torch = self.torch
        logits = self._float32(logits)
        on_cpu = logits.device.type == "cpu" and logits.is_contiguous() and not self.hf_ops_on_cpu
        if self.returns_log_probs:
            log_probs = logits
        elif on_cpu:
            log_probs = torch.log_softmax(logits, dim=-1, out=logits)
        else:
            log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        log_probs = self._processed(log_probs, length).contiguous()  # the repetition penalty returns a slice
        n, k = running_scores.shape
        vocab = log_probs.shape[1]
        running = self.transfers.tensor_from_host(np.ascontiguousarray(running_scores, dtype=np.float32))
        if on_cpu:
            scores = log_probs.view(n, k, vocab).add_(running[:, :, None]).view(n, k * vocab)
            values, indices = (torch.from_numpy(a) for a in topk(scores.numpy(), keep))
        else:
            scores = (log_probs.view(n, k, vocab) + running[:, :, None]).view(n, k * vocab)
            values, indices = torch.topk(scores, keep)
        return self.transfers.tensor_to_host(values), self.transfers.tensor_to_host(indices), vocab

    def advance(self, rows: np.ndarray | None, tokens: np.ndarray) -> None:
        """The step's tokens [rows] appended to the device history, after keeping/reordering its rows
        (``rows[r]``: the old row of new row r; None: unchanged)."""
        if self.history is None:
            return
        history = self.history
        if rows is not None:
            history = history.index_select(0, self.transfers.tensor_from_host(np.asarray(rows, dtype=np.int64)))
        new = self.transfers.tensor_from_host(np.asarray(tokens, dtype=np.int64).reshape(-1, 1))
        self.history = self.torch.cat([history, new], dim=1)

    def _float32(self, logits):
        tensor = self.transfers.as_tensor(logits)
        return tensor if tensor.dtype == self.torch.float32 else tensor.float()  # HF: .to(torch.float32)


class _Length:
    """Stands in for the history where no processor reads the tokens: only ``shape[1]`` is asked for."""

    def __init__(self, length: int):
        self.shape = (None, length)


def host_reason(model, processors: list, hooks, mode: str) -> str | None:
    """Why this run takes the host path (None: it can take the device path)."""
    if mode == "host":
        return f"{ENV}=host"
    if _torch() is None:
        return "PyTorch cannot be imported"
    if kernel() == "numpy":
        return "ELX_LOG_SOFTMAX=numpy asks for the host kernels"
    backend = getattr(model, "backend", None)
    if mode == "auto" and not getattr(backend, "device_tensors", False):
        return "the backend keeps its values in host arrays"
    if getattr(model, "needs_history", False):
        return "the step graph reads the token history (ngram pass)"
    if hooks.sampler is not None:
        return "sampling (do_sample)"
    if hooks.record_scores or hooks.record_logits:
        return "output_scores / output_logits return every step's scores"
    if hooks.repeats != 1:
        return "sampled return sequences"
    for p in processors:
        if not _portable(p):
            return f"{getattr(p, 'hf', type(p).__name__)} has no device version"
    return None


def device_scorer(model, processors: list, hooks, prompt: np.ndarray, per_row: int) -> DeviceScorer | None:
    """The run's scorer, or None for the host path (``host_reason`` says why)."""
    mode = search_mode()
    if host_reason(model, processors, hooks, mode) is not None:
        return None
    backend = getattr(model, "backend", None)
    own = bool(getattr(backend, "device_tensors", False))
    transfers = backend if own else HostTensors()
    return DeviceScorer(transfers, [_on_device(p, transfers.tensor_from_host) for p in processors], bool(model.returns_log_probs),
                        prompt, per_row, reads_device_values=own)


def for_search_path(model, processors: list, hooks):
    """``model`` for this run's search path: on the device path a decoder-only prompt's first scores stay on
    the device (``Model.on_device``); models without that choice (the tests' HF-logits models) as they are."""
    if not hasattr(model, "on_device"):
        return model
    return model.on_device(host_reason(model, processors, hooks, search_mode()) is None)
