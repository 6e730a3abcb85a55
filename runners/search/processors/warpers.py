"""HF's sampling warpers (``do_sample=True``), in HF's order: temperature, top-h, top-k, top-p, min-p, typical,
epsilon, eta.

Temperature and top-k need no floating-point kernel (a float32 division; a comparison with the k-th largest
value), so numpy gives HF's values.  The others rank tokens by softmax probabilities, cumulative sums,
sorts and entropies, whose float32 rounding (PyTorch accumulates ``cumsum`` in double on the CPU, sums in
its own lane order) and tie order decide which tokens survive at the edge.  Where PyTorch is the host
kernel (``elx.runners.search.log_softmax.torch_module``), each runs HF's computation with PyTorch's own operators on
the search's array (no copy), bit for bit HF's result; without PyTorch, the same definition in numpy (the
same tokens survive except at rounding-level ties).

``min_keep`` is HF's ``min_tokens_to_keep``: 1 for sampling, ``len(eos) + 1`` for beam sampling.
"""
from __future__ import annotations

import numpy as np

from elx.runners.search.log_softmax import numpy_softmax, torch_module
from elx.runners.search.topk import topk

NEG_INF = np.float32(-np.inf)


class Temperature:
    hf = "TemperatureLogitsWarper"

    def __init__(self, temperature: float):
        self.temperature = np.float32(temperature)

    def __call__(self, tokens, scores, items=None):
        with np.errstate(over="ignore"):  # HF's float32 division overflows to inf the same way, silently
            scores /= self.temperature
        return scores


class TopK:
    hf = "TopKLogitsWarper"

    def __init__(self, top_k: int, min_keep: int):
        self.k, self.min_keep = max(top_k, min_keep), min_keep

    def __call__(self, tokens, scores, items=None):
        k = min(self.k, scores.shape[1])
        kth = np.partition(scores, scores.shape[1] - k, axis=1)[:, scores.shape[1] - k, None]
        scores[scores < kth] = NEG_INF
        return scores


class _Warper:
    """A warper with HF's computation in PyTorch (``_torch``: tensor in, removal mask out) and in numpy."""

    def __call__(self, tokens, scores, items=None):
        torch = torch_module()
        if torch is not None:
            remove = self._torch(torch, torch.from_numpy(scores)).numpy()
        else:
            remove = self._numpy(scores)
        scores[remove] = NEG_INF
        return scores


def _unsorted(remove_sorted: np.ndarray, order: np.ndarray) -> np.ndarray:
    """A mask over sorted positions back at the tokens' own positions (HF's ``scatter(1, order, mask)``)."""
    remove = np.empty_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=1)
    return remove


