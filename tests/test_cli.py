"""End to end through the command line: python -m exporter, elx compare (exit status), elx generate."""
from __future__ import annotations

import json
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=900)


def test_export_compare_generate(tmp_path, model_folders):
    out = tmp_path / "bart-el"
    proc = run("-m", "elx.exporter", "--model", str(model_folders["bart"]), "--pass", "el", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == ["el"]
    assert sorted(p.name for p in out.iterdir()) == ["decoder.el.onnx", "encoder.onnx", "manifest.json",
                                                           "weights.data"]

    proc = run("-m", "elx.cli", "compare", str(out), "--batch-size", "3", "--input-length", "12",
               "--num-beams", "4", "--no-repeat-ngram-size", "3", "--max-new-tokens", "10")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3/3 sequences identical to HF generate" in proc.stdout

    proc = run("-m", "elx.cli", "generate", str(out), "--input-ids", "5 6 7 8; 9 10", "--num-beams", "2",
               "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split(": ")[1] for line in proc.stdout.splitlines() if line.startswith("input ")]
    assert len(rows) == 2 and all(len(r.split()) == 5 for r in rows)  # start token + 4 new tokens


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


def test_every_option_of_every_subcommand_is_documented():
    import argparse

    from elx.cli import build_parser

    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"export", "generate", "compare", "bench", "build-engine", "import-ct2"} <= set(subcommands)
    for name, sub in subcommands.items():
        undocumented = [a.option_strings or a.dest for a in sub._actions if not a.help]
        assert not undocumented, (name, undocumented)
    export_help = subcommands["export"].format_help()
    import re

    from elx.cli import PASS_HELP
    from elx.exporter.passes.catalog import PASSES

    for name in PASSES:  # every pass the catalog declares is named in --pass's help (unpad was not)
        assert re.search(rf"[ :]{re.escape(name)}[ =,(]", PASS_HELP), name
    for syntax in ("el", "slim=skip-bad", "slim-cross", "el-self", "ngram=N", "t5-small", "whisper-base", "gpt2"):
        assert syntax in export_help, syntax


def test_generate_and_compare_take_the_backend(exported, capsys):
    """``--backend ort-io`` gives the rows ``ort`` gives; a backend the folder cannot run is one line, exit 2."""
    from elx.cli import main

    folder = str(exported("t5"))
    rows = {}
    for backend in ("ort", "ort-io"):
        assert main(["generate", folder, "--input-ids", "5 6 7 8; 9 10", "--num-beams", "3", "--max-new-tokens", "5",
                     "--backend", backend]) == 0
        rows[backend] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("input ")]
    assert rows["ort"] == rows["ort-io"] and len(rows["ort"]) == 2
    assert main(["compare", folder, "--batch-size", "2", "--input-length", "6", "--max-new-tokens", "4",
                 "--backend", "ort-io"]) == 0
    assert "2/2 sequences identical" in capsys.readouterr().out
    assert main(["generate", folder, "--input-ids", "5 6", "--backend", "tensorrt"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elx: error:") and "\n" not in err


def test_help_and_messages_agree_with_the_behaviour(exported, capsys):
    """Issue 27 item 7: bench --help said --random-init was the default for presets (export requires it and so
    does the bench with --model), --new-tokens showed no default, and `elx generate DIR` alone did not name
    --input-file."""
    import argparse

    from elx.cli import build_parser, main

    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    bench = {a.dest: a.help for a in subcommands["bench"]._actions}
    assert "default for presets" not in bench["random_init"] and "needed for presets" in bench["random_init"]
    assert "default 32" in bench["new_tokens"] and subcommands["bench"].get_default("new_tokens") == 32
    assert main(["generate", str(exported("t5"))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elx: error: nothing to generate from") and "--input-file IN --output-file OUT" in err
