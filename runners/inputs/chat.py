"""Chat messages in, the assistant's reply out: an instruct model prompted through its own chat template.

transformers prompts a chat model with ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``
(transformers 5.24): it renders the checkpoint's Jinja chat template with the conversation, the
tokenizer's named special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ...) and
``add_generation_prompt=True`` (the template then opens the assistant's turn), and tokenizes the
rendered text with ``add_special_tokens=False``: the template writes the special tokens it wants (a
Llama 3 template writes ``{{ bos_token }}``), so the tokenizer's post-processor must not add them a second
time.  elx does the same without transformers:

* ``elx export`` saves the template beside the tokenizer (``tokenizer/chat_template.jinja``) and records
  it in the manifest's ``chat_template`` section with the special tokens' strings as transformers
  gives them to the template (``exporter/tokenizer/chat_template.py``);
* here the template is rendered in transformers' Jinja environment (``runners/inputs/chat_environment.py``)
  and the text tokenized by the export's ``tokenizer.json`` (``tokenizers``), special tokens not added.

Messages are checked first (one ``ElxError`` line each): a conversation is a list of objects with a
string ``role`` and a string ``content`` (elx chats in text; other keys a template may read are passed
on when they are JSON values); ``messages`` is one conversation or a list of them (a batch, left-padded as
HF pads decoder-only prompts).  As in transformers, keys whose value is None are dropped, and a message's
reasoning given as ``reasoning_content``, ``thinking`` or ``reasoning`` is offered under the first two
names.  A template that refuses a conversation (``raise_exception``: roles out of order, an unsupported
role) raises an ``ElxError`` carrying the template's own message, where transformers raises
``jinja2.TemplateError``.

Generation stops where HF ``generate`` stops: at the generation config's ``eos_token_id``.  Neither HF nor
elx adds the template's end-of-turn token to it; a checkpoint whose end-of-turn token is not among its
EOS ids (Llama 3's ``<|eot_id|>`` beside an EOS ``<|end_of_text|>``) runs past it in both, unless the
caller passes ``eos_token_id``.  The reply is the generated tokens decoded, special tokens skipped.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from elx.runners.errors import ElxError
from elx.runners.inputs.text import TOKENIZER_DIR
from elx.runners.inputs.user_files import MAX_BYTES, read_user_file

RECORD = "chat_template"  # the manifest's section (exporter/tokenizer/chat_template.py writes it)
TEMPLATE_FILE = "chat_template.jinja"  # where transformers' save_pretrained writes a tokenizer's template
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' names, the one templates read first
_EXAMPLE = '[{"role": "user", "content": "Hello"}]'


# -- messages ------------------------------------------------------------------------------------------

def _kind(value) -> str:
    names = {dict: "an object", list: "a list", tuple: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), f"a {type(value).__name__}")


def _json_value(value, where: str):
    """``value`` as plain JSON data (str, int, float, bool, None, lists and string-keyed objects of them)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # a subclass's own methods stay out of the template's reach
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {str.__str__(key): _json_value(item, f"{where}.{key}") for key, item in value.items()}
    raise ElxError(f"{where} is {_kind(value)}, not JSON data (strings, numbers, booleans, lists, objects)")


