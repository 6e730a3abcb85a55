"""Bad input: one clear line, exit status 2, nothing half-written."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def run_elx(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "elx.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.startswith("elx: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def no_leftovers(parent, name):
    return not (parent / name).exists() and not any(p.name.startswith(f".{name}.") for p in parent.iterdir())


def test_unknown_model_id(tmp_path):
    code, _, err = run_elx("export", "--model", "no-such/model-xyz", "--output", str(tmp_path / "out"))
    line = one_line_error(err)
    assert code == 2 and "--random-init" in line and "local" in line
    assert no_leftovers(tmp_path, "out")


def test_unknown_preset(tmp_path):
    code, _, err = run_elx("export", "--model", "t7-giant", "--random-init", "--output", str(tmp_path / "out"))
    assert code == 2 and "t5-small" in one_line_error(err)


def test_unsupported_architecture(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=50)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    code, _, err = run_elx("export", "--model", str(tmp_path / "llama"), "--output", str(tmp_path / "out"))
    line = one_line_error(err)
    assert code == 2 and "LlamaForCausalLM" in line and "GPT2LMHeadModel" in line
    assert "T5ForConditionalGeneration" in line
    assert no_leftovers(tmp_path, "out")


def test_unwritable_output(tmp_path, model_folders):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, _, err = run_elx("export", "--model", str(model_folders["t5"]), "--output", str(blocker / "out"))
    assert code == 2 and str(blocker) in one_line_error(err)


def test_nonempty_output_is_kept(tmp_path, model_folders):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    code, _, err = run_elx("export", "--model", str(model_folders["t5"]), "--output", str(out))
    assert code == 2 and "--force" in one_line_error(err)
    assert (out / "keep.txt").read_text() == "user data"


def test_unknown_and_repeated_pass(tmp_path, model_folders):
    code, _, err = run_elx("export", "--model", str(model_folders["t5"]), "--pass", "warp", "--output",
                           str(tmp_path / "o"))
    assert code == 2 and "el" in one_line_error(err)
    code, _, err = run_elx("export", "--model", str(model_folders["t5"]), "--pass", "el,el", "--output",
                           str(tmp_path / "o"))
    assert code == 2 and "twice" in one_line_error(err)
    assert no_leftovers(tmp_path, "o")


def test_failed_verification_writes_nothing(tmp_path, model_folders, monkeypatch):
    """If verification fails (here: a tolerance no float can meet), the output folder never appears."""
    import exporter.verify as verify
    from runners.errors import ElxError
    from exporter.export import export_model

    monkeypatch.setattr(verify, "TOLERANCE", -1.0)
    with pytest.raises(ElxError, match="exceeds"):
        export_model(str(model_folders["t5"]), tmp_path / "out", quiet=True)
    assert no_leftovers(tmp_path, "out")


@pytest.fixture()
def export_copy(tmp_path, exported):
    folder = tmp_path / "copy"
    shutil.copytree(exported("t5"), folder)
    return folder


def test_corrupted_manifest(export_copy):
    (export_copy / "manifest.json").write_text("{ not json")
    code, _, err = run_elx("generate", str(export_copy), "--input-ids", "5 6 7")
    assert code == 2 and "corrupted" in one_line_error(err)
    (export_copy / "manifest.json").write_text(json.dumps({"format": "elx-manifest", "version": 1}))
    code, _, err = run_elx("generate", str(export_copy), "--input-ids", "5 6 7")
    assert code == 2 and "missing" in one_line_error(err)


def test_corrupted_graph(export_copy):
    graph = export_copy / "decoder.onnx"
    graph.write_bytes(graph.read_bytes()[: 1000])
    code, _, err = run_elx("generate", str(export_copy), "--input-ids", "5 6 7")
    assert code == 2 and "decoder.onnx" in one_line_error(err)


def test_missing_graph(export_copy):
    (export_copy / "encoder.onnx").unlink()
    code, _, err = run_elx("compare", str(export_copy))
    assert code == 2 and "encoder.onnx" in one_line_error(err)


def test_bad_generation_options(exported):
    code, _, err = run_elx("generate", str(exported("t5")), "--input-ids", "5 6 7", "--num-beams", "2",
                           "--num-return-sequences", "3")
    assert code == 2 and "num_return_sequences" in one_line_error(err)
    code, _, err = run_elx("generate", str(exported("t5")), "--input-ids", "5 x 7")
    assert code == 2 and "--input-ids" in one_line_error(err)
