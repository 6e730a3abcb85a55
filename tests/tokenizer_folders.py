"""Real slow-tokenizer folders for the translation families, trained here (no hub): SentencePiece models trained with
``sentencepiece.SentencePieceTrainer`` on sentences written below, laid out as each family's ``save_pretrained``
leaves them (Marian: ``source.spm`` + ``target.spm`` + ``vocab.json``; T5 / Pegasus: ``spiece.model``; mBART,
mBART-50, NLLB: ``sentencepiece.bpe.model``; M2M100: ``sentencepiece.bpe.model`` + ``vocab.json``; Llama:
``tokenizer.model``), and a tiny random model of the family beside it whose vocabulary fits the tokenizer.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "ba", "de", "fu", "gi", "ho", "ju", "pa", "qu", "xe",
             "yo", "wa", "the", "and", "ing", "ion")
ADDED = ("é", "ü", "ñ", "ç", "ø", "ß", "日本", "語", "中文", "😀", "–", "«", "»", "Ω", "ä", "ö", "\u00a0")


def sentences(n: int = 400, seed: int = 0) -> list[str]:
    """``n`` seeded sentences of made-up words, capitals, numbers, accents, CJK, emoji and punctuation."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = []
        for _ in range(rng.randint(3, 12)):
            word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
            roll = rng.random()
            if roll < 0.1:
                word = word.capitalize()
            elif roll < 0.16:
                word += rng.choice(ADDED)
            elif roll < 0.21:
                word = str(rng.randint(0, 2025))
            words.append(word)
        out.append(" ".join(words) + rng.choice([".", "!", "?", ",", "", "...", " (ok)"]))
    return out


def train_spm(path: Path, model_type: str = "unigram", vocab_size: int = 300, seed: int = 0, extra: tuple = (),
              **options) -> Path:
    """A SentencePiece model trained on ``sentences(seed=seed)`` and ``extra`` lines, written to ``path``."""
    import sentencepiece

    prefix = path.with_suffix("")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences(400, seed) + list(extra)), model_prefix=str(prefix), vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, minloglevel=2, num_threads=1, **options)
    Path(f"{prefix}.vocab").unlink()
    Path(f"{prefix}.model").replace(path)
    return path


def _pieces(path: Path) -> list[str]:
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=str(path))
    return [model.id_to_piece(i) for i in range(model.get_piece_size())]


def _config(**values) -> dict:
    """Tiny BART-like dims (tests/conftest.py's, one layer each side: exports take less time) and ``values``."""
    return dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, **values)


def _tokenizer_size(folder: Path) -> int:
    """Ids the tokenizer can name (M2M100's language ids lie past its ``len``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = [*tokenizer.get_vocab().values(), *getattr(tokenizer, "lang_code_to_id", {}).values()]
    return max(ids) + 1


TARGET_ONLY = "Жж"  # characters only Marian's target model knows (its source model reads them as unknown)


def marian(folder: Path) -> dict:
    source = train_spm(folder / "source.spm", seed=0)
    target = train_spm(folder / "target.spm", seed=1, extra=tuple(f"{c}a {c}o ba{c}" for c in TARGET_ONLY))
    vocab = {"</s>": 0, "<unk>": 1, ">>deu<<": 2, ">>fra<<": 3, ">>spa<<": 4}
    for piece in _pieces(source) + _pieces(target):
        if piece not in vocab and piece != "<s>":
            vocab[piece] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "MarianTokenizer",
                                                              "source_lang": "en", "target_lang": "mul"}))
    pad = vocab["<pad>"]
    return dict(architecture="MarianMTModel", config="MarianConfig",
                values=_config(vocab_size=len(vocab), pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0,
                               forced_eos_token_id=0))


def m2m100(folder: Path) -> dict:
    pieces = _pieces(train_spm(folder / "sentencepiece.bpe.model", "bpe"))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "M2M100Tokenizer"}))
    return dict(architecture="M2M100ForConditionalGeneration", config="M2M100Config", values=_config())


def nllb(folder: Path) -> dict:
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    train_spm(folder / "sentencepiece.bpe.model", "bpe")
    # as NLLB's own tokenizer_config.json: the codes are its additional special tokens
    config = {"tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn",
              "additional_special_tokens": FAIRSEQ_LANGUAGE_CODES}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return dict(architecture="M2M100ForConditionalGeneration", config="M2M100Config", values=_config())


def mbart(folder: Path, tokenizer: str = "MBartTokenizer") -> dict:
    train_spm(folder / "sentencepiece.bpe.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer}))
    return dict(architecture="MBartForConditionalGeneration", config="MBartConfig", values=_config(
        **({"decoder_start_token_id": 2} if tokenizer == "MBart50Tokenizer" else {})))


def t5(folder: Path) -> dict:
    train_spm(folder / "spiece.model", pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    return dict(architecture="T5ForConditionalGeneration", config="T5Config", values=dict(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
        eos_token_id=1, pad_token_id=0, relative_attention_num_buckets=8))


def pegasus(folder: Path) -> dict:
    train_spm(folder / "spiece.model", pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    return dict(architecture="PegasusForConditionalGeneration", config="PegasusConfig", values=_config())


def llama(folder: Path) -> dict:
    train_spm(folder / "tokenizer.model", "bpe", vocab_size=700, byte_fallback=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return dict(architecture="LlamaForCausalLM", config="LlamaConfig", values=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, bos_token_id=1, eos_token_id=2))


def byt5(folder: Path) -> dict:
    """ByT5: a Python tokenizer (bytes + 3) with no converter to the tokenizers library."""
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
    return {**t5(folder), "remove": ("spiece.model",)}


FAMILIES = {"marian": marian, "m2m100": m2m100, "nllb": nllb, "mbart": mbart,
            "mbart50": lambda f: mbart(f, "MBart50Tokenizer"), "t5": t5, "pegasus": pegasus, "llama": llama,
            "byt5": byt5}


def make_folder(root: Path, family: str, with_model: bool = True, seed: int = 0, **overrides) -> Path:
    """``root/family``: the family's slow tokenizer files and (``with_model``) a tiny random model whose vocabulary
    holds every id the tokenizer names (``overrides``: config values, e.g. ``init_std``)."""
    import transformers

    folder = root / family
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    spec = FAMILIES[family](folder)
    for name in spec.get("remove", ()):
        (folder / name).unlink()
    values = {**spec["values"], **overrides}
    config = getattr(transformers, spec["config"])
    config(vocab_size=8, **{k: v for k, v in values.items() if k != "vocab_size"}).save_pretrained(folder)
    values.setdefault("vocab_size", _tokenizer_size(folder))
    config = config(**values)
    if with_model:
        torch.manual_seed(seed)
        getattr(transformers, spec["architecture"])(config).eval().save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder
