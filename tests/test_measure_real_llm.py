"""tools/measure_real_llm.py's own logic (the measurement itself runs real models: see its docstring).

* Its prompts: hypothesis draws texts and lengths; a prompt ``chat_prompt`` returns is exactly that long and is
  what transformers' ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)`` gives for a user turn
  whose content starts ``text`` (SmolLM2's ChatML template, a byte-level BPE trained in tests/test_chat.py).
* Its comparison: the first differing step of each row, a shorter row differing where it ends.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_chat import CORPUS, _hf_tokenizer
from tests.tools_loader import load_tool

WORDS = sorted({w for line in CORPUS for w in line.split()})


@pytest.fixture(scope="module")
def tool():
    return load_tool("measure_real_llm")


@pytest.fixture(scope="module")
def tokenizer():
    return _hf_tokenizer("chatml")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=60), extra=st.integers(1, 80))
def test_chat_prompt_is_exact_and_transformers_own(tool, tokenizer, words, extra):
    text = " ".join(words)
    length = _overhead(tokenizer) + extra
    found = tool.chat_prompt(tokenizer, text, length)
    if found is None:  # too short a text, or no token boundary lands on the length
        return
    ids, content = found
    assert len(ids) == length
    assert text.startswith(content) and content
    assert ids == list(tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False))


def _overhead(tokenizer) -> int:
    """The template's own tokens (the default system message, the turn markers) around an empty user turn."""
    return len(tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False))


def test_chat_prompt_found_for_long_english_texts(tool, tokenizer):
    """Plain English always has a cut of the right length (the real articles are ASCII); a byte-level BPE's
    multi-byte characters can make a length unreachable (3 ids for one CJK character), where the tool goes on to
    the next article."""
    text = " ".join(line for line in CORPUS if line.isascii())
    for extra in (1, 10, 64, 200):
        ids, content = tool.chat_prompt(tokenizer, text, _overhead(tokenizer) + extra)
        assert len(ids) == _overhead(tokenizer) + extra


def test_compare_names_the_first_differing_step(tool):
    reference = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]]
    result = tool.compare([[5, 6, 7, 8], [5, 9, 7, 1], [5, 6, 7]], reference)
    assert result == {"equal_rows": 1, "rows": 3, "first_diff": [None, 1, 3]}
    assert tool.compare([[1]], None)["equal_rows"] is None


def test_step_bench_feeds_an_exported_step_graph_with_the_shapes_it_names(exported, capsys):
    """tools/step_bench.py (the greedy-gap measurement of docs/measurements/real_smollm2_2026-11-29.md): its feeds
    fit the step graph's inputs (prompt cache ``--prompt`` long, past ``--past`` long, one token) and a run prints
    its line."""
    import onnxruntime as ort

    bench = load_tool("step_bench")
    graph = exported("llama") / "decoder.onnx"
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    feeds = bench.feeds_for(session, prompt=7, past=3)
    assert feeds["prompt_key_values.0.key"].shape[2] == 7 and feeds["past_key_values.0.key"].shape[2] == 3
    assert feeds["input_ids"].shape == (1, 1)
    present = session.run(["present.0.key"], feeds)[0]
    assert present.shape[2] == 4  # the past and the new token
    assert bench.main([str(graph), "--runs", "3", "--threads", "1"]) == 0
    assert "median" in capsys.readouterr().out