class TopP(_Warper):
    hf = "TopPLogitsWarper"

    def __init__(self, top_p: float, min_keep: int):
        self.top_p, self.min_keep = float(top_p), min_keep

    def _torch(self, torch, x):
        ordered, order = torch.sort(x, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - self.top_p
        remove[..., -self.min_keep:] = 0
        return remove.scatter(1, order, remove)

    def _numpy(self, x):
        order = np.argsort(x, axis=1, kind="stable")
        cumulative = np.cumsum(numpy_softmax(np.take_along_axis(x, order, axis=1)), axis=1)
        remove_sorted = cumulative <= np.float32(1 - self.top_p)
        remove_sorted[:, -self.min_keep:] = False
        return _unsorted(remove_sorted, order)


class MinP(_Warper):
    hf = "MinPLogitsWarper"

    def __init__(self, min_p: float, min_keep: int):
        self.min_p, self.min_keep = min_p, min_keep

    def _torch(self, torch, x):
        probs = torch.softmax(x, dim=-1)
        remove = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
        keep = torch.topk(probs, min(self.min_keep, probs.shape[-1]), dim=-1).indices
        return remove.scatter_(-1, keep, False)

    def _numpy(self, x):
        probs = numpy_softmax(x)
        remove = probs < np.float32(self.min_p) * probs.max(axis=1, keepdims=True)
        keep = topk(probs, min(self.min_keep, probs.shape[1]))[1]
        np.put_along_axis(remove, keep, False, axis=1)
        return remove


class Typical(_Warper):
    hf = "TypicalLogitsWarper"

    def __init__(self, mass: float, min_keep: int):
        self.mass, self.min_keep = float(mass), min_keep

    def _torch(self, torch, x):
        normalized = torch.nn.functional.log_softmax(x, dim=-1)
        p = torch.exp(normalized)
        entropy = -(normalized * p).nansum(-1, keepdim=True)
        shifted = torch.abs(-normalized - entropy)
        ordered, order = torch.sort(shifted, descending=False)
        cumulative = x.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (cumulative < self.mass).sum(dim=1)
        last.clamp_(max=ordered.shape[-1] - 1)
        remove = ordered > ordered.gather(1, last.view(-1, 1))
        remove[..., : self.min_keep] = 0
        return remove.scatter(1, order, remove)

    def _numpy(self, x):
        shifted_max = x - x.max(axis=1, keepdims=True)
        normalized = shifted_max - np.log(np.exp(shifted_max).sum(axis=1, keepdims=True))
        p = np.exp(normalized)
        entropy = -np.nansum(normalized * p, axis=1, keepdims=True)
        shifted = np.abs(-normalized - entropy)
        order = np.argsort(shifted, axis=1, kind="stable")
        ordered = np.take_along_axis(shifted, order, axis=1)
        cumulative = np.cumsum(numpy_softmax(np.take_along_axis(x, order, axis=1)), axis=1)
        last = np.minimum((cumulative < np.float32(self.mass)).sum(axis=1), ordered.shape[1] - 1)
        remove_sorted = ordered > np.take_along_axis(ordered, last[:, None], axis=1)
        remove_sorted[:, : self.min_keep] = False
        return _unsorted(remove_sorted, order)


def _kth_largest(x: np.ndarray, k: int) -> np.ndarray:
    k = min(k, x.shape[1])
    return np.partition(x, x.shape[1] - k, axis=1)[:, x.shape[1] - k, None]


class Epsilon(_Warper):
    hf = "EpsilonLogitsWarper"

    def __init__(self, epsilon: float, min_keep: int):
        self.epsilon, self.min_keep = float(epsilon), min_keep

    def _torch(self, torch, x):
        below = x.softmax(dim=-1) < self.epsilon
        k = min(self.min_keep, x.size(-1))
        return below & (x < torch.topk(x, k)[0][..., -1, None])

    def _numpy(self, x):
        return (numpy_softmax(x) < np.float32(self.epsilon)) & (x < _kth_largest(x, self.min_keep))


class Eta(_Warper):
    hf = "EtaLogitsWarper"

    def __init__(self, epsilon: float, min_keep: int):
        self.epsilon, self.min_keep = float(epsilon), min_keep

    def _torch(self, torch, x):
        epsilon = torch.tensor(self.epsilon)
        probs = x.softmax(dim=-1)
        entropy = torch.distributions.Categorical(logits=x).entropy()
        eta = torch.min(epsilon, torch.sqrt(epsilon) * torch.exp(-entropy))[..., None]
        k = min(self.min_keep, x.size(-1))
        return (probs < eta) & (x < torch.topk(x, k)[0][..., -1, None])

    def _numpy(self, x):
        probs = numpy_softmax(x)
        logits = x - x.max(axis=1, keepdims=True)
        logits = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        entropy = -(np.maximum(logits, np.finfo(np.float32).min) * probs).sum(axis=1)
        epsilon = np.float32(self.epsilon)
        eta = np.minimum(epsilon, np.sqrt(epsilon) * np.exp(-entropy))[:, None]
        return (probs < eta) & (x < _kth_largest(x, self.min_keep))


class TopH(_Warper):
    """HF's ``TopHLogitsWarper``: among the 100 best tokens, the shortest prefix whose cumulative entropy stays
    within ``top_h`` times the entropy of those 100 (at least the best token)."""

    hf = "TopHLogitsWarper"
    top_n = 100

    def __init__(self, top_h: float):
        self.top_h = float(top_h)

    def _torch(self, torch, x):
        top_logits, top_idx = torch.topk(x, min(self.top_n, x.shape[1]), dim=-1, largest=True, sorted=True)
        dist = torch.distributions.Categorical(logits=top_logits)
        probs = dist.probs
        tau = (dist.entropy() * self.top_h).unsqueeze(-1)
        selection = torch.cumsum(-probs * torch.log(probs), dim=-1) <= tau
        selection[:, 0] = True
        keep = torch.zeros(x.shape, dtype=torch.bool)
        keep.scatter_(dim=1, index=top_idx, src=selection)
        return ~keep

    def _numpy(self, x):
        top_logits, top_idx = topk(x, min(self.top_n, x.shape[1]))
        probs = numpy_softmax(top_logits)
        logits = top_logits - top_logits.max(axis=1, keepdims=True)
        logits = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        entropy = -(np.maximum(logits, np.finfo(np.float32).min) * probs).sum(axis=1, keepdims=True)
        selection = np.cumsum(-probs * np.log(probs), axis=1) <= entropy * np.float32(self.top_h)
        selection[:, 0] = True
        keep = np.zeros(x.shape, dtype=bool)
        np.put_along_axis(keep, top_idx, selection, axis=1)
        return ~keep


def build_warpers(s, eos_count: int) -> list:
    """HF's warpers for settings ``s`` (``GenerationMixin._get_logits_processor`` under ``do_sample``)."""
    min_keep = (eos_count + 1 if eos_count else 2) if s.num_beams > 1 else 1
    out = []
    if s.temperature != 1.0:
        out.append(Temperature(s.temperature))
    if s.top_h is not None:
        out.append(TopH(s.top_h))
    if s.top_k != 0:
        out.append(TopK(s.top_k, min_keep))
    if s.top_p < 1.0:
        out.append(TopP(s.top_p, min_keep))
    if s.min_p is not None:
        out.append(MinP(s.min_p, min_keep))
    if s.typical_p < 1.0:
        out.append(Typical(s.typical_p, min_keep))
    if 0.0 < s.epsilon_cutoff < 1.0:
        out.append(Epsilon(s.epsilon_cutoff, min_keep))
    if 0.0 < s.eta_cutoff < 1.0:
        out.append(Eta(s.eta_cutoff, min_keep))
    return out
