"""How fast ONNX Runtime's CPU matmuls run at a decoder step's own shapes (issue 15: where the floor is lost).

``elx bench``'s floor divides FLOPs by one large-matmul peak.  A decoder step of t5-small at batch 32,
beam 4 multiplies 128 rows by 512×512, 512×2048, 2048×512 and 512×32128 weights; at these shapes
ONNX Runtime's GEMM (MLAS) runs below that peak.  This prints, per weight shape, the rate of one
MatMul node run alone (best of ``--repeats`` timed runs of 50 calls), and the sum over one step's
weight matmuls: the time a step cannot beat on this engine however the graph around them is built.

    PYTHONPATH=. python tools/gemm_rates.py [--rows 128] [--d-model 512] [--d-ff 2048] [--vocab 32128] \\
        [--layers 6] [--gated] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def matmul_session(k: int, n: int, threads: int, seed: int = 0) -> ort.InferenceSession:
    weight = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def seconds_per_call(session: ort.InferenceSession, rows: int, k: int, repeats: int, calls: int = 50) -> float:
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    session.run(None, {"x": x})
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            session.run(None, {"x": x})
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def step_shapes(d_model: int, d_ff: int, vocab: int, layers: int, gated: bool, inner: int) -> list[tuple]:
    """(name, k, n, count per step) of a cached decoder step's weight matmuls (cross K/V precomputed)."""
    return [("self q/k/v, cross q", d_model, inner, layers * 4),
            ("self o, cross o", inner, d_model, layers * 2),
            ("ffn in", d_model, d_ff, layers * (2 if gated else 1)),
            ("ffn out", d_ff, d_model, layers),
            ("lm head", d_model, vocab, 1)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128, help="batch × beams (default 128: batch 32, beam 4)")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--inner", type=int, default=None, help="heads × d_kv (default d_model)")
    parser.add_argument("--d-ff", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--gated", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-size", type=int, default=2048, help="the square matmul the peak is read from")
    args = parser.parse_args(argv)
    inner = args.inner or args.d_model

    n = args.peak_size
    peak_t = seconds_per_call(matmul_session(n, n, args.threads), n, n, args.repeats, calls=5)
    peak = 2 * n ** 3 / peak_t
    print(f"ORT MatMul {n}x{n}x{n}: {peak / 1e9:.0f} GFLOP/s (the large-matmul peak)")
    print(f"| weight matmul ({args.rows} rows) | k×n | per step | GFLOP/s | of peak | ms a step |")
    print("|---|---|---|---|---|---|")
    total_t = total_f = 0.0
    for name, k, m, count in step_shapes(args.d_model, args.d_ff, args.vocab, args.layers, args.gated, inner):
        t = seconds_per_call(matmul_session(k, m, args.threads), args.rows, k, args.repeats)
        flops = 2 * args.rows * k * m
        total_t += count * t
        total_f += count * flops
        print(f"| {name} | {k}×{m} | {count} | {flops / t / 1e9:.0f} | {flops / t / peak:.0%} | {count * t * 1e3:.1f} |")
    print(f"one step's weight matmuls: {total_f / 1e9:.2f} GFLOP, {total_t * 1e3:.1f} ms alone "
          f"({total_f / total_t / 1e9:.0f} GFLOP/s, {total_f / total_t / peak:.0%} of peak); "
          f"at peak {total_f / peak * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
