"""What ONNX Runtime's fused CPU kernels would save at elx's shapes (issue 15: which rewrite is worth building).

    python tools/kernel_candidates.py [--batch 32] [--beams 4] [--input 256] [--past 16] [--d-model 512] \
        [--heads 8] [--vocab 32128] [--rounds 15]

Each candidate is a pair of small ONNX graphs on the same random inputs: the subgraph as elx's
exports contain it (dynamo's T5 layout) and the fused form a rewrite would put in its place.  Both
run in one process, interleaved (medians of ``--rounds``), and the fused output is compared with the
exported one (max abs diff: a rewrite must stay within the 1e-4 verification bound, and any
difference in rounding can move a near-tie, so each needs the differential tests before it lands).

* ``encoder attention``: Reshape/Transpose, Q·Kᵀ, + position bias, Softmax, ·V, Transpose/Reshape at
  [batch, input, d_model] against ``com.microsoft.MultiHeadAttention`` (``attention_bias``, scale 1).
* ``self attention step``: one decoder step's self-attention with the cache grown by Concat (past
  [rows, heads, past, d_kv] in, present out) against ``com.microsoft.GroupQueryAttention`` writing
  the new position into a preallocated [rows, heads, past + 1, d_kv] buffer shared by past and
  present (IOBinding binds the output to the input's memory).
* ``residual + RMS norm``: Add, Pow, ReduceMean, Add ε, Sqrt, Reciprocal, Mul, Mul (T5LayerNorm as
  exported) against Add + ONNX ``RMSNormalization`` (opset 23) and against
  ``com.microsoft.SkipSimplifiedLayerNormalization``, at the encoder's [batch·input, d_model].
* ``logits output``: the LM head MatMul [rows, d_model] × [d_model, vocab] returning a new array
  against IOBinding into a reused buffer.

Times on a shared VM move by tens of percent between runs: read the ratios of one run.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT


def _vi(name: str, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _ints(name: str, values: list[int]):
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def _session(nodes, inputs, outputs, initializers=(), opset: int = 18) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "candidate", inputs, [_vi(o, None) for o in outputs], list(initializers))
    imports = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=imports, ir_version=10)
    options = ort.SessionOptions()
    options.log_severity_level = 3

    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _split_heads(name: str, shape4: str, perm: list[int]) -> list:
    return [helper.make_node("Reshape", [name, shape4], [name + "4"]),
            helper.make_node("Transpose", [name + "4"], [name + "t"], perm=perm)]


def _merge_heads() -> list:
    return [helper.make_node("Transpose", ["ctx"], ["ctxt"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["ctxt", "shape3"], ["out"])]


def encoder_attention(batch: int, length: int, heads: int, d_kv: int, rng) -> tuple:
    d = heads * d_kv
    inputs = [_vi("q", [batch, length, d]), _vi("k", [batch, length, d]), _vi("v", [batch, length, d]),
              _vi("bias", [batch, heads, length, length])]
    nodes = [*_split_heads("q", "shape4", [0, 2, 1, 3]), *_split_heads("k", "shape4", [0, 2, 3, 1]),
             *_split_heads("v", "shape4", [0, 2, 1, 3]),
             helper.make_node("MatMul", ["qt", "kt"], ["scores"]), helper.make_node("Add", ["scores", "bias"], ["biased"]),
             helper.make_node("Softmax", ["biased"], ["probs"], axis=-1), helper.make_node("MatMul", ["probs", "vt"], ["ctx"]),
             *_merge_heads()]
    shapes = [_ints("shape4", [batch, length, heads, d_kv]), _ints("shape3", [batch, length, d])]
    exported = _session(nodes, inputs, ["out"], shapes)
    fused = _session([helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "bias"], ["out"],
                                       domain="com.microsoft", num_heads=heads, scale=1.0)], inputs, ["out"])
    feeds = {n: rng.standard_normal((batch, length, d)).astype(np.float32) for n in "qkv"}
    bias = np.broadcast_to(rng.standard_normal((1, heads, length, length)).astype(np.float32),
                           (batch, heads, length, length)).copy()
    bias[0, :, :, length // 2:] = np.finfo(np.float32).min  # a padded input, masked as HF's T5 masks it
    feeds["bias"] = bias
    return (lambda: exported.run(None, feeds)[0]), (lambda: fused.run(None, feeds)[0])


def self_attention_step(rows: int, past: int, heads: int, d_kv: int, rng) -> tuple:
    d = heads * d_kv
    total = past + 1
    nodes = [*_split_heads("q", "shape4", [0, 2, 1, 3]), *_split_heads("k", "shape4", [0, 2, 1, 3]),
             *_split_heads("v", "shape4", [0, 2, 1, 3]),
             helper.make_node("Concat", ["past_k", "kt"], ["present_k"], axis=2),
             helper.make_node("Concat", ["past_v", "vt"], ["present_v"], axis=2),
             helper.make_node("Transpose", ["present_k"], ["keys_t"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["qt", "keys_t"], ["scores"]), helper.make_node("Add", ["scores", "bias"], ["biased"]),
             helper.make_node("Softmax", ["biased"], ["probs"], axis=-1),
             helper.make_node("MatMul", ["probs", "present_v"], ["ctx"]), *_merge_heads()]
    inputs = [_vi("q", [rows, 1, d]), _vi("k", [rows, 1, d]), _vi("v", [rows, 1, d]),
              _vi("past_k", [rows, heads, past, d_kv]), _vi("past_v", [rows, heads, past, d_kv]),
              _vi("bias", [1, heads, 1, total])]
    shapes = [_ints("shape4", [rows, 1, heads, d_kv]), _ints("shape3", [rows, 1, d])]
    exported = _session(nodes, inputs, ["out", "present_k", "present_v"], shapes)
    gqa = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total_length",
                                                   "", "", "", "bias"], ["out", "present_k", "present_v"],
                           domain="com.microsoft", num_heads=heads, kv_num_heads=heads, scale=1.0)
    fused = _session([gqa], [_vi("q", [rows, 1, d]), _vi("k", [rows, 1, d]), _vi("v", [rows, 1, d]),
                             _vi("past_k", [rows, heads, total, d_kv]), _vi("past_v", [rows, heads, total, d_kv]),
                             _vi("seqlens_k", [rows], TensorProto.INT32), _vi("total_length", [], TensorProto.INT32),
                             _vi("bias", [rows, heads, 1, total])], ["out", "present_k", "present_v"])
    feeds = {n: rng.standard_normal((rows, 1, d)).astype(np.float32) for n in "qkv"}
    past_k, past_v = (rng.standard_normal((rows, heads, past, d_kv)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((1, heads, 1, total)).astype(np.float32)
    plain = dict(feeds, past_k=past_k, past_v=past_v, bias=bias)
    shared = {"k": np.zeros((rows, heads, total, d_kv), np.float32), "v": np.zeros((rows, heads, total, d_kv), np.float32)}
    shared["k"][:, :, :past], shared["v"][:, :, :past] = past_k, past_v
    extra = {"seqlens_k": np.full(rows, past, np.int32), "total_length": np.array(total, np.int32),
             "bias": np.ascontiguousarray(np.broadcast_to(bias, (rows, heads, 1, total)))}

    def run_fused():
        binding = fused.io_binding()
        for name, value in {**feeds, **extra, "past_k": shared["k"], "past_v": shared["v"]}.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("out", "cpu")
        for name, buffer in (("present_k", shared["k"]), ("present_v", shared["v"])):
            binding.bind_output(name, "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
        fused.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    return (lambda: exported.run(None, plain)[0]), run_fused


def rms_norm(rows: int, d: int, rng) -> tuple:
    weight = rng.standard_normal(d).astype(np.float32)
    constants = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                 numpy_helper.from_array(np.array([-1], np.int64), "axes"),
                 numpy_helper.from_array(np.array(1e-6, np.float32), "eps")]
    inputs = [_vi("x", [rows, d]), _vi("skip", [rows, d])]
    chain = [helper.make_node("Add", ["x", "skip"], ["h"]), helper.make_node("Pow", ["h", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]), helper.make_node("Add", ["ms", "eps"], ["mse"]),
             helper.make_node("Sqrt", ["mse"], ["rms"]), helper.make_node("Reciprocal", ["rms"], ["inv"]),
             helper.make_node("Mul", ["h", "inv"], ["normed"]), helper.make_node("Mul", ["w", "normed"], ["y"])]
    exported = _session(chain, inputs, ["y", "h"], constants)
    standard = _session([chain[0], helper.make_node("RMSNormalization", ["h", "w"], ["y"], axis=-1, epsilon=1e-6)],
                        inputs, ["y", "h"], constants, opset=23)
    skip = _session([helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "w"], ["y", "", "", "h"],
                                      domain="com.microsoft", epsilon=1e-6)], inputs, ["y", "h"], constants)
    feeds = {"x": rng.standard_normal((rows, d)).astype(np.float32), "skip": rng.standard_normal((rows, d)).astype(np.float32)}
    return ((lambda: exported.run(None, feeds)[0]), (lambda: standard.run(None, feeds)[0]),
            (lambda: skip.run(None, feeds)[0]))


def logits_output(rows: int, d: int, vocab: int, rng) -> tuple:
    weight = (rng.standard_normal((d, vocab)) * 0.05).astype(np.float32)
    session = _session([helper.make_node("MatMul", ["x", "w"], ["logits"])], [_vi("x", [rows, d])], ["logits"],
                       [numpy_helper.from_array(weight, "w")])
    x = rng.standard_normal((rows, d)).astype(np.float32)
    buffer = np.empty((rows, vocab), np.float32)

    def bound():
        binding = session.io_binding()
        binding.bind_cpu_input("x", x)
        binding.bind_output("logits", "cpu", 0, np.float32, [rows, vocab], buffer.ctypes.data)
        session.run_with_iobinding(binding)
        return buffer

    return (lambda: session.run(None, {"x": x})[0]), bound


def compare(name: str, variants: dict, rounds: int) -> list[dict]:
    """Rows (candidate, variant, median ms, vs exported, max abs diff) for ``variants`` (the first: exported)."""
    outputs = {label: np.array(fn()) for label, fn in variants.items()}
    reference = outputs[next(iter(variants))]
    seconds = {label: [] for label in variants}
    for _ in range(rounds):
        for label, fn in variants.items():
            start = time.perf_counter()
            fn()
            seconds[label].append(time.perf_counter() - start)
    base = float(np.median(next(iter(seconds.values()))))
    return [{"candidate": name, "variant": label, "ms": 1000 * float(np.median(times)),
             "speedup": base / float(np.median(times)), "max_abs_diff": float(np.abs(outputs[label] - reference).max())}
            for label, times in seconds.items()]


def measure(args) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    rows, d_kv = args.batch * args.beams, args.d_model // args.heads
    exported, fused = encoder_attention(args.batch, args.input, args.heads, d_kv, rng)
    table = compare(f"encoder attention [{args.batch}, {args.input}, {args.d_model}], one layer",
                    {"exported": exported, "MultiHeadAttention": fused}, args.rounds)
    exported, fused = self_attention_step(rows, args.past, args.heads, d_kv, rng)
    table += compare(f"self attention step, {rows} rows, past {args.past}, one layer",
                     {"exported (Concat)": exported, "GroupQueryAttention, shared buffer": fused}, args.rounds)
    exported, standard, skip = rms_norm(args.batch * args.input, args.d_model, rng)
    table += compare(f"residual + RMS norm [{args.batch * args.input}, {args.d_model}]",
                     {"exported": exported, "Add + RMSNormalization-23": standard,
                      "SkipSimplifiedLayerNormalization": skip}, args.rounds)
    fresh, bound = logits_output(rows, args.d_model, args.vocab, rng)
    table += compare(f"LM head output [{rows}, {args.vocab}]",
                     {"new array": fresh, "IOBinding, reused buffer": bound}, args.rounds)
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--input", type=int, default=256, help="encoder positions")
    parser.add_argument("--past", type=int, default=16, help="self-cache positions before the step")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("| candidate | variant | median ms | vs exported | max abs diff |")
    print("|---|---|---|---|---|")
    for row in measure(args):
        print(f"| {row['candidate']} | {row['variant']} | {row['ms']:.2f} | {row['speedup']:.3f}x | {row['max_abs_diff']:.2e} |")


if __name__ == "__main__":
    main()
