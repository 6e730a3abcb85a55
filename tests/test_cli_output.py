"""Issue 27 item 4: `elx generate` names each row's input, hypothesis and score; `--format jsonl` gives scripts
one JSON object per row; a decoder-only prompt's left padding is not shown; the random-weights note also comes
in dataset mode."""
from __future__ import annotations

import json
import re
import shutil

from elx.cli import main

LINE = re.compile(r"^input (\d+), hypothesis (\d+)(?:, score (-?\d+\.\d{4}))?: ([\d ]+)$")


def _rows(text: str) -> list[tuple]:
    return [LINE.match(line).groups() for line in text.splitlines() if line.startswith("input ")]


def test_rows_name_input_hypothesis_and_score(exported, capsys):
    """Beam search with 2 returned sequences per input: the rows are HF's (elx.Generator's) in order, each with
    its input, its rank and its sequences_scores; jsonl holds the same with the exact score."""
    import elx

    folder = exported("t5")
    argv = ["generate", str(folder), "--input-ids", "5 6 7 8; 9 10", "--num-beams", "3", "--num-return-sequences",
            "2", "--max-new-tokens", "4"]
    out = elx.Generator.from_folder(folder).generate(input_ids=[[5, 6, 7, 8], [9, 10]], num_beams=3,
                                                     num_return_sequences=2, max_new_tokens=4)
    assert main(argv) == 0
    human = _rows(capsys.readouterr().out)
    assert [(int(i), int(j)) for i, j, _, _ in human] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [[int(t) for t in tokens.split()] for *_, tokens in human] == out.sequences.tolist()
    assert [score for _, _, score, _ in human] == [f"{s:.4f}" for s in out.sequences_scores]

    assert main([*argv, "--format", "jsonl"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [sorted(line) for line in lines] == [["hypothesis", "input", "score", "text", "tokens"]] * 4
    assert [line["tokens"] for line in lines] == out.sequences.tolist()
    assert [line["score"] for line in lines] == [float(s) for s in out.sequences_scores]
    assert [(line["input"], line["hypothesis"]) for line in lines] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(line["text"] is None for line in lines)  # no tokenizer in this export


def test_greedy_rows_have_no_score(exported, capsys):
    folder = str(exported("t5"))
    assert main(["generate", folder, "--input-ids", "5 6; 7", "--max-new-tokens", "3"]) == 0
    human = _rows(capsys.readouterr().out)
    assert len(human) == 2 and all(score is None for _, _, score, _ in human)
    assert main(["generate", folder, "--input-ids", "5 6; 7", "--max-new-tokens", "3", "--format", "jsonl"]) == 0
    assert [json.loads(line)["score"] for line in capsys.readouterr().out.splitlines()] == [None, None]


def test_decoder_only_rows_leave_out_the_left_padding(exported, tmp_path, capsys):
    """GPT-2 pads the shorter prompt on the left with its EOS; the rows shown are HF's rows less those leading
    pads, tokens and text alike (this tokenizer does not mark the pad word special, so HF's decode shows it)."""
    import elx
    from tests.test_runtime_imports import _word_tokenizer

    folder = tmp_path / "gpt2"
    shutil.copytree(exported("gpt2"), folder)
    _word_tokenizer(folder, 128)
    texts = ["w5 w6 w7 w9", "w8"]
    options = dict(num_beams=2, num_return_sequences=2, max_new_tokens=3)
    out = elx.Generator.from_folder(folder).generate(text=texts, **options)
    pad = 127  # GPT-2 without a pad token pads with its EOS (the last id here)
    assert out.sequences[2:, :3].tolist() == [[pad] * 3] * 2 and out.text[2].startswith("w127 w127 w127 w8")
    assert main(["generate", str(folder), "--text", texts[0], "--text", texts[1], "--num-beams", "2",
                 "--num-return-sequences", "2", "--max-new-tokens", "3", "--format", "jsonl"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["tokens"] for line in lines[:2]] == out.sequences[:2].tolist()  # the longest prompt: no padding
    assert [line["tokens"] for line in lines[2:]] == out.sequences[2:, 3:].tolist()
    assert [line["text"] for line in lines[:2]] == out.text[:2]
    assert [line["text"] for line in lines[2:]] == [t.replace("w127 w127 w127 ", "", 1) for t in out.text[2:]]
    assert lines[2]["tokens"][0] == 8 and lines[2]["text"].startswith("w8")

    assert main(["generate", str(folder), "--text", texts[1], "--text", texts[0], "--max-new-tokens", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()  # the human form: the row, then its text indented
    assert printed[0].startswith("input 0, hypothesis 0: 8 ") and printed[1].startswith("    w8")
    assert printed[2].startswith("input 1, hypothesis 0: 5 6 7 9 ") and printed[3].startswith("    w5 w6 w7 w9")


def test_random_weights_note_in_dataset_mode(exported, tmp_path, capsys):
    folder = tmp_path / "random"
    shutil.copytree(exported("t5"), folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["source"]["random_init"] = True  # what `elx export --random-init` records
    (folder / "manifest.json").write_text(json.dumps(manifest))
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "input_ids": [5, 6, 7]}) + "\n")
    note = "elx: note: this export has random weights"
    assert main(["generate", str(folder), "--input-file", str(source), "--output-file", str(tmp_path / "o.jsonl"),
                 "--max-new-tokens", "2"]) == 0
    assert note in capsys.readouterr().err
    assert main(["generate", str(folder), "--input-file", str(source), "--output-file", str(tmp_path / "q.jsonl"),
                 "--max-new-tokens", "2", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["generate", str(exported("t5")), "--input-file", str(source), "--output-file",
                 str(tmp_path / "t.jsonl"), "--max-new-tokens", "2"]) == 0
    assert note not in capsys.readouterr().err  # trained weights (here: a saved folder) get no note


def _random_copy(exported, tmp_path, family="t5"):
    folder = tmp_path / f"random-{family}"
    shutil.copytree(exported(family), folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["source"]["random_init"] = True  # what `elx export --random-init` records
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elx: error: "), err
    return err[0]


def test_quiet_everywhere(exported, tmp_path, capsys):
    """Issue 42 item 5: --quiet is taken by every command; on `generate --input-ids` it silences the random-weights
    note (before: refused outside --input-file, so the note could not be silenced)."""
    folder = _random_copy(exported, tmp_path)
    argv = ["generate", str(folder), "--input-ids", "5 6 7", "--max-new-tokens", "2"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "random weights" in out.err and _rows(out.out)
    assert main([*argv, "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and _rows(out.out)  # the rows still come
    from elx.cli import build_parser

    parser = build_parser()
    for command in (["export", "--model", "m", "--output", "o"], ["generate", "d"], ["compare", "d"],
                    ["bench"], ["build-engine", "d"], ["import-ct2", "s", "--output", "o"],
                    ["import-gguf", "f", "--output", "o"]):
        assert parser.parse_args([*command, "--quiet"]).quiet is True, command


def test_messages_name_flags_on_the_cli_and_keywords_in_python(exported, tmp_path, capsys):
    """Issue 42 item 5: the same refusal says `--output` / `--force` on the command line and `output` / `force=True`
    from Python (before: Python errors said "choose another --output (--force ...)")."""
    import pytest

    import elx
    from elx.runners.dataset.pipeline import generate_file
    from elx.runners.errors import ElxError

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "thesis.txt").write_text("mine")
    assert main(["export", "--model", "t5-tiny", "--random-init", "--output", str(taken)]) == 2
    line = _one_error(capsys)
    assert "choose another --output (--force replaces" in line
    with pytest.raises(ElxError) as err:
        elx.export("t5-tiny", taken, random_init=True)
    assert "choose another output (force=True replaces" in str(err.value) and "--" not in str(err.value)

    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "input_ids": [5, 6]}) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("someone's notes\n")
    assert main(["generate", str(exported("t5")), "--input-file", str(source), "--output-file", str(out)]) == 2
    line = _one_error(capsys)
    assert "--resume" in line and "--force" in line
    with pytest.raises(ElxError) as err:
        generate_file(exported("t5"), source, out, progress="none")
    assert "resume=True" in str(err.value) and "force=True" in str(err.value) and "--" not in str(err.value)


def test_compare_model_points_at_a_moved_source(exported, model_folders, tmp_path, capsys):
    """Issue 42 item 5: `elx compare --model SOURCE` when the folder the manifest records is gone."""
    folder = tmp_path / "export"
    shutil.copytree(exported("t5"), folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    recorded = manifest["source"]["path"]
    manifest["source"]["path"] = str(tmp_path / "moved-away")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    argv = ["compare", str(folder), "--batch-size", "1", "--input-length", "4", "--max-new-tokens", "3"]
    assert main(argv) == 2
    assert "is gone; pass its new place with --model" in _one_error(capsys)
    assert main([*argv, "--model", str(tmp_path / "nowhere")]) == 2
    assert "--model" in _one_error(capsys)
    assert main([*argv, "--model", str(model_folders["bart"])]) == 2
    assert "holds a bart model; this export is t5" in _one_error(capsys)
    assert main([*argv, "--model", recorded]) == 0
    assert "identical" in capsys.readouterr().out


def test_subtitles_are_whisper_only(exported, capsys):
    assert main(["generate", str(exported("t5")), "--input-ids", "5 6", "--format", "srt"]) == 2
    assert "--format srt writes the subtitles of a Whisper transcription" in _one_error(capsys)
    assert main(["generate", str(exported("t5")), "--input-ids", "5 6", "--format", "vtt", "--stream"]) == 2
    assert "--stream" in _one_error(capsys)
