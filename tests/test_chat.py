"""Chat (issue 39 part 4): messages prompted through the checkpoint's chat template, as transformers does it.

* Rendering and ids: hypothesis draws conversations (system/user/assistant, unicode contents, special-token
  strings inside contents, multi-turn, with and without a system message, extra keys and reasoning fields)
  and elx's rendering and ids must be ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``'s
  on four templates written here: ChatML as SmolLM2 ships it, a Llama 3 style one (``bos_token``, header
  ids; its tokenizer's post-processor adds a BOS, which must not come twice), a Mistral style one that
  ``raise_exception``-s on roles out of order or a system message (elx must raise ``ElxError`` with the
  template's message where transformers raises), and one using what transformers' environment offers
  (``namespace``, ``dict``, ``tojson``, loop controls, ``{% generation %}``, ``strftime_now``, trimmed blocks).
  The tokenizers are trained here with the ``tokenizers`` library (byte-level BPE and a Metaspace BPE).
* End to end on a tiny random Llama with SmolLM2's ChatML template and ids (eos = pad = ``<|im_end|>``):
  ``elx generate --chat`` equals HF ``generate`` on ``apply_chat_template``'s ids (greedy, beam 2), a batch of two
  conversations equals HF's left-padded batch, ``--stream`` prints the reply, an EOS other than the
  end-of-turn token runs past it as in HF, and the bad inputs are refused in one line.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elx.runners.errors import ElxError
from elx.runners.inputs.chat import Chat, conversations
from elx.runners.inputs.text import Text
from elx.runners.inputs.user_files import read_user_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ids 0, 1, 2 as in SmolLM2's vocabulary (<|endoftext|>, <|im_start|>, <|im_end|>), then the other families' tokens
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "<unk>", "[INST]", "[/INST]"]
CORPUS = ["Hello! How are you today? I am fine, thank you.", "What is the capital of France? Paris, of course.",
          "naïve café — déjà vu, 東京 and façade; Straße, ñandú, Ωmega 🙂", "system user assistant: you are helpful",
          "  spaced   out\ttabs\nand new lines\n\n", "1 + 2 = 3; 10 * 10 = 100 {json: [\"a\", 'b']} <tag> & more"] * 4

# ChatML as SmolLM2-Instruct ships it: a default system message when the conversation has none
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3 style: BOS written by the template, a header per message, contents trimmed, <|eot_id|> ends a turn
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
          " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Mistral style: user and assistant must alternate, starting with the user; no system role
MISTRAL = ("{{ bos_token }}{% for message in messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# what transformers' environment offers, laid out on lines (trim_blocks / lstrip_blocks decide the whitespace)
FEATURES = """\
{%- set ns = namespace(system=none, turns=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- set ns.system = message.content %}
        {%- continue %}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
{%- endfor %}
{{ bos_token }}
{% if ns.system is not none %}
<|im_start|>system
{{ ns.system | tojson }} ({{ strftime_now('%Y') | length }} digits)<|im_end|>
{% endif %}
{% for message in messages if message.role != 'system' %}
    {% if loop.index > 5 %}{% break %}{% endif %}
<|im_start|>{{ message.role }} {{ dict(turn=loop.index, of=ns.turns) | tojson(sort_keys=true) }}
    {% if message.name is defined %}
({{ message.name }})
    {% endif %}
    {% if message.role == 'assistant' %}
        {% if message.reasoning_content is defined %}
<think>{{ message.reasoning_content }}|{{ message.thinking | length }}</think>
        {% endif %}
{% generation %}{{ message.content | tojson(indent=1) }}{% endgeneration %}<|im_end|>
    {% else %}
{{ message.content }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
TEMPLATES = {  # name: (template, tokenizer kind, special tokens, BOS added by the post-processor)
    "chatml": (CHATML, "byte", dict(bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                    pad_token="<|im_end|>"), None),
    "llama3": (LLAMA3, "byte", dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"), "<|begin_of_text|>"),
    "mistral": (MISTRAL, "metaspace", dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"), "<s>"),
    "features": (FEATURES, "byte", dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                        pad_token="<|endoftext|>"), None),
}


def _tokenizer(kind: str, bos: str | None):
    """A small BPE trained on CORPUS: byte-level (GPT-2's, Llama 3's scheme) or Metaspace (sentencepiece's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None if kind == "byte" else "<unk>"))
    if kind == "byte":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=340, special_tokens=SPECIAL, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(CORPUS, trainer)
    if bos is not None:  # as Llama's tokenizer.json: BOS first when special tokens are added
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                                 special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return tokenizer


def _hf_tokenizer(name: str):
    from transformers import PreTrainedTokenizerFast

    template, kind, special, bos = TEMPLATES[name]
    return PreTrainedTokenizerFast(tokenizer_object=_tokenizer(kind, bos), chat_template=template, **special)


def _exported_tokenizer(source: Path, export: Path):
    """The source folder's tokenizer saved into an export folder as ``elx export`` saves it, its chat record made:
    (HF's tokenizer loaded from the source, elx's Chat on the export)."""
    from transformers import AutoTokenizer

    from elx.exporter.tokenizer.chat_template import save_chat_template
    from elx.exporter.export import copy_tokenizer

    assert copy_tokenizer(str(source), export)
    record = save_chat_template(export, str(source))
    assert record is not None and (export / record["file"]).is_file()
    chat = Chat((export / record["file"]).read_text(encoding="utf-8"), record["special_tokens"], Text.load(export),
                record["split_special_tokens"])
    return AutoTokenizer.from_pretrained(source), chat, record


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Per template: (HF's tokenizer from its folder, elx's Chat from the export's tokenizer/ and record)."""
    root = tmp_path_factory.mktemp("chat-templates")
    out = {}
    for name in TEMPLATES:
        _hf_tokenizer(name).save_pretrained(root / name)
        out[name] = _exported_tokenizer(root / name, root / f"{name}-export")
    return out


# -- rendering and ids, against transformers -------------------------------------------------------

CONTENT = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", " ", "  hello  ", "\n", "What is 2 + 2?", "東京 déjà vu 🙂", "<|im_end|>", "a<|eot_id|>b",
                     "[INST] x [/INST]", "</s>", "{{ bos_token }}", "{% raw %}", "<tag> & 'quotes' \"dq\"", "\\u00e9"]),
    st.lists(st.sampled_from(["Hello", " ", "東京", "<|im_start|>", "\t", "world", "<s>", "!"]), max_size=6).map("".join))
