"""GGUF in (issue 39): ``elx import-gguf`` and ``elx export --model X.gguf`` on tiny GGUF files written here.

``tests/tiny_gguf.py`` writes a random tiny Llama as llama.cpp lays it out (Q/K permuted, tied head, a byte-level
BPE tokenizer with ChatML specials and a chat template), in F32 and in Q8_0 (``gguf.quants.quantize``), so the
dequantization runs; nothing is downloaded.  Held to transformers' own GGUF loading: the imported folder's
logits, tokenizer and chat template are those of ``from_pretrained(..., gguf_file=...)``, and the export of
the file generates HF ``generate``'s tokens on that model.  Every refusal is one line, exit 2, before PyTorch
is imported, with nothing written.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elx.runners.errors import ElxError
from tests.tiny_gguf import TEXT, llama_metadata, tiny_llama, tokenizer_metadata, write_gguf, write_llama_gguf

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    model = tiny_llama(seed=3)
    return {"model": model, "F32": write_llama_gguf(root / "tiny-f32.gguf", "F32", model=model),
            "Q8_0": write_llama_gguf(root / "tiny-q8_0.gguf", "Q8_0", model=model)}


def hf_gguf(path: Path):
    """transformers' own load of a GGUF file: (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def imported(files, tmp_path_factory):
    """``elx import-gguf`` of the Q8_0 file, through the command line."""
    from elx.cli import main

    out = tmp_path_factory.mktemp("import") / "tiny-hf"
    assert main(["import-gguf", str(files["Q8_0"]), "--output", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def exported(files, tmp_path_factory):
    """``elx export --model tiny-q8_0.gguf``, through the command line."""
    from elx.cli import main

    out = tmp_path_factory.mktemp("export") / "tiny-elx"
    assert main(["export", "--model", str(files["Q8_0"]), "--output", str(out), "--quiet"]) == 0
    return out


# -- the writer -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_transformers_loads_back_the_written_weights(files, qtype):
    """The writer lays the model out as llama.cpp does: transformers' load gives back its weights (Q and K
    un-permuted), exactly in F32, within Q8_0's rounding (a block's scale / 2) in Q8_0."""
    loaded, _ = hf_gguf(files[qtype])
    written = files["model"].state_dict()
    for name, value in loaded.state_dict().items():
        diff = (value - written[name]).abs().max().item()
        bound = 0.0 if qtype == "F32" or value.ndim == 1 else written[name].abs().max().item() / 127
        assert diff <= bound, (name, diff, bound)


# -- import-gguf ------------------------------------------------------------------------------------------

def test_import_gives_transformers_gguf_model(files, imported):
    """A normal HF folder: no quantization_config, float32 safetensors, the GGUF's special tokens; its logits are
    those of transformers' GGUF-loaded model (dequantized Q8_0), bit for bit."""
    from transformers import AutoModelForCausalLM

    names = sorted(p.name for p in imported.iterdir())
    assert names == ["chat_template.jinja", "config.json", "elx_import.json", "generation_config.json",
                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((imported / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    generation = json.loads((imported / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)
    record = json.loads((imported / "elx_import.json").read_text())
    assert record["source"]["sha256"] == hashlib.sha256(files["Q8_0"].read_bytes()).hexdigest()
    assert record["source"]["quantization"] == "Q8_0" and record["source"]["file_type"] == "MOSTLY_Q8_0"
    assert sorted(record["files"]) == names
    assert all(p.stat().st_mode & 0o044 for p in imported.iterdir())  # readable like save_pretrained's other files

    reference, _ = hf_gguf(files["Q8_0"])
    model = AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == reference.generation_config.eos_token_id
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": st.text(max_size=40)})


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(text=st.one_of(st.sampled_from(TEXT), st.text(max_size=60)), messages=st.lists(MESSAGE, min_size=1, max_size=3),
       generation_prompt=st.booleans())
def test_imported_tokenizer_and_template_are_transformers_gguf_ones(files, imported, text, messages,
                                                                    generation_prompt):
    """The saved tokenizer (and the tokenizers-library file the runtime reads) encodes and decodes as transformers'
    tokenizer rebuilt from the GGUF, and the chat template renders the same prompt."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    reference = _gguf_tokenizer(files["Q8_0"])
    saved = AutoTokenizer.from_pretrained(imported)
    runtime = Tokenizer.from_file(str(imported / "tokenizer.json"))
    ids = reference(text).input_ids
    assert saved(text).input_ids == ids and runtime.encode(text).ids == ids
    assert saved.decode(ids) == reference.decode(ids)
    prompt = reference.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    assert saved.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False) == prompt


_TOKENIZERS = {}


def _gguf_tokenizer(path: Path):
    """transformers' tokenizer of a GGUF file, built once per file (the hypothesis test draws many examples)."""
    from transformers import AutoTokenizer

    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return _TOKENIZERS[path]


def test_force_replaces_an_import_and_nothing_else(files, imported, tmp_path):
    from elx.exporter.gguf.import_gguf import import_gguf

    out = tmp_path / "again"
    shutil.copytree(imported, out)
    with pytest.raises(ElxError, match="already exists"):
        import_gguf(files["F32"], out)
    assert import_gguf(files["F32"], out, force=True) == out  # replaces the earlier import
    assert json.loads((out / "elx_import.json").read_text())["source"]["quantization"] == "F32"
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ElxError, match="notes.txt"):
        import_gguf(files["F32"], out, force=True)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "elx_import.json").unlink()
    with pytest.raises(ElxError, match="not written by 'elx import-gguf'"):
        import_gguf(files["F32"], out, force=True)


def test_a_failed_write_leaves_nothing(files, tmp_path, monkeypatch):
    """An error while the folder is written (here after the weights) removes the staged folder: no output, no
    partial sibling."""
    import elx.exporter.gguf.import_gguf as module

    def fail_after_the_weights(info, model, tokenizer, folder):
        model.save_pretrained(folder)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "write_import", fail_after_the_weights)
    with pytest.raises(ElxError, match="no space left on the device; nothing was written"):
        module.import_gguf(files["F32"], tmp_path / "out" / "model")
    assert sorted(tmp_path.iterdir()) == []  # the parent it created is gone too


def test_too_large_for_memory_is_refused_before_loading(files, tmp_path, monkeypatch):
    import elx.runners.inputs.validation as validation
    from elx.exporter.gguf.import_gguf import import_gguf

    monkeypatch.setattr(validation, "available_memory", lambda: 1_000_000)  # loading needs 3 x 0.373 MB
    with pytest.raises(ElxError, match=r"dequantizes to 0\.373 MB of float32 weights; loading it needs about 1\.12 MB "
                                       r"and 1 MB of memory is free"):
        import_gguf(files["Q8_0"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- export -------------------------------------------------------------------------------------------------

def test_export_records_the_gguf_and_generates_hf_tokens(files, exported, capsys):
    """The manifest's source names the file (SHA-256, Q8_0, llama); greedy and beam search on the export give HF
    generate's tokens on transformers' GGUF-loaded model; the tokenizer and chat template come along."""
    from elx.cli import main
    from elx.runners.generate import Generator
    from elx.runners.manifest import Manifest

    source = Manifest.load(exported).data["source"]
    assert source["kind"] == "gguf" and source["path"] == str(files["Q8_0"])
    assert source["gguf"] == {"file": "tiny-q8_0.gguf", "sha256": hashlib.sha256(files["Q8_0"].read_bytes()).hexdigest(),
                              "architecture": "llama", "quantization": "Q8_0", "file_type": "MOSTLY_Q8_0",
                              "tensor_types": {"F32": 5, "Q8_0": 15}}
    assert {"tokenizer.json", "chat_template.jinja"} <= {p.name for p in (exported / "tokenizer").iterdir()}

    reference, tokenizer = hf_gguf(files["Q8_0"])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True,
                                           return_dict=False)
    ids = torch.tensor([prompt])
    for beams in (1, 3):
        hf = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, num_beams=beams,
                                do_sample=False)
        out = Generator.from_folder(exported).generate(input_ids=[prompt], max_new_tokens=10, num_beams=beams)
        assert out.sequences.tolist() == hf.tolist(), beams
    hf = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    capsys.readouterr()
    assert main(["generate", str(exported), "--input-ids", " ".join(map(str, prompt)), "--max-new-tokens", "10",
                 "--format", "jsonl"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["tokens"] == hf[0].tolist()


def test_compare_reloads_the_gguf_and_refuses_a_changed_file(files, exported, tmp_path):
    from elx.exporter.verification.compare import compare
    from elx.exporter.source.load import reload_model
    from elx.runners.manifest import Manifest

    report = compare(exported, batch_size=2, input_length=6, max_new_tokens=4)
    assert report.passed and report.all_identical
    source = dict(Manifest.load(exported).data["source"])
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(files["Q8_0"], copy)
    with open(copy, "r+b") as f:  # one byte of the last tensor changed
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ElxError, match="SHA-256 changed"):
        reload_model({**source, "path": str(copy)})


def test_the_manifest_schema_checks_the_gguf_record(exported):
    from elx.runners.manifest_schema import check

    data = json.loads((exported / "manifest.json").read_text())
    check(data, exported)
    data["source"]["gguf"]["sha256"] = "not a digest"
    with pytest.raises(ElxError, match="source.gguf.sha256"):
        check(data, exported)


# -- refusals -----------------------------------------------------------------------------------------------

RUNNER = textwrap.dedent('''
    import contextlib, io, json, sys
    from elx.cli import main

    results = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        results.append({"code": code, "err": err.getvalue(), "torch": "torch" in sys.modules,
                        "transformers": "transformers" in sys.modules})
    print(json.dumps(results))
''')


def _bad_files(root: Path, files) -> dict[str, Path]:
    import gguf

    llama = tiny_llama(seed=3)
    good = files["F32"].read_bytes()
    out = {"text": root / "notes.gguf", "empty": root / "empty.gguf", "truncated": root / "truncated.gguf",
           "header": root / "header-only.gguf", "v1": root / "v1.gguf", "folder": root / "folder.gguf",
           "fifo": root / "pipe.gguf"}
    out["text"].write_text("this is not a model\n")
    out["empty"].write_bytes(b"")
    out["truncated"].write_bytes(good[: len(good) // 2])
    out["header"].write_bytes(good[:40])
    out["v1"].write_bytes(b"GGUF" + struct.pack("<I", 1) + bytes(32))
    out["folder"].mkdir()
    os.mkfifo(out["fifo"])
    one = {"token_embd.weight": np.zeros((8, 64), dtype=np.float32)}
    out["bert"] = write_gguf(root / "bert.gguf", "bert", {}, one)
    out["falcon"] = write_gguf(root / "falcon.gguf", "falcon", {}, one)
    # one tensor in Q8_1 (gguf's GGML_QUANT_SIZES: 32 values in 40 bytes), a type gguf's dequantize does not implement
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    q8_1 = {"token_embd.weight": (np.zeros((8, 64 // block * size), dtype=np.uint8), gguf.GGMLQuantizationType.Q8_1)}
    out["q8_1"] = write_gguf(root / "q8_1.gguf", "llama", {**llama_metadata(llama.config), **tokenizer_metadata()}, q8_1)
    return out


def test_each_refusal_is_one_line_before_pytorch_and_writes_nothing(files, tmp_path):
    bad = {name: str(path) for name, path in _bad_files(tmp_path, files).items()}
    out = str(tmp_path / "out")
    cases = [  # (command line, a fragment of its error, transformers may be imported): transformers-free ones first
        (["import-gguf", bad["text"], "--output", out], "is not a GGUF file (it starts with b'this'", False),
        (["import-gguf", bad["empty"], "--output", out], "is not a GGUF file (it is empty", False),
        (["import-gguf", bad["truncated"], "--output", out], "truncated or damaged", False),
        (["import-gguf", bad["header"], "--output", out], "truncated or damaged", False),
        (["import-gguf", bad["v1"], "--output", out], "GGUF version 1", False),
        (["import-gguf", bad["folder"], "--output", out], "is a folder, not a GGUF file", False),
        (["import-gguf", bad["fifo"], "--output", out], "is a FIFO, not a GGUF file", False),
        (["import-gguf", os.devnull, "--output", out], "is a device, not a GGUF file", False),
        (["import-gguf", str(tmp_path / "missing.gguf"), "--output", out], "does not exist", False),
        (["export", "--model", bad["text"], "--output", out], "is not a GGUF file", False),
        (["export", "--model", bad["truncated"], "--output", out], "truncated or damaged", False),
        (["export", "--model", bad["fifo"], "--output", out], "is a FIFO", False),
        (["export", "--model", str(files["F32"]), "--output", out, "--random-init"],
         "--random-init does not apply to a GGUF file", False),
        (["import-gguf", bad["bert"], "--output", out], "'bert' cannot be loaded by transformers (it loads bloom",
         True),
        (["import-gguf", bad["q8_1"], "--output", out], "of type Q8_1, which transformers cannot dequantize", True),
        (["import-gguf", str(files["F32"]), "--output", str(files["F32"])], "exists and is not a folder", True),
        (["export", "--model", bad["bert"], "--output", out], "cannot be loaded by transformers", True),
        (["export", "--model", bad["falcon"], "--output", out], "loads in transformers but elx does not export it",
         True),
        (["export", "--model", str(files["F32"]), "--output", out, "--pass", "el-self"], "RoPE", True),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([argv for argv, _, _ in cases])],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for (argv, fragment, transformers), result in zip(cases, json.loads(proc.stdout)):
        err = result["err"].strip()
        assert result["code"] == 2 and err.startswith("elx: error:") and "\n" not in err, (argv, result)
        assert fragment in err, (argv, err)
        assert not result["torch"], argv  # modules accumulate: the first offender is named
        assert transformers or not result["transformers"], argv
    assert not Path(out).exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no partial folder left
