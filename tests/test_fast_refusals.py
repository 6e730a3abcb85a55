"""Issue 27 item 2: every argument error of the command line comes before PyTorch, transformers, onnx and ONNX
Runtime are imported (they took 14-60 s to refuse `--pass foo` and the like).  Counted, not timed: one
subprocess runs each refused command line through ``elx.cli.main`` and lists the heavy modules loaded so far."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "onnx_graphsurgeon", "tensorrt")

RUNNER = textwrap.dedent('''
    import contextlib, io, json, sys
    from elx.cli import main

    results = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        heavy = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
        results.append({"argv": argv, "code": code, "err": err.getvalue(), "heavy": heavy})
    print(json.dumps(results))
''')


def refusals(folders: dict) -> list[tuple[list[str], str]]:
    """(command line, a fragment of its one-line error)."""
    t5, gpt2, llama, out = folders["t5-export"], folders["gpt2"], folders["llama"], folders["out"]
    whisper = folders["whisper-export"]
    export = ["export", "--output", out]
    return [
        ([*export, "--model", "t5-tiny", "--random-init", "--pass", "foo"], "unknown pass 'foo'"),
        ([*export, "--model", "t5-tiny", "--random-init", "--pass", "el,slim-cross"], "cannot be combined"),
        ([*export, "--model", "t5-tiny", "--random-init", "--pass", "ngram=x"], "n-gram size"),
        ([*export, "--model", "t5-tiny", "--random-init", "--pass", "el,el"], "listed twice"),
        ([*export, "--model", "gpt2", "--random-init", "--pass", "el"], "does not apply to gpt2"),
        ([*export, "--model", gpt2, "--pass", "el"], "does not apply to gpt2"),  # a folder: its config.json
        ([*export, "--model", gpt2, "--pass", "ngram=3"], "does not apply to gpt2"),
        ([*export, "--model", llama, "--pass", "slim"], "GQA/MQA"),  # config.json states 2 kv heads for 4
        ([*export, "--model", llama, "--pass", "el-self"], "RoPE"),
        ([*export, "--model", llama, "--pass", "fused-attention"], "needs one cache per row"),  # shared: the default
        ([*export, "--model", llama, "--prompt-cache", "per-beam", "--pass", "fused-attention", "--precision", "fp16"],
         "not converted to fp16"),
        ([*export, "--model", llama, "--prompt-cache", "per-beam", "--pass", "slim,fused-attention"],
         "cannot be combined"),
        ([*export, "--model", "t5-tiny", "--random-init", "--pass", "fused-attention"], "encoder-decoder graphs"),
        ([*export, "--model", gpt2, "--pass", "fused-norm"], "does not use"),  # LayerNorm
        ([*export, "--model", llama, "--pass", "fused-norm", "--precision", "fp16"], "fp32 RMSNorms"),
        ([*export, "--model", "whisper-tiny", "--random-init", "--pass", "unpad"], "never padded"),
        ([*export, "--model", gpt2, "--pass", "unpad"], "Gemm on flattened"),
        ([*export, "--model", "t5-tiny", "--random-init", "--precision", "fp8"], "--precision"),
        ([*export, "--model", "no-such-preset", "--random-init"], "no preset named"),
        ([*export, "--model", f"{out}/no-such-folder", "--random-init"], "does not exist"),  # a path, not a preset
        ([*export, "--model", f"{t5}/manifest.json", "--random-init"], "manifest.json' is a file, not a folder"),
        ([*export, "--model", "t5-tiny", "--random-init", "--seed", "-1"], "--seed"),
        (["export", "--model", "t5-tiny", "--random-init", "--output", t5], "already exists"),
        (["generate", t5, "--input-ids", "5 6", "--num-beams", "0"], "num_beams"),
        (["generate", t5, "--input-ids", "5 6", "--forced-bos-token-id", "999999"], "forced_bos_token_id"),
        (["generate", t5, "--input-ids", "5 6", "--num-beams", "2", "--num-return-sequences", "3"],
         "num_return_sequences"),
        (["generate", t5, "--input-ids", "5 6", "--generation-config", "{"], "--generation-config"),
        (["generate", t5, "--input-ids", "5 x"], "--input-ids"),
        (["generate", t5, "--text", "hello"], "no tokenizer"),
        (["generate", t5, "--audio", "a.wav"], "takes tokens, not audio"),
        (["generate", t5, "--input-ids", "5 6", "--batch-size", "3"], "goes with --input-file"),
        (["generate", t5, "--input-ids", "5 6", "--stream", "--format", "jsonl"], "--stream"),
        (["generate", t5, "--input-file", "in.txt", "--output-file", "o.jsonl", "--format", "jsonl"], "--format"),
        (["generate", t5, "--input-file", "in.txt"], "--output-file"),
        (["generate", t5], "nothing to generate from"),
        (["generate", out, "--input-ids", "5 6"], "no manifest.json"),
        (["compare", t5, "--num-beams", "0"], "num_beams"),
        (["compare", t5, "--atol", "-1"], "--atol"),
        (["compare", out], "no manifest.json"),
        (["bench", "--quick", "--pass-sets", "baseline|foo"], "unknown pass 'foo'"),
        (["bench", "--quick", "--peers", "nosuch"], "unknown peer"),
        (["bench", "--model", "no-such-preset", "--random-init"], "no preset named"),
        (["bench", "--quick", "--model", "/no-such-folder/model"], "does not exist"),
        (["bench", "--quick", "--backend", "tensorrt"], "--device cuda"),
        # issue 40 class 5: before, an IndexError traceback ('' and '|||'), or a refusal after the baseline's export
        (["bench", "--quick", "--pass-sets", "", "--work", out], "names no pass set"),
        (["bench", "--quick", "--pass-sets", "|||", "--work", out], "names no pass set"),
        (["bench", "--model", llama, "--pass-sets", "baseline|slim", "--work", out], "GQA/MQA"),
        (["bench", "--model", llama, "--pass-sets", "baseline|fused-attention", "--prompt-cache", "shared|per-beam",
          "--work", out], "needs one cache per row"),
        (["bench", "--quick", "--pass-sets", "baseline|none", "--work", out], "twice"),
        (["bench", "--quick", "--prompt-cache", "shared|per-beam", "--work", out], "applies to decoder-only"),
        (["bench", "--model", llama, "--pass-sets", "baseline", "--prompt-cache", "shared|foo", "--work", out], "unknown form 'foo'"),
        ([*export, "--model", "t5-tiny", "--random-init", "--prompt-cache", "shared"], "applies to decoder-only"),
        (["build-engine", t5, "--max-batch-size", "0"], "--max-batch-size"),
        (["build-engine", t5, "--precision", "int4"], "--precision"),
        (["build-engine", out], "no manifest.json"),
        # issue 42: Whisper's subtitles, audio headers read before the runtime loads, --threads, compare --model
        (["generate", t5, "--input-ids", "5 6", "--format", "srt"], "subtitles of a Whisper transcription"),
        (["generate", whisper, "--audio", "missing.wav"], "does not exist"),
        (["generate", whisper, "--audio", folders["junk"]], "not a WAV file"),
        (["generate", whisper, "--audio", folders["five-hours"]], "elx transcribes up to 14400 s"),
        (["generate", whisper, "--audio", folders["junk"], "--audio", folders["junk"], "--format", "vtt"],
         "one subtitle file"),
        (["generate", t5, "--input-ids", "5 6", "--threads", "100000"], "pass --threads"),
        (["compare", t5, "--model", f"{out}/nowhere"], "--model"),
    ]


def test_argument_errors_come_before_heavy_imports(tmp_path, model_folders, exported):
    junk, five_hours = tmp_path / "junk.wav", tmp_path / "five-hours.wav"
    junk.write_bytes(b"not a sound file")
    fmt = struct.pack("<HHIIHH", 1, 1, 1000, 2000, 2, 16)  # 1 kHz 16-bit mono: 5 h in 36 MB, sparse
    with open(five_hours, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 0) + b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data"
                + struct.pack("<I", 5 * 3600 * 2000))
        f.truncate(44 + 5 * 3600 * 2000)
    folders = {"t5-export": str(exported("t5")), "gpt2": str(model_folders["gpt2"]),
               "llama": str(model_folders["llama"]), "out": str(tmp_path / "out"),
               "whisper-export": str(exported("whisper")), "junk": str(junk), "five-hours": str(five_hours)}
    cases = refusals(folders)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([argv for argv, _ in cases]), json.dumps(HEAVY)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for (argv, fragment), result in zip(cases, json.loads(proc.stdout)):
        err = result["err"].strip()
        assert result["code"] == 2 and err.startswith("elx: error:") and "\n" not in err, (argv, result)
        assert fragment in err, (argv, err)
        assert result["heavy"] == [], (argv, result["heavy"])  # modules accumulate: the first offender is named
    assert not (tmp_path / "out").exists()


KINDS = ("decoder-only", "encoder-decoder")
FAMILIES = ("t5", "bart", "whisper", "gpt2", "opt", "llama", "qwen2", "gpt_neox", "m2m100")


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(names=st.lists(st.sampled_from(["el", "slim-cross", "slim", "el-self", "unpad", "ngram"]), min_size=1, max_size=3,
                      unique=True),
       family=st.sampled_from(FAMILIES), kind=st.sampled_from(KINDS),
       heads=st.sampled_from([None, (4, 4), (4, 2), (8, 1)]))
def test_a_refusal_before_loading_is_one_the_loaded_model_gets(names, family, kind, heads):
    """The command line decides with what config.json states (no dims, or only stated head counts): whatever it
    refuses, the check with the loaded model's dims refuses too, in the same words."""
    from elx.cli_checks import stated_head_counts
    from elx.exporter.passes import check_model_kind, parse_passes
    from elx.runners.errors import ElxError

    try:
        requests = parse_passes(",".join(n if n != "ngram" else "ngram=3" for n in names))
    except ElxError:
        return  # a conflicting combination: refused whatever the model
    config = {} if heads is None else {"num_attention_heads": heads[0], "num_key_value_heads": heads[1]}
    dims = {"num_heads": heads[0] if heads else 4, "num_kv_heads": heads[1] if heads else 4}
    early = full = None
    for stated, target in ((stated_head_counts(config), "early"), (dims, "full")):
        try:
            check_model_kind(requests, family, kind == "encoder-decoder", stated)
        except ElxError as err:
            if target == "early":
                early = str(err)
            else:
                full = str(err)
    if early is not None:
        assert full == early


def test_each_pass_module_applies_its_catalog_entry():
    from elx.exporter.passes import PASSES, load_pass

    for name, spec in PASSES.items():
        module = load_pass(name)
        assert module.SPEC is spec and module.NAME == name and callable(module.apply)


@pytest.mark.parametrize("argv", [["export", "--help"], ["generate", "--help"]])
def test_help_needs_no_heavy_import(argv):
    code = ("import sys\nfrom elx.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr
