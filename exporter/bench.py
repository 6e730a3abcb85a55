"""``elx bench``: side-by-side speed and memory of HF generate, elx pass sets, and CTranslate2.

Honest by construction: one process, the same seeded inputs and settings for every system,
a warm-up run that also records the tokens (compared with HF's) and the runner's live state,
then ``repeats`` rounds in which the systems take turns (interleaved, so a noisy neighbour
hurts all of them alike).  Reported per system: median seconds, samples/s, generated tokens/s,
speed ratio to HF, input-related state bytes and self-attention cache bytes (peak over steps,
from the runner's live tensors), peak RSS growth while it ran, whether its tokens equal HF's,
and a roofline column: the FLOPs the generation needs (counted from the model dims for cached
attention, the same count for every system) divided by its time, next to a measured fp32
matmul peak of this machine.
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from runners.errors import ElxError

from runners.generate import Generator
from runners.inputs import random_inputs
from runners.manifest import Manifest


@dataclass
class BenchSettings:
    batch_size: int = 4
    input_length: int = 256
    num_beams: int = 4
    new_tokens: int = 32
    no_repeat_ngram_size: int = 0
    repeats: int = 3
    threads: int | None = None
    seed: int = 0
    device: str = "cpu"  # "cuda": HF on PyTorch CUDA, elx on ORT's CUDA EP with IOBinding

    def generation(self) -> dict:
        return dict(num_beams=self.num_beams, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                    no_repeat_ngram_size=self.no_repeat_ngram_size)


@dataclass
class SystemResult:
    name: str
    seconds: list = field(default_factory=list)
    tokens_equal_hf: bool | None = None
    note: str = ""
    state_bytes: int | None = None
    cache_bytes: int | None = None
    peak_rss_growth: int | None = None

    def summary(self, settings: BenchSettings, hf_median: float, flops: float, peak: float) -> dict:
        median = statistics.median(self.seconds)
        samples = settings.batch_size
        out = {
            "system": self.name, "median_s": median, "samples_per_s": samples / median,
            "tokens_per_s": samples * settings.new_tokens / median, "speedup_vs_hf": hf_median / median,
            "state_bytes": self.state_bytes, "cache_bytes": self.cache_bytes,
            "peak_rss_growth_bytes": self.peak_rss_growth, "tokens_equal_hf": self.tokens_equal_hf,
            "note": self.note, "gflops_per_s": flops / median / 1e9, "roofline_fraction": flops / median / peak,
            "all_seconds": self.seconds,
        }
        return out


class RssSampler:
    """Peak resident set size of this process while a block runs (sampled every 2 ms; used on the
    warm-up run only, so the timed runs have no extra thread)."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        self.start = self.rss()
        self.peak = self.start
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def matmul_peak(threads: int | None = None, size: int = 1024, repeats: int = 5) -> float:
    """Measured fp32 matmul FLOP/s of this machine (numpy/BLAS, the best of ``repeats``)."""
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(repeats))
    return 2 * size**3 / best


def _cuda_matmul_peak(size: int = 8192) -> float:
    import torch

    a = torch.randn(size, size, device="cuda")
    a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    torch.cuda.synchronize()
    return 5 * 2 * size**3 / (time.perf_counter() - start)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def generation_flops(dims: dict, ffn: int, batch: int, source: int, beams: int, new_tokens: int,
                     gated: bool = False) -> float:
    """FLOPs of encoder + cached-attention decoding (multiply-adds × 2), from the model dims alone."""
    d, inner, layers_e, layers_d = dims["d_model"], dims["num_heads"] * dims["d_kv"], dims["num_encoder_layers"], \
        dims["num_decoder_layers"]
    ffn_flops = (3 if gated else 2) * 2 * d * ffn
    encoder = batch * source * layers_e * (4 * 2 * d * inner + 2 * 2 * source * inner + ffn_flops)
    cross_kv = batch * source * layers_d * 2 * 2 * d * inner  # once per input (beam-shared)
    rows, decoder = batch * beams, 0.0
    for step in range(new_tokens):
        past = step + 1
        per_row = layers_d * (4 * 2 * d * inner + 2 * 2 * past * inner  # self-attention
                              + 2 * 2 * d * inner + 2 * 2 * source * inner  # cross-attention q/o + scores/values
                              + ffn_flops) + 2 * d * dims["vocab_size"]  # lm head
        decoder += rows * per_row
    return float(encoder + cross_kv + decoder)


