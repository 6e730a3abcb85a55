"""Row-wise top-k with the tie order of HF's beam search (``torch.topk`` on the CPU).

HF's ``_beam_search`` picks candidates, running beams and finished hypotheses with
``torch.topk``.  Scores are often exactly equal: a saturated softmax gives log-probs of 0.0,
masked candidates all round to -1e9 in float32, blocked tokens are -inf.  Which of equal
candidates comes first then decides the tokens, and ``torch.topk`` does not break ties by
index.  Its CPU kernel (ATen ``TopKImpl.h``) fills a vector of (value, index) pairs and runs
libstdc++'s ``std::partial_sort`` over it when ``k·64 ≤ n``, else ``std::nth_element`` followed by
``std::sort`` of the first k-1 pairs, comparing values only (NaN counts as the largest).  The
order it leaves equal values in is a deterministic function of the input, which this module
reproduces step for step (heap select, heap sort, introselect, introsort, as GCC's
``stl_heap.h``/``stl_algo.h`` define them).  On CUDA, torch uses another algorithm and may order
ties differently; elx follows the CPU.

Fast path: when the k+1 best values of a row are pairwise distinct (and the row has no NaN),
every algorithm returns the same answer, so ONNX Runtime's TopK kernel (0.4 ms for 4 × 128k
floats, 2.2 ms for 32 × 128k on two cores; numpy's argpartition needs 6 ms for the former) or
numpy gives it.  Only rows with ties run the emulation, in Python over the candidates that can
enter the heap.
"""
from __future__ import annotations

import functools
import os

import numpy as np

_CHUNK = 8192  # heap-select scans the row in chunks; only values above the heap's top are visited


def _greater(x, y) -> bool:
    """The comparator of ``torch.topk(largest=True)``: NaN first, then larger values (ties: False)."""
    a, b = x[0], y[0]
    return (a != a and b == b) or a > b


