"""``--pass el-self`` on GPT-2 (decoder-only): the prompt's X at batch B shared by the beams, the generated X per beam.

A tiny random GPT-2 with sharper attention (initializer_range 0.1) and every bias drawn from
N(0, 0.5²) (HF initializes them to zero, which would hide b_K and b_V handling), exported in both
prompt-cache forms.  Checked: the fused c_attn split (W_K, W_V are its column blocks), the
rewritten graphs against the originals (≤ 1e-4, also at shapes the pass did not verify; the
check notices a wrong b_V), the manifest's layout (prefill outputs X_p, the step reads it at
batch B, the cache holds X per beam), the math of b_K's cancellation over the concatenated
[prompt ; generated] softmax, token identity with HF ``generate`` (greedy, beams 1/3/4,
num_return_sequences > 1, n-gram blocking, left-padded prompts of different lengths), the live
bytes (exactly D/(2·h·d_k) = 1/2 of the baseline's, prompt and generated parts), and refusals.
"""
from __future__ import annotations

import re
import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from elx.exporter.verification.compare import compare
from elx.exporter.export import apply_passes, export_model
from elx.exporter.passes import el_self
from elx.exporter.passes import el_self_decoder_only as decoder_only
from elx.exporter.passes.rewrite import load_graph
from elx.exporter.verification.verify import TOLERANCE, Shape, verify_rewrite
from elx.runners.errors import ElxError
from elx.runners.generate import Generator
from elx.runners.inputs.random_inputs import random_inputs
from elx.runners.manifest import Manifest

EOS = 511
CONFIG = dict(vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=EOS, eos_token_id=EOS,
              initializer_range=0.1)
FORMS = ("shared", "per-beam")
EXTRA_SHAPES = (Shape(1, 5, 3, 0), Shape(5, 1, 13, 9), Shape(2, 2, 20, 1), Shape(3, 4, 6, 12))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """{"folder": the model, form: (baseline export, el-self export) for both prompt-cache forms}."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("el_self_gpt2")
    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(root / "model")
    out = {"folder": root / "model", "model": model}
    for form in FORMS:
        base = export_model(str(root / "model"), root / f"base-{form}", quiet=True, prompt_cache=form)
        out[form] = (base, apply_passes(base, root / f"el-self-{form}", "el-self"))
    return out


def _record(folder) -> dict:
    return next(p for p in Manifest.load(folder).passes if p["name"] == el_self.NAME)


def _matched(folder) -> list:
    """The original step graph's layers, matched (their projections, for consistent pasts)."""
    manifest = Manifest.load(folder)
    dims = manifest.dims
    graph = load_graph(manifest, manifest.step)
    layers = decoder_only.layers_of(manifest)
    for layer in layers:
        if layer.prompt_key is not None:
            decoder_only.match_shared(graph, layer, dims["d_model"], dims["num_heads"], dims["d_kv"])
        else:
            el_self.match(graph, layer, dims["d_model"], dims["num_heads"], dims["d_kv"])
    return layers


# -- the math, without graphs --------------------------------------------------------------------------

def test_bias_identities_over_the_concatenated_softmax():
    """b_K drops out of softmax([s_p ; s_g]) because q·b_K shifts both parts equally; b_V is added once
    because the rows of [A_p ; A_g] sum to 1.  Dropping b_K from one part only, or adding b_V to both, is wrong."""
    rng = np.random.default_rng(0)
    d_model, d_kv, prompt, generated, scale = 32, 8, 7, 3, 8 ** -0.5
    x_p, x_g = rng.standard_normal((prompt, d_model)), rng.standard_normal((generated, d_model))
    w_k, w_v = rng.standard_normal((2, d_model, d_kv)) / 3
    b_k, b_v = rng.standard_normal((2, d_kv))
    q = rng.standard_normal((2, d_kv))
    mask = np.where(np.arange(prompt) < 2, np.finfo(np.float32).min, 0.0)  # left padding

    def softmax(s):
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    k_p, k_g, v_p, v_g = x_p @ w_k + b_k, x_g @ w_k + b_k, x_p @ w_v + b_v, x_g @ w_v + b_v
    a = softmax(np.concatenate([scale * q @ k_p.T + mask, scale * q @ k_g.T], -1))
    expected = a[:, :prompt] @ v_p + a[:, prompt:] @ v_g
    qe = q @ w_k.T
    a_el = softmax(np.concatenate([scale * qe @ x_p.T + mask, scale * qe @ x_g.T], -1))
    got = (a_el[:, :prompt] @ x_p) @ w_v + (a_el[:, prompt:] @ x_g) @ w_v + b_v
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)
    one_sided = softmax(np.concatenate([scale * qe @ x_p.T + mask, scale * q @ k_g.T], -1))
    assert np.abs(one_sided - a).max() > 1e-2
    assert np.abs(got + b_v - expected).max() > 1e-2


# -- rewritten graphs against the originals --------------------------------------------------------------