def decoder_only_flops(dims: dict, ffn: int, batch: int, prompt: int, beams: int, new_tokens: int) -> float:
    """FLOPs of a decoder-only generation: the prompt once per input, then cached steps per row."""
    d, inner, layers = dims["d_model"], dims["num_heads"] * dims["d_kv"], dims["num_decoder_layers"]
    ffn_flops = 2 * 2 * d * ffn
    prefill = batch * prompt * layers * (4 * 2 * d * inner + 2 * 2 * prompt * inner / 2 + ffn_flops)
    prefill += batch * 2 * d * dims["vocab_size"]  # the last position's logits
    rows, decode = batch * beams, 0.0
    for step in range(1, new_tokens):
        seen = prompt + step
        decode += rows * (layers * (4 * 2 * d * inner + 2 * 2 * seen * inner + ffn_flops) + 2 * d * dims["vocab_size"])
    return float(prefill + decode)


def _ffn_of(config) -> tuple[int, bool]:
    if getattr(config, "model_type", None) == "gpt2":
        return int(config.n_inner or 4 * config.n_embd), False
    ffn = getattr(config, "d_ff", None) or getattr(config, "decoder_ffn_dim", None) or 4 * config.d_model
    gated = "gated" in str(getattr(config, "feed_forward_proj", ""))
    return int(ffn), gated


def ensure_exports(model: str, random_init: bool, pass_sets: list[str], work: Path, seed: int = 0,
                   quiet: bool = True, prompt_caches: list | None = None) -> list[Path]:
    """Export ``model`` once per pass set (and, for decoder-only models, prompt cache form: None is the
    default, shared) into ``work``; reused when an export with the same source exists."""
    from exporter.export import export_model

    folders = []
    for form in prompt_caches or [None]:
        for passes in pass_sets:
            name = passes.replace(",", "+").replace("=", "") if passes else "baseline"
            folder = work / (name + (f"-prompt-{form}" if form else ""))
            wanted = sorted(p.split("=")[0] for p in (passes or "").split(",") if p)
            manifest = folder / "manifest.json"
            if manifest.is_file():
                data = json.loads(manifest.read_text())
                source = data.get("source", {})
                kind = data.get("cache", {}).get("prompt", {}).get("kind")
                if (source.get("model") == model and source.get("random_init") == random_init
                        and source.get("seed") == (seed if random_init else None)
                        and sorted(p["name"] for p in data.get("passes", [])) == wanted
                        and kind == {None: kind, "shared": "beam-shared", "per-beam": "per-beam"}[form]):
                    folders.append(folder)
                    continue
            folders.append(export_model(model, folder, random_init=random_init, passes=passes or None, seed=seed,
                                        force=True, quiet=quiet, prompt_cache=form))
    return folders


class Ct2Peer:
    """CTranslate2 on the same weights, with a vocabulary of unique placeholder tokens ``<t{id}>``."""

    name = "CTranslate2"

    def __init__(self, hf_model, work: Path, threads: int | None, device: str = "cpu"):
        import ctranslate2
        from ctranslate2.converters import TransformersConverter

        src, out = work / "ct2-src", work / "ct2"
        if not (out / "model.bin").is_file():
            hf_model.save_pretrained(src)
            TransformersConverter(str(src)).convert(str(out), force=True)
            vocab = [f"<t{i}>" for i in range(hf_model.config.vocab_size)]
            (out / "shared_vocabulary.json").write_text(json.dumps(vocab))
        self.translator = ctranslate2.Translator(str(out), device=device, intra_threads=threads or 0)
        self.start = hf_model.generation_config.decoder_start_token_id

    def generate(self, inputs: dict, settings: BenchSettings) -> np.ndarray:
        batch = []
        for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"]):
            batch.append([f"<t{i}>" for i in ids[mask.astype(bool)]])
        results = self.translator.translate_batch(
            batch, beam_size=settings.num_beams, max_decoding_length=settings.new_tokens,
            min_decoding_length=settings.new_tokens, no_repeat_ngram_size=settings.no_repeat_ngram_size,
            length_penalty=1.0, return_end_token=True)
        rows = [[self.start] + [int(t[2:-1]) for t in r.hypotheses[0]] for r in results]
        width = max(len(r) for r in rows)
        return np.array([r + [-1] * (width - len(r)) for r in rows], dtype=np.int64)