EXTRA = st.fixed_dictionaries({}, optional={"name": st.one_of(st.none(), st.sampled_from(["ann", "bo b"])),
                                            "reasoning": st.text(max_size=8), "thinking": st.text(max_size=8),
                                            "reasoning_content": st.one_of(st.none(), st.text(max_size=8))})


@st.composite
def messages(draw):
    """A conversation: alternating user/assistant turns ending with the user (an optional system message
    first), or roles in any order."""
    if draw(st.booleans()):
        turns = draw(st.integers(0, 3))
        roles = (["system"] if draw(st.booleans()) else []) + ["user", "assistant"] * turns + ["user"]
    else:
        roles = draw(st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1, max_size=5))
    return [{"role": role, "content": draw(CONTENT), **draw(EXTRA)} for role in roles]


def _hf(tokenizer, conversation):
    """transformers' rendering and ids, or the error it raises."""
    try:
        return (tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
                list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)))
    except Exception as err:  # noqa: BLE001 - compared with elx's refusal below
        return err


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(batch=st.lists(messages(), min_size=1, max_size=3))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_rendering_and_ids_are_transformers(templates, name, batch):
    import jinja2

    hf, chat, _ = templates[name]
    expected = [_hf(hf, conversation) for conversation in batch]
    for conversation, want in zip(batch, expected):
        if isinstance(want, Exception):
            assert isinstance(want, jinja2.TemplateError), want  # these templates fail only by raise_exception
            with pytest.raises(ElxError) as info:
                chat.prompt_ids(conversation)
            assert want.message in str(info.value) and "\n" not in str(info.value)
        else:
            assert chat.render(conversations(conversation)[0]) == want[0]
            assert chat.prompt_ids(conversation) == [want[1]]
    if not any(isinstance(want, Exception) for want in expected):  # a batch: the same ids, row by row
        assert chat.prompt_ids(batch) == list(hf.apply_chat_template(batch, add_generation_prompt=True,
                                                                     return_dict=False))