# -- libstdc++ heap algorithms (stl_heap.h), on a list of (value, index) pairs ---------------
def _push_heap(a, first, hole, top, value):
    parent = (hole - 1) // 2
    while hole > top and _greater(a[first + parent], value):
        a[first + hole] = a[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    a[first + hole] = value


def _adjust_heap(a, first, hole, length, value):
    top = second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if _greater(a[first + second], a[first + second - 1]):
            second -= 1
        a[first + hole] = a[first + second]
        hole = second
    if length % 2 == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        a[first + hole] = a[first + second - 1]
        hole = second - 1
    _push_heap(a, first, hole, top, value)


def _make_heap(a, first, last):
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(a, first, parent, length, a[first + parent])
        if parent == 0:
            return
        parent -= 1


def _pop_heap(a, first, last, result):
    value = a[result]
    a[result] = a[first]
    _adjust_heap(a, first, 0, last - first, value)


def _heap_select(a, first, middle, last):
    _make_heap(a, first, middle)
    for i in range(middle, last):
        if _greater(a[i], a[first]):
            _pop_heap(a, first, middle, i)


def _sort_heap(a, first, last):
    while last - first > 1:
        last -= 1
        _pop_heap(a, first, last, last)


# -- libstdc++ sorting (stl_algo.h) ------------------------------------------------------------
def _unguarded_linear_insert(a, last):
    value = a[last]
    prev = last - 1
    while _greater(value, a[prev]):
        a[last] = a[prev]
        last, prev = prev, prev - 1
    a[last] = value


def _insertion_sort(a, first, last):
    for i in range(first + 1, last):
        if _greater(a[i], a[first]):
            value = a[i]
            a[first + 1: i + 1] = a[first:i]
            a[first] = value
        else:
            _unguarded_linear_insert(a, i)


def _move_median_to_first(a, result, x, y, z):
    if _greater(a[x], a[y]):
        if _greater(a[y], a[z]):
            pick = y
        elif _greater(a[x], a[z]):
            pick = z
        else:
            pick = x
    elif _greater(a[x], a[z]):
        pick = x
    elif _greater(a[y], a[z]):
        pick = z
    else:
        pick = y
    a[result], a[pick] = a[pick], a[result]


def _unguarded_partition(a, first, last, pivot):
    while True:
        while _greater(a[first], a[pivot]):
            first += 1
        last -= 1
        while _greater(a[pivot], a[last]):
            last -= 1
        if not first < last:
            return first
        a[first], a[last] = a[last], a[first]
        first += 1


def _partition_pivot(a, first, last):
    mid = first + (last - first) // 2
    _move_median_to_first(a, first, first + 1, mid, last - 1)
    return _unguarded_partition(a, first + 1, last, first)


def _lg(n: int) -> int:
    return n.bit_length() - 1


def _nth_element(a, first, nth, last):
    if first == last or nth == last:
        return
    depth = 2 * _lg(last - first)
    while last - first > 3:
        if depth == 0:
            _heap_select(a, first, nth + 1, last)
            a[first], a[nth] = a[nth], a[first]
            return
        depth -= 1
        cut = _partition_pivot(a, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(a, first, last)


def _introsort_loop(a, first, last, depth):
    while last - first > 16:
        if depth == 0:
            _heap_select(a, first, last, last)
            _sort_heap(a, first, last)
            return
        depth -= 1
        cut = _partition_pivot(a, first, last)
        _introsort_loop(a, cut, last, depth)
        last = cut


def _sort(a, first, last):
    if last - first < 2:
        return
    _introsort_loop(a, first, last, 2 * _lg(last - first))
    if last - first > 16:
        _insertion_sort(a, first, first + 16)
        for i in range(first + 16, last):
            _unguarded_linear_insert(a, i)
    else:
        _insertion_sort(a, first, last)


# -- torch.topk's CPU kernel ------------------------------------------------------------------
def _partial_sort_row(row: np.ndarray, k: int) -> list:
    """``std::partial_sort(q, q + k, q + n)``: heap select over the row, visiting only entrants."""
    heap = [(float(row[j]), j) for j in range(k)]
    _make_heap(heap, 0, k)
    for start in range(k, row.shape[0], _CHUNK):
        top = heap[0][0]
        if top != top:  # the heap's smallest is NaN: nothing can enter any more
            break
        chunk = row[start: start + _CHUNK]
        for j in np.flatnonzero((chunk > top) | np.isnan(chunk)):
            pair = (float(chunk[j]), start + int(j))
            if _greater(pair, heap[0]):
                heap[0] = pair  # _pop_heap(heap, 0, k, <slot of pair>): pair sifts down from the top
                _adjust_heap(heap, 0, 0, k, pair)
    _sort_heap(heap, 0, k)
    return heap


def topk_row_torch(row: np.ndarray, k: int) -> list:
    """The (value, index) pairs ``torch.topk(row, k)`` returns on the CPU, in its order."""
    n = row.shape[0]
    if k * 64 <= n:
        return _partial_sort_row(row, k)
    pairs = [(float(v), j) for j, v in enumerate(row.tolist())]
    _nth_element(pairs, 0, k - 1, n)
    _sort(pairs, 0, k - 1)
    return pairs[:k]


def _threads() -> int:
    """The TopK kernel's threads: ``$OMP_NUM_THREADS`` where set (as PyTorch's log-softmax in the same search
    reads it; Ray sets it to an actor's CPUs), else 0: ONNX Runtime's default, one per physical core."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 0


@functools.lru_cache(maxsize=1)
def _ort_topk():
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    node = helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=-1, largest=1, sorted=1)
    graph = helper.make_graph(
        [node], "topk",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", "n"]),
         helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("values", TensorProto.FLOAT, ["rows", "k"]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, ["rows", "k"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    options = ort.SessionOptions()
    options.intra_op_num_threads = _threads()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no busy-wait between steps
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _sorted_top(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Some correct top-k (values descending); the order among equal values is unspecified."""
    session = _ort_topk() if x.shape[1] > 256 else None
    if session is not None:
        return tuple(session.run(None, {"x": x, "k": np.array([k], dtype=np.int64)}))
    idx = np.argsort(-x, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(x, idx, axis=1), idx


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise ``torch.topk(x, k)`` of a 2-D float array as the CPU kernel returns it: (values, int64 indices)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, {n}]")
    values, indices = _sorted_top(x, min(k + 1, n))
    tied = (values[:, 1:] == values[:, :-1]).any(axis=1)
    if np.isnan(x.max()):  # NaN rows: the fast kernels do not order NaN as torch does
        tied |= np.isnan(x).any(axis=1)
    values, indices = np.array(values[:, :k]), np.array(indices[:, :k], dtype=np.int64)
    for r in np.flatnonzero(tied):
        pairs = topk_row_torch(x[r], k)
        values[r] = [v for v, _ in pairs]
        indices[r] = [j for _, j in pairs]
    return values, indices

