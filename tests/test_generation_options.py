"""Every argument of the installed transformers' ``GenerationConfig`` is implemented or refused (issue 25 item 1).

The fields are enumerated from the installed class, so a transformers release that adds one fails
``test_every_field_is_placed`` until ``runners/options.py`` places it.  HF's default value of every field is
accepted and changes nothing; the modes transformers 5.24 itself only runs from the Hub are refused as HF
refuses them; no-op fields give the same tokens as without them.  The runs use elx's search on HF's own
float64 logits (``tests/differential.py``: no export), against HF ``generate`` on the same model.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import METADATA_FIELDS

from elx.runners import options as catalog
from elx.runners.errors import ElxError
from elx.runners.generate import Generator
from elx.runners.search.settings import GenerationSettings
from tests.differential import bare_manifest, build_fp64, hf_search, search_backend

FIELDS = sorted(k for k in GenerationConfig().to_dict() if k not in METADATA_FIELDS)
T5 = dict(vocab_size=64, d_model=16, d_kv=4, num_heads=4, d_ff=16, num_layers=1, num_decoder_layers=1,
          initializer_factor=2.0)


@pytest.fixture(scope="module")
def t5():
    torch.set_num_threads(1)
    model = build_fp64("t5", 5, T5)
    ids = np.random.default_rng(5).integers(2, 64, size=(2, 6))
    return model, Generator(search_backend(model, bare_manifest(model))), {"input_ids": ids,
                                                                          "attention_mask": np.ones_like(ids)}


def test_every_field_is_placed():
    """Each field is a setting or a no-op/refused entry, in exactly one place, with a reason where it is no setting."""
    for name in FIELDS:
        places = [name in catalog.SETTINGS, name in catalog.NO_OPS]
        assert sum(places) == 1, f"GenerationConfig field {name!r} is not placed in runners/options.py"
    settings_fields = {f for f in GenerationSettings.__dataclass_fields__}
    assert set(catalog.SETTINGS) <= settings_fields
    assert all(catalog.NO_OPS[name] or catalog.refusal({name: True}) or catalog.refusal({name: [1]})
               for name in catalog.NO_OPS), "a no-op needs its reason, a refused field its refusal"


def test_hf_defaults_never_error_and_change_nothing(t5):
    model, generator, inputs = t5
    defaults = GenerationConfig._get_default_generation_params()
    baseline = generator.generate(inputs, max_new_tokens=6).sequences
    for name in FIELDS:
        value = defaults.get(name)
        if value is None or name in ("max_length",):
            continue
        out = generator.generate(inputs, **{"max_new_tokens": 6, name: value})
        np.testing.assert_array_equal(out.sequences, baseline, err_msg=name)


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(repetition_penalty=1.0), dict(top_k=50),
                                     dict(top_p=0.3, temperature=0.2), dict(use_cache=False),
                                     dict(cache_implementation="static"), dict(num_beam_groups=1),
                                     dict(diversity_penalty=0.5), dict(penalty_alpha=0.6, num_beams=2),
                                     dict(dola_layers="low", num_beams=2), dict(low_memory=True),
                                     dict(trust_remote_code=True), dict(num_assistant_tokens=5)],
                         ids=lambda o: ",".join(o))
def test_values_hf_ignores_are_accepted(t5, options):
    """What HF ignores for the run (sampling knobs without do_sample, parameters of other modes) changes nothing."""
    model, generator, inputs = t5
    run = dict(max_new_tokens=6, num_beams=options.pop("num_beams", 1), **options)
    hf, _ = hf_search(model, inputs, {k: v for k, v in run.items() if k != "trust_remote_code"}, 64)
    np.testing.assert_array_equal(generator.generate(inputs, **run).sequences, hf)


HUB_MODES = [dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), dict(penalty_alpha=0.6, top_k=4),
             dict(dola_layers="low"), dict(num_beams=2, force_words_ids=[[5]]), dict(num_beams=2, constraints=[])]


@pytest.mark.parametrize("options", HUB_MODES, ids=lambda o: ",".join(o))
def test_hub_modes_refused_as_hf_refuses_them(t5, options):
    model, generator, inputs = t5
    with pytest.raises(ValueError, match="trust_remote_code"):
        hf_search(model, inputs, dict(options, max_new_tokens=4), 64)
    field = {"num_beam_groups": "num_beam_groups", "penalty_alpha": "penalty_alpha", "dola_layers": "dola_layers",
             "force_words_ids": "force_words_ids", "constraints": "constraints"}
    with pytest.raises(ElxError, match="trust_remote_code") as err:
        generator.generate(inputs, max_new_tokens=4, **options)
    assert any(name in str(err.value) for name in field) and "\n" not in str(err.value)


@pytest.mark.parametrize("options,field", [
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(output_hidden_states=True), "output_hidden_states"), (dict(guidance_scale=1.5), "guidance_scale"),
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"), (dict(use_mtp=True), "use_mtp"),
    (dict(watermarking_config={"bias": 2.0}), "watermarking_config"), (dict(token_healing=True), "token_healing"),
    (dict(cache_implementation="quantized"), "quantized"), (dict(num_beams=2, low_memory=True), "low_memory"),
    (dict(is_assistant=True), "is_assistant"), (dict(assistant_model=object()), "assistant_model"),
    (dict(negative_prompt_ids=[[1]]), "negative_prompt_ids"), (dict(synced_gpus=True), "synced_gpus"),
    (dict(custom_generate="x/y"), "custom_generate"), (dict(bogus=1), "bogus"),
    (dict(generation_config=GenerationConfig(output_hidden_states=True)), "output_hidden_states"),
])
def test_refusals_name_the_option(t5, options, field):
    _, generator, inputs = t5
    with pytest.raises(ElxError, match=field) as err:
        generator.generate(inputs, max_new_tokens=4, **options)
    assert "\n" not in str(err.value)


def test_generation_config_argument_is_a_base_under_the_options(t5):
    """HF: a passed ``generation_config`` replaces the model's; keyword options override it."""
    model, generator, inputs = t5
    config = GenerationConfig(num_beams=3, max_new_tokens=5, repetition_penalty=1.5)
    hf, _ = hf_search(model, inputs, dict(generation_config=config, num_beams=2), 64)
    out = generator.generate(inputs, generation_config=config, num_beams=2)
    assert out.settings.num_beams == 2 and out.settings.repetition_penalty == 1.5
    np.testing.assert_array_equal(out.sequences, hf)


def test_explicit_none_switches_a_knob_off_as_in_hf():
    """HF's ``update`` sets an explicit None: with a model config of ``top_k=2``, ``top_k=None`` samples from every
    token, while leaving it unset keeps the model's 2."""
    model = build_fp64("t5", 5, T5)
    model.generation_config.update(do_sample=True, top_k=2, temperature=3.0)
    generator = Generator(search_backend(model, bare_manifest(model)))
    ids = np.random.default_rng(5).integers(2, 64, size=(2, 6))
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    answers = []
    for run in (dict(seed=3, max_new_tokens=8), dict(seed=3, max_new_tokens=8, top_k=None)):
        hf, _ = hf_search(model, inputs, run, 64)
        out = generator.generate(inputs, **run)
        np.testing.assert_array_equal(out.sequences, hf)
        answers.append(out)
    assert answers[0].settings.top_k == 2 and answers[1].settings.top_k == 0
    assert not np.array_equal(answers[0].sequences, answers[1].sequences)
