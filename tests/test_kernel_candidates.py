"""``tools/kernel_candidates.py``: each fused ONNX Runtime kernel it times computes what the exported subgraph computes."""
from __future__ import annotations

import numpy as np

from tests.tools_loader import load_tool


def test_every_candidate_matches_the_exported_subgraph_at_small_shapes(capsys):
    tool = load_tool("kernel_candidates")
    tool.main(["--batch", "2", "--beams", "3", "--input", "12", "--past", "5", "--d-model", "32", "--heads", "4",
               "--vocab", "50", "--rounds", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    variants = {line.split(" | ")[1] for line in lines}
    assert variants == {"exported", "MultiHeadAttention", "exported (Concat)", "GroupQueryAttention, shared buffer",
                        "Add + RMSNormalization-23", "SkipSimplifiedLayerNormalization", "new array",
                        "IOBinding, reused buffer"}
    for line in lines:
        assert float(line.rstrip(" |").split(" | ")[-1]) <= 1e-4, line


def test_the_shared_cache_buffer_receives_the_new_position():
    tool = load_tool("kernel_candidates")
    rng = np.random.default_rng(3)
    exported, fused = tool.self_attention_step(rows=3, past=4, heads=2, d_kv=8, rng=rng)
    np.testing.assert_allclose(fused(), exported(), atol=1e-5)
    second = fused()  # run again on the same shared buffer: the new position is written in place, not appended
    np.testing.assert_allclose(second, exported(), atol=1e-5)