def test_fused_projection_split(gpt2):
    """W_K, b_K, W_V, b_V found in the graph are c_attn's second and third column blocks (Conv1D: x·W + b)."""
    attn = gpt2["model"].transformer.h[1].attn
    weight, bias = attn.c_attn.weight.detach().numpy(), attn.c_attn.bias.detach().numpy()
    d_model = weight.shape[0]
    for form in FORMS:
        layer = _matched(gpt2[form][0])[1]
        for proj, block in ((layer.k, 1), (layer.v, 2)):
            cols = slice(block * d_model, (block + 1) * d_model)
            np.testing.assert_array_equal(proj.w, weight[:, cols])
            np.testing.assert_allclose(proj.b, bias[cols], rtol=0, atol=0)
        assert layer.norm is not None  # ln_1's γ, β: the pasts are drawn as it shapes them


@pytest.mark.parametrize("form", FORMS)
def test_matches_original(gpt2, form):
    original, folder = gpt2[form]
    before, after = Manifest.load(original), Manifest.load(folder)
    dims = before.dims
    layers, d_model, heads, d_kv = dims["num_decoder_layers"], dims["d_model"], dims["num_heads"], dims["d_kv"]
    rec = _record(folder)
    assert rec["layers"] == list(range(layers)) and rec["max_abs_logits_diff"] <= TOLERANCE
    assert rec["self_cache_ratio"] == rec["prompt_cache_ratio"] == d_model / (2 * heads * d_kv) == 0.5
    assert {s["past"] for s in rec["shapes"]} > {0} and {s["beams"] for s in rec["shapes"]} > {1}
    # the manifest: the prefill outputs X_p; the cache holds X per beam along axis 1
    prefill, step = after.graphs["prefill"], after.graphs["decoder"]
    assert list(prefill["outputs"]) == ["logits", *(f"present_hidden.{i}" for i in range(layers))]
    assert prefill["outputs"]["present_hidden.0"]["shape"] == ["batch", "prompt_sequence", d_model]
    entry = {"input": "past_hidden.{}", "output": "present_hidden.{}", "dtype": "float32",
             "shape": ["rows", "past_sequence", d_model], "seq_axis": 1}
    if form == "per-beam":
        entry["init"] = "prefill:present_hidden.{}"
    assert after.cache_entries == [{k: v.format(i) if isinstance(v, str) else v for k, v in entry.items()}
                                   for i in range(layers)]
    for i in range(layers):
        assert step["inputs"][f"past_hidden.{i}"]["from"] == f"cache:present_hidden.{i}"
    if form == "shared":  # the prompt's X at batch B, read by every beam
        assert {n: s["from"] for n, s in step["inputs"].items() if n.startswith("prompt_")} == {
            "prompt_attention_mask": "input:attention_mask",
            **{f"prompt_hidden.{i}": f"prefill:present_hidden.{i}" for i in range(layers)}}
        assert step["inputs"]["prompt_hidden.1"]["shape"] == ["batch", "prompt_sequence", d_model]
    assert "prompt_hidden" in after.data["cache"]["prompt"]["holds"] or form == "per-beam"
    assert {step["file"], prefill["file"]} == {"decoder.el-self.onnx", "prefill.el-self.onnx"}
    assert sorted(p.name for p in folder.iterdir()) == ["decoder.el-self.onnx", "manifest.json",
                                                        "prefill.el-self.onnx", "weights.data"]
    for name in ("prefill", "decoder"):
        graph = onnx.load(str(after.graph_path(name)))
        names = {i.name for i in graph.graph.input} | {o.name for o in graph.graph.output}
        assert not any(n.endswith((".key", ".value")) for n in names)
        assert names >= {f"present_hidden.{i}" for i in range(layers)}
    graph = onnx.load(str(after.graph_path("decoder")))
    weights = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    per_layer = 2 if form == "shared" else 1  # the prompt part and the generated part
    assert sum(bool(re.search(r"_W_K_T_\d+$", n)) and w.shape == (heads, d_kv, d_model)
               for n, w in weights.items()) == per_layer * layers
    assert sum(bool(re.search(r"_b_V_\d+$", n)) for n in weights) == layers  # b_V once, on the generated part
    report = verify_rewrite(before, after, shapes=EXTRA_SHAPES, seed=7,
                            past_from=el_self.consistent_past(_matched(original), heads, d_kv, seed=11))
    assert report["max_abs_logits_diff"] <= TOLERANCE


def test_comparison_notices_a_wrong_rewrite(gpt2, tmp_path):
    """The same verification with b_V left out of the rewritten graph exceeds the tolerance by far."""
    original, folder = gpt2["shared"]
    before = Manifest.load(original)
    good = el_self.consistent_past(_matched(original), before.dims["num_heads"], before.dims["d_kv"], seed=3)
    broken = tmp_path / "no_b_v"
    shutil.copytree(folder, broken)
    path = broken / "decoder.el-self.onnx"
    model = onnx.load(str(path))
    for tensor in model.graph.initializer:
        if re.search(r"_b_V_\d+$", tensor.name):
            tensor.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(tensor)), tensor.name))
    onnx.save(model, str(path))
    report = verify_rewrite(before, Manifest.load(broken), shapes=EXTRA_SHAPES[:2], past_from=good)
    assert report["max_abs_logits_diff"] > 100 * TOLERANCE