def run_bench(folders: list[Path], settings: BenchSettings, ct2: bool = False, work: Path | None = None,
              log=print, peers: dict | None = None) -> dict:
    """``peers``: more systems, name → ``fn(inputs) -> sequences`` in HF's layout, timed in the same rounds."""
    import torch

    from exporter.sources import reload_model

    if settings.threads:
        torch.set_num_threads(settings.threads)
    generators = [generator_for(f, settings) for f in folders]
    manifest: Manifest = generators[0].manifest
    for g in generators[1:]:
        if g.manifest.data["source"] != manifest.data["source"]:
            raise ElxError("all bench folders must come from the same model export source")
    model = reload_model(manifest.data["source"]).to(settings.device)
    inputs = random_inputs(manifest, settings.batch_size, settings.input_length, np.random.default_rng(settings.seed))
    t_inputs = {k: torch.from_numpy(v).to(settings.device) for k, v in inputs.items()}
    options = settings.generation()

    def hf():
        with torch.no_grad():
            out = model.generate(**t_inputs, **options)
        if settings.device == "cuda":
            torch.cuda.synchronize()
        return out.cpu().numpy()

    systems = {"HF generate (PyTorch)": (hf, None)}
    for g in generators:
        name = "elx " + ("+".join(g.manifest.pass_names()) or "baseline")
        prompt = g.manifest.data["cache"].get("prompt")
        if prompt:  # decoder-only: where the prompt's K/V live
            name += f" (prompt {prompt['kind']})"
        systems[name] = ((lambda g=g: g.generate(inputs, **options).sequences), g)
    if ct2:
        try:
            peer = Ct2Peer(model.cpu() if settings.device == "cpu" else model, Path(work or "out/bench") / "ct2",
                           settings.threads, settings.device)
            systems[peer.name] = ((lambda: peer.generate(inputs, settings)), None)
        except Exception as err:  # noqa: BLE001 - an optional peer
            log(f"bench: CTranslate2 unavailable ({type(err).__name__}: {str(err)[:120]}); skipped")

    for name, fn in (peers or {}).items():
        systems[name] = ((lambda fn=fn: fn(inputs)), None)

    results, reference = {}, None
    for name, (fn, gen) in systems.items():  # warm-up: tokens and live state
        result = SystemResult(name)
        with RssSampler() as rss:
            tokens = fn()
        result.peak_rss_growth = rss.growth
        if reference is None:
            reference = tokens
        result.tokens_equal_hf = bool(tokens.shape == reference.shape and np.array_equal(tokens, reference))
        if gen is not None:
            tracked = gen.generate(inputs, track_memory=True, **options).memory
            result.state_bytes = max(m["state_bytes"] for m in tracked)
            result.cache_bytes = max(m["cache_bytes"] for m in tracked)
        if name == "CTranslate2" and settings.no_repeat_ngram_size and not result.tokens_equal_hf:
            result.note = "n-gram blocking semantics differ from HF's"
        results[name] = result
    for _ in range(settings.repeats):  # timed rounds: no sampler thread (it would contend for the GIL)
        for name, (fn, _) in systems.items():
            results[name].seconds.append(_timed(fn))
    ffn, gated = _ffn_of(model.config)
    if manifest.data.get("is_encoder_decoder", True):
        flops = generation_flops(manifest.dims, ffn, settings.batch_size, settings.input_length, settings.num_beams,
                                 settings.new_tokens, gated)
    else:
        flops = decoder_only_flops(manifest.dims, ffn, settings.batch_size, settings.input_length, settings.num_beams,
                                   settings.new_tokens)
    peak = matmul_peak(settings.threads) if settings.device == "cpu" else _cuda_matmul_peak()
    hf_median = statistics.median(results["HF generate (PyTorch)"].seconds)
    return {"settings": asdict(settings), "model": manifest.data["source"], "dims": manifest.dims,
            "flops_per_generate": flops, "matmul_peak_gflops": peak / 1e9,
            "systems": [r.summary(settings, hf_median, flops, peak) for r in results.values()]}


def generator_for(folder: Path, settings: BenchSettings) -> Generator:
    """The elx runner of a bench folder: ONNX Runtime on the CPU, IOBinding on the CUDA EP for cuda."""
    return Generator.from_folder(folder, device=settings.device, threads=settings.threads)


def _mb(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def markdown_table(report: dict) -> str:
    s = report["settings"]
    head = (f"batch {s['batch_size']}, input {s['input_length']}, beams {s['num_beams']}, "
            f"{s['new_tokens']} forced new tokens, n-gram {s['no_repeat_ngram_size']}, "
            f"median of {s['repeats']}; matmul peak {report['matmul_peak_gflops']:.0f} GFLOP/s, "
            f"{report['flops_per_generate'] / 1e9:.1f} GFLOP per generate\n\n")
    lines = ["| system | median s | samples/s | tokens/s | vs HF | input state MB | self cache MB | "
             "peak RSS +MB | GFLOP/s (roofline %) | tokens = HF |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["systems"]:
        equal = "yes" if r["tokens_equal_hf"] else ("no: " + r["note"] if r["note"] else "NO")
        lines.append(f"| {r['system']} | {r['median_s']:.3f} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_hf']:.2f}x | {_mb(r['state_bytes'])} | {_mb(r['cache_bytes'])} | "
                     f"{_mb(r['peak_rss_growth_bytes'])} | {r['gflops_per_s']:.1f} "
                     f"({100 * r['roofline_fraction']:.0f}%) | {equal} |")
    return head + "\n".join(lines)