def test_the_template_writes_the_bos_once(templates):
    """Llama 3's tokenizer adds a BOS to plain text; the template writes one; the prompt holds it once."""
    hf, chat, _ = templates["llama3"]
    ids = chat.prompt_ids([{"role": "user", "content": "Hello"}])[0]
    bos = hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1
    assert hf("Hello")["input_ids"][0] == bos  # the tokenizer does add it to plain text


def test_the_record_holds_transformers_special_tokens(templates):
    for name, (hf, _, record) in templates.items():
        assert record["special_tokens"] == hf.special_tokens_map and record["split_special_tokens"] is False
        assert record["file"] == "tokenizer/chat_template.jinja"


def test_the_sandbox_and_the_namespace_refuse_what_transformers_refuses(templates):
    """A template reaching for Python internals, or an underscore attribute on a namespace, fails in both (one line)."""
    import jinja2

    hf, _, record = templates["chatml"]
    for template in ("{{ messages.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}{{ ns._x }}",
                     "{% set ns = namespace() %}{% set ns._y = 2 %}", "{{ messages.append(1) }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            hf.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template, tokenize=False)
        chat = Chat(template, record["special_tokens"], None)
        with pytest.raises(ElxError, match="fails on conversation 0 \\(SecurityError") as info:
            chat.render(conversations([{"role": "user", "content": "x"}])[0])
        assert "\n" not in str(info.value)


def test_export_stops_when_elx_would_render_otherwise(tmp_path, monkeypatch):
    """The export's end-to-end check can fail: ids other than transformers' stop it in one line."""
    from elx.exporter.tokenizer.chat_template import save_chat_template
    from elx.exporter.export import copy_tokenizer

    _hf_tokenizer("chatml").save_pretrained(tmp_path / "source")
    assert copy_tokenizer(str(tmp_path / "source"), tmp_path / "export")
    monkeypatch.setattr(Chat, "prompt_ids", lambda self, messages, where="messages": [[5, 6, 7]])
    with pytest.raises(ElxError, match="other token ids than transformers"):
        save_chat_template(tmp_path / "export")


def test_no_template_no_record(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from elx.exporter.tokenizer.chat_template import save_chat_template
    from elx.exporter.export import copy_tokenizer

    PreTrainedTokenizerFast(tokenizer_object=_tokenizer("byte", None), eos_token="</s>").save_pretrained(tmp_path / "s")
    assert copy_tokenizer(str(tmp_path / "s"), tmp_path / "export")
    assert save_chat_template(tmp_path / "export") is None


@pytest.mark.parametrize("value,message", [
    ("hello", "is a string; pass a list of messages"),
    ([], "is an empty list"),
    ([{"role": "user"}], "has no 'content'"),
    ([{"content": "x"}], "has no 'role'"),
    ([{"role": 5, "content": "x"}], "role is a number"),
    ([{"role": "user", "content": ["x"]}], "content is a list"),
    ([{"role": "user", "content": None}], "has no 'content'"),
    (["user: hi"], "is a string, not a message"),
    ([[{"role": "user", "content": "x"}], {"role": "user", "content": "y"}], r"messages\[1\] is an object"),
    ([{"role": "user", "content": "x", "extra": object()}], "not JSON data"),
])
def test_bad_messages_are_refused_in_one_line(value, message):
    with pytest.raises(ElxError, match=message) as info:
        conversations(value)
    assert "\n" not in str(info.value)


# -- reading the user's file ----------------------------------------------------------------------------------

def test_user_files_refuse_what_is_no_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((tmp_path, "is a directory"), (fifo, "is a FIFO"), ("/dev/zero", "is a character device"),
                       (tmp_path / "missing.json", "no such file")):
        with pytest.raises(ElxError, match=kind):
            read_user_file(path, "--messages")
    small = tmp_path / "small.json"
    small.write_bytes(b"x" * 100)
    assert read_user_file(small, "--messages") == b"x" * 100
    assert read_user_file(small, "--messages", limit=100) == b"x" * 100
    with pytest.raises(ElxError, match="more than elx reads \\(99 bytes\\)"):
        read_user_file(small, "--messages", limit=99)


# -- end to end on a tiny Llama with SmolLM2's chat layout -----------------------------------------------------

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Llama with SmolLM2-Instruct's special ids (BOS <|im_start|> 1, EOS = pad = <|im_end|> 2) and
    its ChatML template; <|im_end|>'s output row scaled so that replies end now and then.  (model, tokenizer,
    export folder)."""
    from transformers import AutoTokenizer

    from elx.exporter.export import export_model
    from tests.conftest import BUILDERS

    root = tmp_path_factory.mktemp("chat-llama")
    tokenizer = _hf_tokenizer("chatml")
    torch.manual_seed(3)
    model = BUILDERS["llama"](vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=2,
                              num_hidden_layers=1).eval()
    with torch.no_grad():
        model.lm_head.weight[2] *= 3.0
    model.save_pretrained(root / "source")
    tokenizer.save_pretrained(root / "source")
    folder = export_model(str(root / "source"), root / "export", quiet=True)
    return model, AutoTokenizer.from_pretrained(root / "source"), folder


def _cli(capsys, *args) -> tuple[int, str, str]:
    from elx.cli import main

    capsys.readouterr()
    code = main(["generate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def _hf_generate(model, tokenizer, batch, **options):
    tokenizer.padding_side = "left"
    inputs = tokenizer.apply_chat_template(batch, add_generation_prompt=True, padding=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, **options)
    width = inputs["input_ids"].shape[1]
    return out.numpy(), inputs["attention_mask"].numpy(), tokenizer.batch_decode(out[:, width:],
                                                                                skip_special_tokens=True)


def test_the_export_records_the_template(chat_model, exported):
    from elx.runners.manifest import Manifest

    _, tokenizer, folder = chat_model
    record = Manifest.load(folder).data["chat_template"]
    assert record["special_tokens"] == tokenizer.special_tokens_map
    assert (folder / record["file"]).read_text(encoding="utf-8") == CHATML
    assert "chat_template" not in Manifest.load(exported("llama")).data  # no tokenizer, no template


@pytest.mark.parametrize("beams", [1, 2])
def test_cli_chat_equals_hf_generate(chat_model, capsys, beams):
    model, tokenizer, folder = chat_model
    hf, _, replies = _hf_generate(model, tokenizer, [[{"role": "user", "content": QUESTION}]], max_new_tokens=12,
                                  num_beams=beams)
    code, out, err = _cli(capsys, folder, "--chat", QUESTION, "--max-new-tokens", 12, "--num-beams", beams,
                          "--format", "jsonl")
    assert code == 0, err
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["tokens"] == hf[0].tolist() and row["text"] == replies[0]
    code, out, err = _cli(capsys, folder, "--chat", QUESTION, "--max-new-tokens", 12, "--num-beams", beams)
    assert code == 0, err
    assert out.startswith("input 0, hypothesis 0") and out.split("\n", 1)[1] == f"    {replies[0]}\n"


BATCH = [[{"role": "user", "content": "Hi!"}],
         [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": QUESTION},
          {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Japan? 東京?"}]]


@pytest.mark.parametrize("beams", [1, 2])
def test_a_batch_of_conversations_equals_hf_left_padded(chat_model, beams):
    from elx.runners.generate import Generator

    model, tokenizer, folder = chat_model
    hf, mask, replies = _hf_generate(model, tokenizer, BATCH, max_new_tokens=10, num_beams=beams)
    assert mask[0, 0] == 0  # the short conversation is left-padded
    out = Generator.from_folder(folder).generate(messages=BATCH, max_new_tokens=10, num_beams=beams)
    np.testing.assert_array_equal(out.sequences, hf)
    assert out.text == replies


def test_cli_messages_file_batch(chat_model, capsys, tmp_path):
    model, tokenizer, folder = chat_model
    hf, mask, replies = _hf_generate(model, tokenizer, BATCH, max_new_tokens=8)
    (tmp_path / "chat.json").write_text(json.dumps(BATCH, ensure_ascii=False), encoding="utf-8")
    code, out, err = _cli(capsys, folder, "--messages", tmp_path / "chat.json", "--max-new-tokens", 8,
                          "--format", "jsonl")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["tokens"] for r in rows] == [row[m.argmax():].tolist() for row, m in zip(hf, mask)]  # less the padding
    assert [r["text"] for r in rows] == replies


def test_an_eos_other_than_the_end_of_turn_runs_past_it_as_in_hf(chat_model):
    """Generation stops at the generation config's EOS: with <|endoftext|> as EOS, <|im_end|> (the template's end
    of turn) is generated and passed over, in HF as in elx."""
    from elx.runners.generate import Generator

    model, tokenizer, folder = chat_model
    conversation = [[{"role": "user", "content": QUESTION}]]
    hf, _, _ = _hf_generate(model, tokenizer, conversation, max_new_tokens=24, eos_token_id=0)
    width = len(tokenizer.apply_chat_template(conversation[0], add_generation_prompt=True, return_dict=False))
    assert 2 in hf[0, width:-1].tolist()  # <|im_end|> generated, and generation went on
    out = Generator.from_folder(folder).generate(messages=conversation, max_new_tokens=24, eos_token_id=0)
    np.testing.assert_array_equal(out.sequences, hf)
    stopped = Generator.from_folder(folder).generate(messages=conversation, max_new_tokens=24)
    assert stopped.sequences.shape[1] < hf.shape[1] and stopped.sequences[0, -1] == 2  # the config's EOS: <|im_end|>


def test_stream_prints_the_reply(chat_model, capsys):
    model, tokenizer, folder = chat_model
    _, _, replies = _hf_generate(model, tokenizer, [[{"role": "user", "content": QUESTION}]], max_new_tokens=12)
    code, out, err = _cli(capsys, folder, "--chat", QUESTION, "--max-new-tokens", 12, "--stream")
    assert code == 0, err
    assert out.startswith(replies[0] + "\n") and out.splitlines()[-1].startswith("input 0, hypothesis 0: ")


# -- refusals: one line, exit 2, nothing printed -------------------------------------------------------------------

def _refused(capsys, *args, match: str):
    code, out, err = _cli(capsys, *args)
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("elx: error: ") and err.count("\n") == 1 and match in err, err
    return err


@pytest.mark.parametrize("content,match", [
    ("{", "is not valid JSON"),
    ('{"role": "user", "content": "x"}', "holds an object; it must hold a JSON list"),
    ('[{"role": 1, "content": "x"}]', "[0]'s role is a number"),
    ('[{"role": "user"}]', "[0] has no 'content'"),
    ('[{"role": "user", "content": 42}]', "[0]'s content is a number (42), not a string"),
    ("[]", "is an empty list"),
    ('[[{"role": "user", "content": "x"}], [{"role": "user", "content": {"a": 1}}]]', "[1][0]'s content is an object"),
])
def test_bad_messages_files(chat_model, capsys, tmp_path, content, match):
    (tmp_path / "m.json").write_text(content)
    _refused(capsys, chat_model[2], "--messages", tmp_path / "m.json", match=match)


def test_messages_naming_no_regular_file(chat_model, capsys, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    with open(big, "wb") as handle:  # sparse: 17 MiB on paper, nothing on disk
        handle.truncate(17 * 1024 * 1024)
    for path, match in ((tmp_path, "is a directory"), (fifo, "is a FIFO"), ("/dev/zero", "is a character device"),
                        (big, "more than elx reads (16 MiB)")):
        _refused(capsys, chat_model[2], "--messages", path, match=match)


def test_chat_with_another_input_is_refused(chat_model, capsys):
    folder = chat_model[2]
    _refused(capsys, folder, "--chat", "hi", "--text", "hi", match="not allowed with argument")
    _refused(capsys, folder, "--input-ids", "5 6", "--chat", "hi", match="not allowed with argument")
    _refused(capsys, folder, "--chat", "hi", "--messages", "x.json", match="not allowed with argument")


def test_chat_on_an_export_without_a_template(chat_model, capsys, tmp_path, exported):
    folder = tmp_path / "no-template"
    shutil.copytree(chat_model[2], folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["chat_template"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _refused(capsys, folder, "--chat", "hi", match="has no chat template")
    assert "--text" in _refused(capsys, folder, "--chat", "hi", match="pass the prompt as --text")
    _refused(capsys, exported("llama"), "--chat", "hi", match="has no tokenizer")
    from elx.runners.generate import Generator

    with pytest.raises(ElxError, match="has no chat template"):
        Generator.from_folder(folder).generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=2)


def test_python_api_refusals(chat_model):
    from elx.runners.generate import Generator

    generator = Generator.from_folder(chat_model[2])
    with pytest.raises(ElxError, match="exactly one of"):
        generator.generate(messages=[{"role": "user", "content": "hi"}], text="hi", max_new_tokens=2)
    with pytest.raises(ElxError, match="is a string; pass a list of messages"):
        generator.generate(messages="hi", max_new_tokens=2)
    with pytest.raises(ElxError, match="content is a list"):
        generator.generate(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_new_tokens=2)


def test_chat_runs_without_torch_or_transformers(chat_model, tmp_path):
    from tests.test_runtime_imports import _run

    proc = _run(tmp_path, """
        import json, sys, elx
        g = elx.Generator.from_folder(sys.argv[1])
        out = g.generate(messages=[{"role": "user", "content": "Hi!"}], max_new_tokens=4)
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        print(json.dumps(out.sequences.tolist()))
        """, str(chat_model[2]))
    assert proc.returncode == 0, proc.stderr
    model, tokenizer, _ = chat_model
    hf, _, _ = _hf_generate(model, tokenizer, [[{"role": "user", "content": "Hi!"}]], max_new_tokens=4)
    assert json.loads(proc.stdout) == hf.tolist()


def test_chat_refusals_come_before_heavy_imports(chat_model, tmp_path):
    """Counted, not timed (as tests/test_fast_refusals.py): each refusal above comes before PyTorch, transformers,
    onnx and ONNX Runtime are imported."""
    import subprocess
    import sys

    from tests.test_fast_refusals import HEAVY, ROOT, RUNNER

    folder, bare = str(chat_model[2]), tmp_path / "no-template"
    shutil.copytree(folder, bare)
    manifest = json.loads((bare / "manifest.json").read_text())
    del manifest["chat_template"]
    (bare / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "bad.json").write_text('[{"role": "user", "content": 1}]')
    os.mkfifo(tmp_path / "fifo")
    cases = [(["generate", folder, "--messages", str(tmp_path / "bad.json")], "content is a number"),
             (["generate", folder, "--messages", str(tmp_path / "fifo")], "is a FIFO"),
             (["generate", folder, "--messages", "/dev/zero"], "is a character device"),
             (["generate", folder, "--messages", str(tmp_path)], "is a directory"),
             (["generate", folder, "--chat", "hi", "--text", "hi"], "not allowed with argument"),
             (["generate", str(bare), "--chat", "hi"], "has no chat template")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([argv for argv, _ in cases]), json.dumps(HEAVY)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for (argv, fragment), result in zip(cases, json.loads(proc.stdout)):
        err = result["err"].strip()
        assert result["code"] == 2 and err.startswith("elx: error:") and "\n" not in err and fragment in err, result
        assert result["heavy"] == [], (argv, result["heavy"])