# -- generation against HF ------------------------------------------------------------------------------

SETTINGS = [dict(max_new_tokens=10), dict(num_beams=3, max_new_tokens=10),
            dict(num_beams=4, num_return_sequences=3, max_new_tokens=10),
            dict(num_beams=4, no_repeat_ngram_size=2, length_penalty=0.6, max_new_tokens=10),
            dict(no_repeat_ngram_size=3, max_new_tokens=10)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("options", SETTINGS, ids=["greedy", "beam3", "beam4-return3", "beam4-ngram2", "greedy-ngram3"])
def test_generation_identical_to_hf(gpt2, form, options):
    folder = gpt2[form][1]
    mask = random_inputs(Manifest.load(folder), 3, 11, np.random.default_rng(1))["attention_mask"]
    assert len(set(mask.sum(1).tolist())) > 1  # a left-padded batch of different prompt lengths
    report = compare(folder, batch_size=3, input_length=11, seed=1, **options)
    assert len(report.rows) == 3 * options.get("num_return_sequences", 1)
    assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]
    assert max(max(r.step_logits_diff) for r in report.rows) <= TOLERANCE
    if options.get("no_repeat_ngram_size"):  # varied tokens: the attention mixes different cached states
        assert all(len(set(r.hf_tokens[11:])) >= 3 for r in report.rows)


# -- measured bytes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
def test_measured_cache_bytes(gpt2, form):
    """Every step's live bytes: the generated part (per beam) and the prompt part (batch B when shared,
    per beam otherwise) are exactly D/(2·h·d_k) = 1/2 of the baseline's; the prompt mask is unchanged."""
    batch, width, beams, new = 3, 10, 4, 6
    runs = {}
    for name, folder in zip(("base", "el-self"), gpt2[form]):
        generator = Generator.from_folder(folder)
        inputs = random_inputs(generator.manifest, batch, width, np.random.default_rng(0))
        runs[name] = generator.generate(inputs, num_beams=beams, max_new_tokens=new, min_new_tokens=new,
                                        track_memory=True).memory
    dims = Manifest.load(gpt2[form][0]).dims
    per_token = 2 * dims["num_decoder_layers"] * dims["num_heads"] * dims["d_kv"] * 4  # baseline: K and V, fp32
    mask_bytes = batch * width * 8 if form == "shared" else 0
    rows = batch * beams
    assert len(runs["base"]) == len(runs["el-self"]) == new
    for step, (base, el) in enumerate(zip(runs["base"], runs["el-self"])):
        prompt_rows = batch if form == "shared" else rows
        generated = rows * step * per_token
        prompt = prompt_rows * width * per_token
        if form == "shared":
            assert base["cache_bytes"] == generated and base["state_bytes"] == prompt + mask_bytes
        else:
            assert base["cache_bytes"] == generated + prompt and base["state_bytes"] == 0
        assert el["rows"] == base["rows"]
        assert el["cache_bytes"] * 2 == base["cache_bytes"]
        assert (el["state_bytes"] - mask_bytes) * 2 == base["state_bytes"] - mask_bytes


# -- refusals -------------------------------------------------------------------------------------------

def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_refusals(gpt2, tmp_path):
    base, folder = gpt2["shared"]
    with pytest.raises(ElxError) as err:  # slim replaces the same cache (and refuses GPT-2 anyway)
        apply_passes(base, tmp_path / "both", "el-self,slim")
    assert "cannot be combined" in _one_line(err) and "el-self" in _one_line(err)
    with pytest.raises(ElxError, match="pass ngram does not apply to gpt2") as err:  # the search blocks n-grams
        apply_passes(base, tmp_path / "ngram", "el-self,ngram=3")
    _one_line(err)
    with pytest.raises(ElxError, match="already applied") as err:
        apply_passes(folder, tmp_path / "twice", "el-self")
    _one_line(err)
    with pytest.raises(ElxError, match="takes no argument") as err:
        apply_passes(base, tmp_path / "argument", "el-self=fast")
    _one_line(err)
    assert not any(tmp_path.iterdir())


def test_fp64_scores_and_export_flag(gpt2, tmp_path):
    """``--pass el-self=fp64`` (what ``elx export --pass`` runs after its baseline, on the module's baseline: a second
    export cost CI 53 s): verified, float64 scores, tokens identical to HF."""
    folder = apply_passes(gpt2["shared"][0], tmp_path / "fp64", "el-self=fp64")
    rec = _record(folder)
    assert rec["scores_accumulate"] == "float64" and rec["max_abs_logits_diff"] <= TOLERANCE
    report = compare(folder, batch_size=2, input_length=9, seed=4, num_beams=3, max_new_tokens=8)
    assert report.all_identical