def _message(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ElxError(f"{where} is {_kind(value)}, not a message: an object like {{\"role\": \"user\", \"content\": "
                       "\"...\"}")
    message = {key: item for key, item in _json_value(value, where).items() if item is not None}
    for key in ("role", "content"):
        if key not in message:
            raise ElxError(f"{where} has no {key!r}; a message is an object like {{\"role\": \"user\", \"content\": "
                           "\"...\"}")
        if not isinstance(message[key], str):
            what = " (elx chats in text)" if key == "content" else ""
            raise ElxError(f"{where}'s {key} is {_kind(message[key])} ({json.dumps(message[key])[:40]}), not a "
                           f"string{what}")
    reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
    if reasoning is not None:  # as transformers offers it: under "thinking" unless given, always "reasoning_content"
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def conversations(messages, where: str = "messages") -> list[list[dict]]:
    """``messages`` (one conversation, or a list of them) as a list of conversations of checked, plain messages."""
    if not isinstance(messages, (list, tuple)):
        raise ElxError(f"{where} is {_kind(messages)}; pass a list of messages like {_EXAMPLE}, or a list of such "
                       "lists (one per conversation)")
    if not messages:
        raise ElxError(f"{where} is an empty list; pass at least one message, like {_EXAMPLE}")
    if isinstance(messages[0], (list, tuple)):
        batch = list(messages)
        for i, conversation in enumerate(batch):
            if not isinstance(conversation, (list, tuple)):
                raise ElxError(f"{where}[{i}] is {_kind(conversation)}; a batch is a list of conversations, each a "
                               "list of messages")
        return [[_message(m, f"{where}[{i}][{j}]") for j, m in enumerate(c)] for i, c in enumerate(batch)]
    return [[_message(m, f"{where}[{j}]") for j, m in enumerate(messages)]]


def messages_from_file(path, option: str = "--messages", limit: int = MAX_BYTES) -> list[list[dict]]:
    """The conversations of a JSON file: a list of messages, or a list of such lists (checked, one line each)."""
    where = f"{option} {path}"
    data = read_user_file(path, option, limit)
    try:
        value = json.loads(data)
    except UnicodeDecodeError:
        raise ElxError(f"{where} is not UTF-8 text; save it as UTF-8 JSON")
    except json.JSONDecodeError as err:
        raise ElxError(f"{where} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); it holds a "
                       f"list of messages like {_EXAMPLE}")
    except ValueError as err:  # an integer of more digits than Python converts
        raise ElxError(f"{where} is not JSON elx can read ({str(err).splitlines()[0][:80]})")
    except RecursionError:
        raise ElxError(f"{where} is nested too deeply to read; a list of messages is two levels deep")
    if not isinstance(value, list):
        raise ElxError(f"{where} holds {_kind(value)}; it must hold a JSON list of messages like {_EXAMPLE}, or a "
                       "list of such lists")
    return conversations(value, where)


def user_turns(questions: list[str]) -> list[list[dict]]:
    """``--chat Q`` (repeatable): each question a conversation of one user message."""
    return [[{"role": "user", "content": question}] for question in questions]


# -- the export's template -------------------------------------------------------------------------------

def has_template(manifest) -> bool:
    """The export recorded a chat template (and has the tokenizer it goes with)."""
    return bool(manifest.data.get(RECORD)) and manifest.folder is not None and (
        Path(manifest.folder) / TOKENIZER_DIR / "tokenizer.json").is_file()


def missing_template(manifest, text_option: str = "text") -> ElxError:
    """Why an export cannot chat, and what to pass instead."""
    folder = manifest.folder or "this export"
    if not (manifest.folder and (Path(manifest.folder) / TOKENIZER_DIR / "tokenizer.json").is_file()):
        return ElxError(f"{folder} has no tokenizer, so no chat template; pass token ids instead")
    return ElxError(f"{folder} has no chat template (the model's tokenizer had none when it was exported); pass the "
                    f"prompt as {text_option}, written in the model's own format")


class Chat:
    """An export's chat template with its special tokens and tokenizer: messages → prompt ids, as transformers."""

    def __init__(self, source: str, special_tokens: dict, text, split_special_tokens: bool = False,
                 where: str = "the chat template"):
        from elx.runners.inputs.chat_environment import compile_template

        try:
            import jinja2  # noqa: F401 - a runtime dependency (pyproject); said in one line where it is missing
        except ImportError:
            raise ElxError("chat templates need the jinja2 package; install it: pip install 'jinja2>=3.1.6'")
        from jinja2.exceptions import TemplateSyntaxError

        try:
            self.template = compile_template(source)
        except TemplateSyntaxError as err:
            raise ElxError(f"{where} does not compile (line {err.lineno}: {err.message}); re-run 'elx export'")
        self.special_tokens = dict(special_tokens)
        self.text, self.split_special_tokens = text, bool(split_special_tokens)

    @classmethod
    def load(cls, manifest, text) -> "Chat":
        """The export's chat template (its manifest's ``chat_template`` section); else one line saying what to pass."""
        if not has_template(manifest) or text is None:
            raise missing_template(manifest)
        record = manifest.data[RECORD]
        path = Path(manifest.folder) / record["file"]
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            why = getattr(err, "strerror", None) or type(err).__name__
            raise ElxError(f"cannot read the chat template {path} ({why}); re-run 'elx export'")
        return cls(source, record["special_tokens"], text, record.get("split_special_tokens", False), str(path))

    def render(self, conversation: list[dict], index: int = 0) -> str:
        """The prompt text of one checked conversation (``conversations``), the assistant's turn opened."""
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=conversation, tools=None, documents=None, add_generation_prompt=True,
                                        **self.special_tokens)
        except TemplateError as err:
            if type(err) is TemplateError:  # raise_exception(message): the template refuses the conversation
                raise ElxError(f"the chat template refuses conversation {index}: {err.message}")
            raise ElxError(f"the chat template fails on conversation {index} ({type(err).__name__}: {err.message})")
        except Exception as err:  # noqa: BLE001 - a template is a program: whatever it raises, one line
            raise ElxError(f"the chat template fails on conversation {index} ({type(err).__name__}: {err})")

    def prompt_ids(self, messages, where: str = "messages") -> list[list[int]]:
        """Token ids of each conversation's prompt (``messages``: one conversation or a list of them)."""
        rendered = [self.render(c, i) for i, c in enumerate(conversations(messages, where))]
        tokenizer = self.text.tokenizer
        before = tokenizer.encode_special_tokens
        tokenizer.encode_special_tokens = self.split_special_tokens  # the tokenizer's split_special_tokens, as HF
        try:
            encodings = tokenizer.encode_batch(rendered, add_special_tokens=False)
        finally:
            tokenizer.encode_special_tokens = before
        return [encoding.ids for encoding in encodings]


def replies(text, sequences, rules, settings, inputs: dict) -> list[str]:
    """The assistant's reply in each returned row (``sequences``, HF's layout): the tokens after the prompt, decoded,
    special tokens skipped.  A decoder-only row begins with the (left-padded) prompt; an encoder-decoder row holds
    only the decoder's tokens (``rules``: the family's, ``runners/families.py``)."""
    width = int(inputs["input_ids"].shape[1]) if rules.prompt_length(settings) is None else 0
    return text.decode(np.asarray(sequences)[:, width:])
