"""A checkpoint's own ``generation_config`` is honoured or refused, never dropped (issue 25 item 6, first half).

Three checkpoints the issue names: a model whose config sets ``exponential_decay_length_penalty`` (and
other fields the export used to drop: ``elx compare`` gave 0/3 identical rows), an opus-mt-like Marian
config (``bad_words_ids: [[pad]]``, the pad also the decoder start) generating from the CLI, and a GPT-2
whose config samples (runs; greedy with ``--no-do-sample``; HF's tokens with ``--seed``).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from elx.cli import main
from elx.exporter.export import export_model, generation_defaults
from elx.runners.errors import ElxError
from elx.runners.generate import Generator, make_backend
from elx.runners.manifest import Manifest
from elx.runners.model import Model


def _folder(tmp_path, name: str, model, **generation) -> str:
    model.generation_config.update(**generation)
    folder = tmp_path / name
    model.eval().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def t5_export(tmp_path_factory):
    from transformers import T5Config, T5ForConditionalGeneration

    tmp = tmp_path_factory.mktemp("t5-decay")
    torch.manual_seed(3)
    model = T5ForConditionalGeneration(T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=32, num_layers=1,
                                                num_decoder_layers=1, num_heads=4, decoder_start_token_id=0,
                                                eos_token_id=1, pad_token_id=0, relative_attention_num_buckets=8))
    source = _folder(tmp, "model", model, exponential_decay_length_penalty=(1, 4.0), renormalize_logits=True,
                     sequence_bias=[[[7], 1.5], [[7, 9], -2.0]], repetition_penalty=1.3, num_beams=2)
    return export_model(source, tmp / "export", quiet=True)


def test_every_set_field_is_recorded(t5_export):
    defaults = Manifest.load(t5_export).data["generation_defaults"]
    assert defaults["exponential_decay_length_penalty"] == [1, 4.0]
    assert defaults["renormalize_logits"] is True and defaults["repetition_penalty"] == 1.3
    assert defaults["sequence_bias"] == [[[7], 1.5], [[7, 9], -2.0]] and defaults["num_beams"] == 2


def test_compare_gives_identical_rows(t5_export):
    from elx.exporter.verification.compare import compare

    report = compare(t5_export, batch_size=3, input_length=12, seed=1)
    assert report.passed and report.all_identical, [r.__dict__ for r in report.rows]


def test_the_recorded_fields_change_the_tokens(t5_export):
    """Dropping the fields (the old export) gives other tokens: the identical rows above depend on them."""
    kept = Generator.from_folder(t5_export, threads=1)
    manifest = Manifest.load(t5_export)
    for name in ("exponential_decay_length_penalty", "renormalize_logits", "sequence_bias", "repetition_penalty"):
        del manifest.data["generation_defaults"][name]
    dropped = Generator(Model(manifest, make_backend(manifest, threads=1)))
    ids = np.random.default_rng(4).integers(2, 96, size=(3, 10))
    assert not np.array_equal(kept.generate(input_ids=ids).sequences, dropped.generate(input_ids=ids).sequences)


def test_opus_mt_like_marian_generates_from_the_cli(tmp_path, capsys):
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(5)
    pad = 63
    model = MarianMTModel(MarianConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                       encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                       decoder_ffn_dim=16, max_position_embeddings=64, pad_token_id=pad,
                                       decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0))
    source = _folder(tmp_path, "opus-mt", model, bad_words_ids=[[pad]], num_beams=4, max_length=64,
                     bos_token_id=0, decoder_start_token_id=pad, pad_token_id=pad, eos_token_id=0,
                     forced_eos_token_id=0)
    export = export_model(source, tmp_path / "export", quiet=True)
    assert Manifest.load(export).data["generation_defaults"]["bad_words_ids"] == [[pad]]
    assert main(["generate", str(export), "--input-ids", "5 6 7 8; 9 10", "--max-new-tokens", "8"]) == 0
    rows = [[int(t) for t in line.split(": ")[1].split()] for line in capsys.readouterr().out.splitlines()
            if line.startswith("input ")]
    assert len(rows) == 2 and all(row[0] == pad and pad not in row[1:] for row in rows)
    from elx.exporter.verification.compare import compare

    assert compare(export, batch_size=2, input_length=8, max_new_tokens=8).all_identical


def test_gpt2_that_samples(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(6)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=80, n_embd=16, n_layer=1, n_head=2, n_positions=64,
                                       bos_token_id=79, eos_token_id=79, initializer_range=0.5))
    source = _folder(tmp_path, "gpt2", model, do_sample=True, top_k=5, temperature=0.8)
    export = export_model(source, tmp_path / "export", quiet=True)
    assert Manifest.load(export).data["generation_defaults"]["do_sample"] is True

    def cli(*extra):
        assert main(["generate", str(export), "--input-ids", "5 6 7", "--max-new-tokens", "10", *extra]) == 0
        return [int(t) for t in capsys.readouterr().out.split(": ")[1].split()]

    prompt = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        greedy = model.generate(prompt, do_sample=False, max_new_tokens=10).tolist()[0]
        torch.manual_seed(3)
        sampled = model.generate(prompt, max_new_tokens=10).tolist()[0]
    assert cli("--no-do-sample") == greedy
    assert cli("--seed", "3") == sampled == cli("--seed", "3")
    assert cli() and sampled != greedy


def test_export_refuses_what_it_cannot_apply(tmp_path):
    from transformers import GenerationConfig

    with pytest.raises(ElxError, match="num_beam_groups"):
        generation_defaults(GenerationConfig(num_beams=4, num_beam_groups=2, diversity_penalty=0.5))
    config = GenerationConfig(num_beams=2)
    config.update(allow_custom_entries=True, some_future_option=3)
    with pytest.raises(ElxError, match="some_future_option"):
        generation_defaults(config)
    recorded = generation_defaults(GenerationConfig(sequence_bias={(1, 2): 0.5},
                                                    exponential_decay_length_penalty=(3, 1.1)))
    assert json.loads(json.dumps(recorded)) == {"sequence_bias": [[[1, 2], 0.5]],
                                                "exponential_decay_length_penalty": [3, 1.1]}


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_generation_flags(capsys, exported):
    folder = exported("t5")
    sample = ["generate", folder, "--input-ids", "5 6 7; 8 9", "--max-new-tokens", "6", "--do-sample", "--seed", "4",
              "--top-k", "5", "--temperature", "0.7", "--repetition-penalty", "1.3", "--num-return-sequences", "2"]
    code, first, _ = _cli(capsys, *sample)
    assert code == 0 and len(first.splitlines()) == 4 and _cli(capsys, *sample)[1] == first
    generator = Generator.from_folder(folder, threads=1)
    expected = generator.generate(input_ids=[[5, 6, 7], [8, 9]], max_new_tokens=6, do_sample=True, seed=4, top_k=5,
                                  temperature=0.7, repetition_penalty=1.3, num_return_sequences=2).sequences
    assert [[int(t) for t in line.split(": ")[1].split()] for line in first.splitlines()] == expected.tolist()
    code, out, _ = _cli(capsys, "generate", folder, "--input-ids", "5 6 7", "--max-new-tokens", "6",
                        "--generation-config", '{"bad_words_ids": [[3], [4, 5]], "repetition_penalty": 1.5}')
    assert code == 0 and out.startswith("input 0, hypothesis 0")


@pytest.mark.parametrize("flags,expected", [
    (["--do-sample", "--temperature", "0"], "temperature"),
    (["--do-sample", "--top-k", "-3"], "top_k"),
    (["--generation-config", "{bad"], "--generation-config"),
    (["--generation-config", '{"output_attentions": true}'], "output_attentions"),
    (["--generation-config", '{"num_beams": 4, "num_beam_groups": 2}'], "num_beam_groups"),
    (["--stream"], "tokenizer"),
    (["--stop-string", "x"], "tokenizer"),
    (["--num-beams", "2", "--num-return-sequences", "3", "--do-sample"], "num_return_sequences"),
])
def test_cli_refusals(capsys, exported, flags, expected):
    code, _, err = _cli(capsys, "generate", exported("t5"), "--input-ids", "5 6 7", "--max-new-tokens", "3", *flags)
    assert code == 2 and err.count("\n") == 1 and err.startswith("elx: error:") and expected in err


def test_cli_stream_is_one_generation(capsys, exported, tmp_path):
    code, _, err = _cli(capsys, "generate", exported("t5"), "--input-file", tmp_path / "in.txt", "--output-file",
                        tmp_path / "out.jsonl", "--stream")
    assert code == 2 and "--stream" in err and "--input-file" in err
