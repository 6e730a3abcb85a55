"""``elx export``: keep the tokenizer's chat template for the runtime, which has no transformers.

An instruct checkpoint's tokenizer carries a Jinja chat template (in ``tokenizer_config.json``'s
``chat_template``, or in ``chat_template.jinja`` beside it, the file transformers 5.24's
``save_pretrained`` writes).  ``copy_tokenizer`` (``exporter/export.py``) saves the tokenizer into the
export's ``tokenizer/`` folder; this module then

* takes the template transformers' ``apply_chat_template`` would use (``get_chat_template()``: the single
  template, or the one named "default" of several) and makes sure ``tokenizer/chat_template.jinja`` holds
  exactly it;
* records in the manifest's ``chat_template`` section the file, the named special tokens as transformers
  hands them to the template (``special_tokens_map``: ``bos_token``, ``eos_token``, ``unk_token``,
  ``pad_token``, ...; the runtime renders with these strings, not with its own reading of the tokenizer's
  configuration) and the tokenizer's ``split_special_tokens`` (how transformers tokenizes the rendered text);
* checks one conversation end to end: elx's rendering and tokenization (``runners/inputs/chat.py``) on the
  export must give the ids transformers' ``apply_chat_template(..., add_generation_prompt=True)`` gives with the
  source folder's tokenizer, or the export stops with one line (a template elx cannot render as transformers
  does is never recorded as usable).

A tokenizer without a template (or with several templates and no default, which transformers would not pick
from either) records nothing: ``elx generate --chat`` then says so.
"""
from __future__ import annotations

from pathlib import Path

from elx.runners.errors import ElxError
from elx.runners.inputs.chat import TEMPLATE_FILE, Chat
from elx.runners.inputs.text import TOKENIZER_DIR, Text

_SAMPLE = [{"role": "user", "content": "Hello! What is 2 + 2?"}]


def _template(tokenizer) -> str | None:
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        return tokenizer.get_chat_template()
    except ValueError:  # several named templates and none is the default: transformers asks for a name
        return None


def _check_rendering(tokenizer, record: dict, folder: Path, source: str) -> None:
    """elx's ids for a sample conversation are transformers' (when the template accepts the sample at all)."""
    try:
        expected = list(tokenizer.apply_chat_template(_SAMPLE, add_generation_prompt=True, return_dict=False))
    except Exception:  # noqa: BLE001 - a template may refuse a lone user message (then elx refuses it too)
        return
    try:
        got = Chat(source, record["special_tokens"], Text.load(folder), record["split_special_tokens"]).prompt_ids(
            _SAMPLE)[0]
    except ElxError as err:
        raise ElxError(f"elx cannot render this model's chat template as transformers does ({err}); report this, "
                       "with the model's tokenizer_config.json / chat_template.jinja")
    if got != expected:
        raise ElxError(f"elx renders this model's chat template to other token ids than transformers ({got[:12]} vs "
                       f"{expected[:12]} for a one-message conversation); report this, with the model's "
                       "tokenizer_config.json / chat_template.jinja")


def _names_a_template(tokenizer_dir: Path) -> bool:
    """Whether any file transformers reads a chat template from is there: a ``.jinja`` file, the
    ``additional_chat_templates`` folder, or a configuration (``tokenizer_config.json``, ``chat_template.json``,
    ``processor_config.json``) naming ``chat_template``.  Without one the tokenizer is not loaded again to find
    none (whisper-base's: 0.9 s of its export)."""
    if (tokenizer_dir / "additional_chat_templates").exists() or any(tokenizer_dir.glob("*.jinja")):
        return True
    return any(b"chat_template" in path.read_bytes() for path in tokenizer_dir.glob("*.json")
               if path.name != "tokenizer.json")


def _load(folder):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception:  # noqa: BLE001 - a feature extractor alone (no tokenizer): no chat
        return None


def save_chat_template(folder: Path, model_folder: str | None = None) -> dict | None:
    """The manifest's ``chat_template`` section for the export in ``folder`` (its tokenizer saved in ``tokenizer/``),
    the template written to ``tokenizer/chat_template.jinja``; None when the tokenizer has no template.  The check
    compares with ``model_folder``'s tokenizer (the export's own when None or unreadable)."""
    tokenizer_dir = Path(folder) / TOKENIZER_DIR
    if not (tokenizer_dir / "tokenizer.json").is_file():  # the runtime tokenizes with tokenizer.json only
        return None
    if not _names_a_template(tokenizer_dir):
        return None
    tokenizer = _load(tokenizer_dir)
    if tokenizer is None:
        return None
    source = _template(tokenizer)
    if source is None:
        return None
    path = tokenizer_dir / TEMPLATE_FILE
    if not path.is_file():
        path.write_text(source, encoding="utf-8")
    elif path.read_text(encoding="utf-8") != source:
        raise ElxError(f"the saved tokenizer's {TEMPLATE_FILE} is not the template transformers uses for it; report "
                       "this, with the model's tokenizer files")
    record = {"file": f"{TOKENIZER_DIR}/{TEMPLATE_FILE}", "special_tokens": dict(tokenizer.special_tokens_map),
              "split_special_tokens": bool(getattr(tokenizer, "split_special_tokens", False))}
    reference = _load(model_folder) if model_folder else None
    _check_rendering(reference if reference is not None else tokenizer, record, Path(folder), source)
    return record
