"""The runtime needs no PyTorch and no transformers: load an export, generate (ids and text), print.

Each check runs in a fresh interpreter where importing torch or transformers raises, so any
import of them on the runtime path (``import elx``, ``elx.Generator``, ``elx generate``) fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = '''
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} must not be imported by the elx runtime")
sys.meta_path.insert(0, _Block())
'''


def _run(tmp_path: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    site = tmp_path / "blocker"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def _word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tiny word-level tokenizer.json in the export's tokenizer/ folder (what export saves from real models)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (folder / "tokenizer").mkdir(exist_ok=True)
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": False}))


def test_blocker_really_blocks(tmp_path):
    proc = _run(tmp_path, "import torch")
    assert proc.returncode != 0 and "must not be imported" in proc.stderr


def test_generate_without_torch_or_transformers(tmp_path, exported):
    import shutil

    folder = tmp_path / "t5-el"
    shutil.copytree(exported("t5", "el"), folder)
    _word_tokenizer(folder, 128)
    proc = _run(tmp_path, """
        import sys, elx
        g = elx.Generator.from_folder(sys.argv[1])
        out = g.generate(input_ids=[[5, 6, 7, 8], [9, 10]], num_beams=3, max_new_tokens=5)
        assert out.sequences.shape[0] == 2 and out.sequences_scores.shape == (2,)
        text = g.generate(text=["w5 w6 w7", "w9 w10"], max_new_tokens=4)
        assert len(text.text) == 2
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        print("ok", out.sequences.tolist())
        """, str(folder))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")


def test_cli_generate_without_torch(tmp_path, exported):
    proc = _run(tmp_path, """
        import sys
        from elx.cli import main
        sys.exit(main(["generate", sys.argv[1], "--input-ids", "5 6 7; 8 9", "--num-beams", "2",
                       "--max-new-tokens", "3"]))
        """, str(exported("bart")))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("input 0, hypothesis 0, score ")


def test_generate_matches_with_torch_present(exported):
    """The same call in-process (torch loaded) gives the same tokens: nothing runtime-specific changed them."""
    import numpy as np

    import elx

    out = elx.Generator.from_folder(exported("t5", "el")).generate(input_ids=[[5, 6, 7, 8], [9, 10]], num_beams=3,
                                                                    max_new_tokens=5)
    assert out.sequences.dtype == np.int64 and out.sequences.shape[0] == 2
    assert np.all(np.diff(out.sequences_scores) <= 0) or out.sequences_scores.shape == (2,)
