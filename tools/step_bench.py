"""Time one decoder step graph run alone, without a search around it: elx's ``decoder.onnx`` or GenAI's ``model.onnx``.

    python3 tools/step_bench.py GRAPH [--past 96] [--prompt 64] [--runs 60] [--threads 2] [--config KEY=VALUE ...]

Feeds are made from the graph's inputs: batch 1, one new token, a ``--prompt``-token prompt cache (elx's
``prompt_key_values``) and ``--past`` generated tokens (elx's ``past_key_values``; GenAI's past is prompt + past),
random keys/values, masks of ones.  Prints the median and 10th percentile of ``--runs`` runs after 5 warm-up runs.
``--config`` adds ONNX Runtime session config entries (e.g. ``session.dynamic_block_base=4``).  Used by
``docs/measurements/real_smollm2_2026-11-29.md`` (fourth session) to compare the two step graphs at 1 and 2 threads.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def feeds_for(session, prompt: int, past: int) -> dict:
    rng = np.random.default_rng(0)
    sizes = {"rows": 1, "batch": 1, "batch_size": 1, "sequence_length": 1, "kv_cache_dim": 64,
             "prompt_sequence": prompt, "past_sequence": past,
             "past_sequence_length": prompt + past, "total_sequence_length": prompt + past + 1}
    feeds = {}
    for spec in session.get_inputs():
        shape = [d if isinstance(d, int) else sizes.get(d, 1) for d in spec.shape]
        if "mask" in spec.name:
            feeds[spec.name] = np.ones(shape, np.int32 if "int32" in spec.type else
                                       np.int64 if "int" in spec.type else np.float32)
        elif "int64" in spec.type:
            feeds[spec.name] = np.full(shape, prompt + past if "position" in spec.name else 5, np.int64)
        elif "int32" in spec.type:
            feeds[spec.name] = np.ones(shape, np.int32)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def main(argv=None) -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("graph")
    parser.add_argument("--past", type=int, default=96)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", action="append", default=[])
    args = parser.parse_args(argv)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    options.log_severity_level = 3
    for entry in args.config:
        key, _, value = entry.partition("=")
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(args.graph, options, providers=["CPUExecutionProvider"])
    feeds = feeds_for(session, args.prompt, args.past)
    for _ in range(5):
        session.run(None, feeds)
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"{args.graph}: median {1e3 * times[len(times) // 2]:.2f} ms, p10 {1e3 * times[len(times) // 10]:.2f} ms "
          f"({args.runs} runs, {args.threads} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
