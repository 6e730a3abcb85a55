"""End to end through the command line: python -m exporter, elx compare (exit status), elx generate."""
from __future__ import annotations

import json
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=900)


def test_export_compare_generate(tmp_path, model_folders):
    out = tmp_path / "bart-el"
    proc = run("-m", "exporter", "--model", str(model_folders["bart"]), "--pass", "el", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == ["el"]
    assert sorted(p.name for p in out.iterdir()) == ["decoder.el.onnx", "encoder.onnx", "manifest.json"]

    proc = run("-m", "elx.cli", "compare", str(out), "--batch-size", "3", "--input-length", "12",
               "--num-beams", "4", "--no-repeat-ngram-size", "3", "--max-new-tokens", "10")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3/3 sequences identical to HF generate" in proc.stdout

    proc = run("-m", "elx.cli", "generate", str(out), "--input-ids", "5 6 7 8; 9 10", "--num-beams", "2",
               "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == 2 and all(len(r.split()) == 1 + 5 for r in rows)  # "[i]" + start token + 4 new tokens


def test_compare_fails_when_tokens_differ(tmp_path, model_folders, exported):
    """A folder whose graphs came from another model (different weights) must make compare exit 1."""
    import shutil

    from tests.conftest import make_model_folder

    other = make_model_folder(tmp_path, "t5", seed=5)
    folder = tmp_path / "mixed"
    shutil.copytree(exported("t5"), folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["source"]["path"] = str(other)  # compare will rebuild a different PyTorch model
    (folder / "manifest.json").write_text(json.dumps(manifest))
    proc = run("-m", "elx.cli", "compare", str(folder), "--max-new-tokens", "8")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DIFFERENT" in proc.stdout
