"""``elx bench``: side-by-side speed and memory of HF generate, elx pass sets, and peers.

Honest by construction: one process, the same seeded inputs and settings for every system,
a warm-up run that also records the tokens (compared with HF's) and the runner's live state,
then ``repeats`` rounds (3 by default) in which the systems take turns (interleaved, so a noisy
neighbour hurts all of them alike; after the first round in a seeded shuffled order, so that no
system always inherits the same predecessor's leftovers: ``round_orders``).  Reported per system:
median seconds, samples/s, generated tokens/s, speed ratio to HF, input-related state bytes and
self-attention cache bytes (peak over steps, from the runner's live tensors), peak RSS growth while
it ran, whether its tokens equal HF's (and if not, how many rows do: ``rows_equal``), the GFLOP/s
reached, and time / floor (the roofline below; its bytes are fp32's, so an int8 system can run below it).
Peers (``elx.exporter.bench.peers``): ONNX Runtime's BeamSearch op and CTranslate2 (fp32 or int8), on the
same weights.  A pass set ending in ``@int8`` is exported with ``--precision int8``.
A ``--quick`` run is labelled a smoke run in its table, JSON and plots: one repeat of a tiny model
is no measurement.  What is printed and kept (the conclusion lines first, the table in everyday units, the
roofline columns in a Details section, each run in its own timestamped folder): ``exporter/bench/results.py``.

Roofline (``phase_flops``, ``phase_bytes``, ``roofline``).  Generation is split into phases, the
encoder (with the cross-attention K/V projection) and each decoder step; a phase cannot take less
than ``max(FLOPs / P, bytes / W)``, where ``P`` is the fp32 matmul peak and ``W`` the read
bandwidth of this machine, both measured when the bench starts (``matmul_peak``,
``read_bandwidth``).  The floor is the sum over phases.  Counted, in fp32 (4 bytes a value),
with ``d`` = d_model, ``i`` = heads · d_kv, ``f`` = FFN width (×3 weight matrices if gated, else ×2),
``L_e``/``L_d`` the layer counts, ``V`` the vocabulary, ``B`` the batch, ``N`` the input length,
``r = B · beams`` rows and ``t`` the self-attention positions already cached before a step:

* FLOPs (2 per multiply-add, the same count for every system): the matmuls of cached attention
  (projections, scores and values, FFN, LM head); normalisation, softmax and biases are ignored.
* Encoder bytes: the encoder weights ``L_e(4di + fd)``, the embedding rows read and the encoder
  output written (``2BNd``), and the cross-attention state: with the cross K/V layout the K/V
  weights ``2 L_d d i`` read and the beam-shared K/V ``2 L_d B N i`` written; with EL-attention
  nothing more (the encoder output is the state).
* Decoder step bytes: the decoder weights ``L_d(4di + fd)`` plus the cross-attention weights read
  per step (``2di`` per layer for the q/o projections with the cross K/V layout; ``4di`` with EL,
  which applies W_K and W_V to the query and the result), the LM head ``Vd``, the embedding rows
  ``rd``; the self cache read ``2 L_d r t i`` and the new position written ``2 L_d r i`` (an
  in-place cache: no copy of the past, no beam reorder); the cross state read, ``2 L_d B N i``
  (K/V) or ``L_d B N d`` (EL reads the encoder output once per layer).  Activations (hidden states,
  logits) are not counted: they are small beside the weights at these shapes, and cache-resident.

The floor is the smaller of the two layouts' totals (the best exact layout elx offers), so it is one
number for every system; each system's time / floor says how far above it that system runs.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from elx.runners.errors import ElxError

from elx.runners.generate import Generator
from elx.runners.inputs.random_inputs import random_inputs
from elx.runners.manifest import Manifest

from elx.exporter.progress import Progress, say


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
    backend: str = "ort"  # "tensorrt": elx on the folders' TensorRT engines (``ensure_engines``; cuda only)
    precision: str = "fp32"  # --precision: of the exports (or engines) and, where it can, of HF (``hf_precision``)
    smoke: bool = False  # a --quick run: labelled as a smoke run everywhere, not a measurement
    # --one-at-a-time: each system loaded, warmed up, timed and released before the next (the peers converted
    # first; HF's model released once HF has run),
    # for models whose systems do not fit in memory together; rounds are then not interleaved
    one_at_a_time: bool = False

    def generation(self) -> dict:
        return dict(num_beams=self.num_beams, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                    no_repeat_ngram_size=self.no_repeat_ngram_size)


def hf_precision(settings: BenchSettings) -> str:
    """What HF ``generate`` runs in: fp16 for an fp16 bench on CUDA (``model.half()``), fp32 otherwise."""
    return "fp16" if settings.precision == "fp16" and settings.device == "cuda" else "fp32"


def hf_precision_note(settings: BenchSettings) -> str | None:
    """One line saying what HF runs when it is not the bench's precision (None when it is)."""
    if settings.precision == "fp32":
        return None
    if hf_precision(settings) == "fp16":
        return ("HF generate runs in fp16 (model.half() on CUDA); tokens = HF compares every system with HF fp32's "
                "tokens (one untimed fp32 run)")
    what = "fp16" if settings.precision == "fp16" else "int8"
    return (f"HF generate runs in fp32 on the {settings.device}: PyTorch has no {what} path for HF generate there "
            f"that elx's {what} exports could be compared with; tokens = HF compares with HF fp32's tokens")


def hf_system_name(settings: BenchSettings) -> str:
    return "HF generate (PyTorch)" + (" fp16" if hf_precision(settings) == "fp16" else "")


@dataclass
class SystemResult:
    name: str
    seconds: list = field(default_factory=list)
    tokens_equal_hf: bool | None = None
    rows_equal_hf: tuple | None = None  # (rows identical to HF's, rows)
    note: str = ""
    state_bytes: int | None = None
    cache_bytes: int | None = None
    peak_rss_growth: int | None = None

    def summary(self, settings: BenchSettings, hf_median: float, flops: float, peak: float,
                floor: float | None) -> dict:
        median = statistics.median(self.seconds)
        samples = settings.batch_size
        out = {
            "system": self.name, "median_s": median, "samples_per_s": samples / median,
            "tokens_per_s": samples * settings.new_tokens / median, "speedup_vs_hf": hf_median / median,
            "state_bytes": self.state_bytes, "cache_bytes": self.cache_bytes,
            "peak_rss_growth_bytes": self.peak_rss_growth, "tokens_equal_hf": self.tokens_equal_hf,
            "rows_equal_hf": None if self.rows_equal_hf is None else list(self.rows_equal_hf),
            "note": self.note, "gflops_per_s": flops / median / 1e9, "roofline_fraction": flops / median / peak,
            "time_over_floor": median / floor if floor else None,
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


def round_orders(names: list[str], repeats: int, seed: int = 0) -> list[list[str]]:
    """The order the systems take turns in, per timed round: the listed order first, then seeded shuffles.

    A fixed order gives every system the same predecessor in every round, and what one leaves behind
    (a 20 s PyTorch run's freed memory and filled caches, another runtime's thread pool) moved the next
    one's time by about 10% on this VM (issue 15: the same CTranslate2 call took a median 5.9 s in rounds
    without a PyTorch generate and 5.0–5.4 s in rounds with one).  Shuffling spreads that over every
    system's rounds."""
    rng = np.random.default_rng(seed)
    return [list(names) if r == 0 else [names[i] for i in rng.permutation(len(names))] for r in range(repeats)]


def timed_rounds(fns: dict, repeats: int, seed: int = 0, progress: Progress | None = None) -> dict:
    """Seconds of each system's call (name → fn) in each of ``repeats`` interleaved rounds (``round_orders``);
    each round is a ``progress`` stage (its line lists the round's times)."""
    progress = progress or Progress("elx bench", progress="none")
    seconds = {name: [] for name in fns}
    for r, order in enumerate(round_orders(list(fns), repeats, seed)):
        with progress.stage(f"round {r + 1} of {repeats}", len(order), steps=len(order)) as stage:
            for i, name in enumerate(order):
                seconds[name].append(_timed(fns[name]))
                stage.step(order[i + 1] if i + 1 < len(order) else None)
            stage.detail = ", ".join(f"{name} {seconds[name][-1]:.2f} s" for name in order)
    return seconds


def phase_flops(dims: dict, ffn: int, batch: int, source: int, beams: int, new_tokens: int,
                gated: bool = False) -> dict:
    """FLOPs of the encoder (with the beam-shared cross K/V projection) and of each decoder step."""
    d, inner, layers_e, layers_d = _sizes(dims)
    ffn_flops = (3 if gated else 2) * 2 * d * ffn
    encoder = batch * source * layers_e * (4 * 2 * d * inner + 2 * 2 * source * inner + ffn_flops)
    encoder += batch * source * layers_d * 2 * 2 * d * inner  # cross K/V, once per input (beam-shared)
    rows, steps = batch * beams, []
    for step in range(new_tokens):
        past = step + 1
        per_row = layers_d * (4 * 2 * d * inner + 2 * 2 * past * inner  # self-attention
                              + 2 * 2 * d * inner + 2 * 2 * source * inner  # cross-attention q/o + scores/values
                              + ffn_flops) + 2 * d * dims["vocab_size"]  # lm head
        steps.append(float(rows * per_row))
    return {"encoder": float(encoder), "steps": steps}


def generation_flops(dims: dict, ffn: int, batch: int, source: int, beams: int, new_tokens: int,
                     gated: bool = False) -> float:
    """FLOPs of encoder + cached-attention decoding (multiply-adds × 2), from the model dims alone."""
    flops = phase_flops(dims, ffn, batch, source, beams, new_tokens, gated)
    return flops["encoder"] + sum(flops["steps"])


def phase_bytes(dims: dict, ffn: int, batch: int, source: int, beams: int, new_tokens: int, gated: bool = False,
                cross: str = "kv", word: int = 4) -> dict:
    """Bytes the encoder phase and each decoder step must move (the module docstring's model).

    ``cross``: "kv" (beam-shared cross K/V written by the encoder phase, read every step) or "el"
    (EL-attention: every layer reads the encoder output instead).
    """
    if cross not in ("kv", "el"):
        raise ValueError(f"cross layout is kv or el, not {cross!r}")
    d, inner, layers_e, layers_d = _sizes(dims)
    layer = 4 * d * inner + (3 if gated else 2) * d * ffn  # attention q/k/v/o + FFN weights
    kv = cross == "kv"
    encoder = layers_e * layer + 2 * batch * source * d  # weights, embedding rows in, encoder output out
    if kv:
        encoder += 2 * layers_d * d * inner + 2 * layers_d * batch * source * inner  # K/V weights, K/V written
    rows = batch * beams
    weights = layers_d * (layer + (2 if kv else 4) * d * inner) + dims["vocab_size"] * d + rows * d
    cross_read = (2 * layers_d * batch * source * inner) if kv else layers_d * batch * source * d
    steps = [word * (weights + cross_read + 2 * layers_d * rows * past * inner + 2 * layers_d * rows * inner)
             for past in range(new_tokens)]
    return {"encoder": word * encoder, "steps": steps}


def roofline(flops: dict, bytes_by_layout: dict, peak: float, bandwidth: float) -> dict:
    """Floor seconds: per phase max(FLOPs / peak, bytes / bandwidth), summed; the cheapest layout's."""
    best = None
    for layout, moved in bytes_by_layout.items():
        pairs = list(zip([flops["encoder"], *flops["steps"]], [moved["encoder"], *moved["steps"]]))
        phases = [max(f / peak, b / bandwidth) for f, b in pairs]
        result = {"floor_s": sum(phases), "layout": layout, "encoder_floor_s": phases[0],
                  "step_floor_s": phases[1:], "memory_bound_phases": sum(b / bandwidth > f / peak for f, b in pairs),
                  "phases": len(pairs), "bytes": moved["encoder"] + sum(moved["steps"])}
        if best is None or result["floor_s"] < best["floor_s"]:
            best = result
    return best


def _sizes(dims: dict) -> tuple[int, int, int, int]:
    return dims["d_model"], dims["num_heads"] * dims["d_kv"], dims["num_encoder_layers"], dims["num_decoder_layers"]


def read_bandwidth(device: str = "cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """Measured read bandwidth (bytes/s): the best of ``repeats`` sums over a float32 array far larger than
    the caches, on PyTorch's threads (``torch.set_num_threads``)."""
    import torch

    a = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)

    def once():
        a.sum()
        if device == "cuda":
            torch.cuda.synchronize()

    once()
    best = min(_timed(once) for _ in range(repeats))
    return a.numel() * 4 / best


def decoder_only_flops(dims: dict, ffn: int, batch: int, prompt: int, beams: int, new_tokens: int,
                       gated: bool = False) -> float:
    """FLOPs of a decoder-only generation: the prompt once per input, then cached steps per row.  Per layer and
    token: the q/o projections ``2·2·d·i``, the k/v projections ``2·2·d·i_kv`` (``i_kv`` = key/value heads ·
    d_kv: fewer than the query heads with GQA/MQA), scores and values ``2·2·seen·i``, the FFN ``2·2·d·f`` (×3/2
    when gated: SwiGLU/GeGLU's gate, up and down matrices); the LM head ``2·d·V`` per scored position."""
    d, inner, layers = dims["d_model"], dims["num_heads"] * dims["d_kv"], dims["num_decoder_layers"]
    kv_inner = (dims.get("num_kv_heads") or dims["num_heads"]) * dims["d_kv"]
    projections = 2 * 2 * d * inner + 2 * 2 * d * kv_inner
    ffn_flops = (3 if gated else 2) * 2 * d * ffn
    prefill = batch * prompt * layers * (projections + 2 * 2 * prompt * inner / 2 + ffn_flops)
    prefill += batch * 2 * d * dims["vocab_size"]  # the last position's logits
    rows, decode = batch * beams, 0.0
    for step in range(1, new_tokens):
        seen = prompt + step
        decode += rows * (layers * (projections + 2 * 2 * seen * inner + ffn_flops) + 2 * d * dims["vocab_size"])
    return float(prefill + decode)


def _ffn_of(config) -> tuple[int, bool]:
    if getattr(config, "model_type", None) == "gpt2":
        return int(config.n_inner or 4 * config.n_embd), False
    if getattr(config, "intermediate_size", None):  # Llama-family: SwiGLU/GeGLU (gate, up, down)
        return int(config.intermediate_size), getattr(config, "model_type", "") != "gpt_neox"
    ffn = getattr(config, "d_ff", None) or getattr(config, "decoder_ffn_dim", None) or 4 * config.d_model
    gated = "gated" in str(getattr(config, "feed_forward_proj", ""))
    return int(ffn), gated


def check_work_folder(folder: Path) -> None:
    """``folder`` (under ``--work``) can take a bench export: refused in bench's own terms (``--work``), where the
    export would refuse it as an ``--output`` (``exporter/atomic.py``)."""
    from elx.exporter.atomic import elx_files

    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ElxError(f"cannot keep bench exports in {folder}: {existing} is a file; choose another --work")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ElxError(f"cannot write bench exports in {existing} (permission denied); choose a writable --work")
    if folder.is_symlink():
        raise ElxError(f"bench export folder {folder} is a symbolic link; choose another --work")
    if folder.is_dir() and any(folder.iterdir()):
        owned = elx_files(folder)
        foreign = sorted(p.name for p in folder.iterdir() if owned is None or p.name not in owned)
        if foreign:
            raise ElxError(f"bench export folder {folder} holds {foreign[0]!r}, which elx did not write; bench replaces "
                           "its exports there: move it out or choose another --work")


def split_precision(pass_set: str, default: str = "fp32") -> tuple[str, str]:
    """``el@int8`` → ("el", "int8"); ``baseline@int8`` → ("", "int8"); ``el`` → ("el", ``default``)."""
    passes, _, precision = pass_set.partition("@")
    return ("" if passes in ("baseline", "base", "none") else passes), precision or default


def export_precision(settings: BenchSettings) -> str:
    """The ``--precision`` of the bench's exports whose pass set names none: the bench's, except with TensorRT,
    whose fp16 engines are built from fp32 exports (``ensure_engines``)."""
    return "fp32" if settings.backend == "tensorrt" else settings.precision


def _cached(folder: Path, model: str, random_init: bool, seed: int, passes: str | None, precision: str,
            form: str | None) -> bool:
    """Whether ``folder`` holds an export of ``model`` with exactly these passes, precision and prompt cache form."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return False
    data = json.loads(manifest.read_text())
    files = Manifest(data, folder).graph_files()
    if not files or not all((folder / f).is_file() for f in files):  # damaged: exported again, not reused
        return False
    source = data.get("source", {})
    kind = data.get("cache", {}).get("prompt", {}).get("kind")
    wanted = sorted(p.split("=")[0] for p in (passes or "").split(",") if p)
    return (source.get("model") == model and source.get("random_init") == random_init
            and source.get("seed") == (seed if random_init else None)
            and sorted(p["name"] for p in data.get("passes", [])) == wanted
            and data.get("precision", "fp32") == precision
            and kind == {None: kind, "shared": "beam-shared", "per-beam": "per-beam"}[form])


def ensure_exports(model: str, random_init: bool, pass_sets: list[str], work: Path, seed: int = 0,
                   quiet: bool = True, prompt_caches: list | None = None, progress=None,
                   precision: str = "fp32") -> list[Path]:
    """Export ``model`` once per pass set (and, for decoder-only models, prompt cache form: None is the
    default, shared) into ``work``; reused when an export with the same source exists.  A pass set may end
    in ``@<precision>`` (``baseline@int8``, ``el@int8``): that export's ``--precision``; the others are exported
    at ``precision`` (``elx bench --precision``).  An fp32 pass set whose baseline (same form) is cached or
    asked for is made from that baseline (``apply_passes``: the same passes and verification as ``elx export
    --pass``, without loading the model again).  ``progress``: the exports' stages (``exporter/progress.py``;
    ``quiet`` says nothing), and a line per reused export."""
    from elx.exporter.export import apply_passes, export_model
    from elx.exporter.memory import release_memory
    from elx.exporter.precision.fp16_export import check_precision

    plans = {}
    for form in prompt_caches or [None]:
        suffix = f"-prompt-{form}" if form else ""
        requests = []
        for pass_set in pass_sets:
            passes, wanted_precision = split_precision(pass_set, precision)
            check_precision(wanted_precision)
            name = passes.replace(",", "+").replace("=", "") if passes else "baseline"
            name += "" if wanted_precision == "fp32" else f"-{wanted_precision}"
            requests.append((pass_set, passes, wanted_precision, work / (name + suffix)))
        plans[form] = (work / ("baseline" + suffix), requests)
    for form, (_, requests) in plans.items():  # every folder checked before the first export: a refusal costs no work
        for _, passes, wanted_precision, folder in requests:
            if not _cached(folder, model, random_init, seed, passes, wanted_precision, form):
                check_work_folder(folder)
    folders = {}
    for form, (baseline, requests) in plans.items():
        # the fp32 pass sets last (in the order asked): each may be made from the baseline exported here
        for pass_set, passes, wanted_precision, folder in sorted(requests, key=lambda r: bool(r[1]) and r[2] == "fp32"):
            if _cached(folder, model, random_init, seed, passes, wanted_precision, form):
                if not quiet:
                    say(f"elx bench: reusing the export {folder}", progress)
                folders[(form, pass_set)] = folder
                continue
            check_work_folder(folder)
            if passes and wanted_precision == "fp32" and _cached(baseline, model, random_init, seed, None, "fp32", form):
                folders[(form, pass_set)] = apply_passes(baseline, folder, passes, quiet=quiet, progress=progress)
            else:
                folders[(form, pass_set)] = export_model(model, folder, random_init=random_init, passes=passes or None,
                                                         seed=seed, force=True, quiet=quiet, prompt_cache=form,
                                                         progress=progress, precision=wanted_precision)
            release_memory()
    return [folders[(form, pass_set)] for form in prompt_caches or [None] for pass_set in pass_sets]


def run_bench(folders: list[Path], settings: BenchSettings, peer_names: list[str] = (), work: Path | None = None,
              log=None, peers: dict | None = None, progress=None) -> dict:
    """One bench run: HF generate, an elx runner per folder, the peers named in ``peer_names`` (of
    ``bench_peers.PEERS``, converted here) and ``peers``: more systems, name → ``fn(inputs) -> sequences``
    in HF's layout, timed in the same rounds.  ``progress``: its stages (measuring the machine, loading,
    converting peers, the warm-up, each round) as a bar, plain lines or nothing (``exporter/progress.py``);
    ``log`` (default: a progress line) says which peers were skipped."""
    systems_count = 1 + len(folders) + len(peer_names) + len(peers or {})
    with Progress("elx bench", 2 + 2 + 5 * len(peer_names) + systems_count * (1 + settings.repeats),
                  progress) as report:
        return _run_bench(folders, settings, peer_names, work, log or report.say, peers, report)


def _run_bench(folders, settings: BenchSettings, peer_names, work, log, peers, report: Progress) -> dict:
    import torch

    from elx.exporter.bench.peers import PeerUnavailable, make_peer
    from elx.exporter.memory import release_memory
    from elx.exporter.source.load import reload_model

    if settings.threads:
        torch.set_num_threads(settings.threads)
    with report.stage("matmul peak and read bandwidth of this machine", 2) as stage:
        # both peaks first, before models fill the memory and the caches
        peak = matmul_peak(settings.threads) if settings.device == "cpu" else _cuda_matmul_peak()
        bandwidth = read_bandwidth(settings.device)
        stage.detail = f"{peak / 1e9:.0f} GFLOP/s, {bandwidth / 1e9:.1f} GB/s"
    with report.stage("load the elx runners and the PyTorch model" if not settings.one_at_a_time
                      else "load the PyTorch model (the elx runners one at a time)", 2):
        manifests = {folder: Manifest.load(folder) for folder in folders}
        manifest: Manifest = manifests[folders[0]]
        if any(m.data["source"] != manifest.data["source"] for m in manifests.values()):
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

    # every system as a loader: key → () -> (name as reported, fn, elx generator or None); HF's model stays loaded
    hf_name = hf_system_name(settings)
    loaders = {hf_name: lambda: (hf_name, hf, None)}
    elx_keys = {folder: system_name(manifests[folder], settings) for folder in folders}
    for folder, name in elx_keys.items():
        loaders[name] = lambda folder=folder, name=name: (name, *_elx_system(folder, settings, inputs, options))
    skipped, converted = {}, {}

    def convert_peer(peer_name):
        with report.stage(f"peer {peer_name} (convert or reuse its model)", 5):
            return make_peer(peer_name, model, manifest.data["source"], Path(work or "out/bench") / "peers", settings)

    for peer_name in peer_names:
        def load_peer(peer_name=peer_name):
            peer = converted.pop(peer_name, None) or convert_peer(peer_name)
            peer.load()
            return peer.name, (lambda: peer.generate(inputs, settings)), None
        loaders[peer_name] = load_peer
    for name, fn in (peers or {}).items():
        loaders[name] = lambda fn=fn, name=name: (name, (lambda: fn(inputs)), None)

    check_memory(folders, len(loaders) - 1 - len(folders), model_bytes(model), settings.one_at_a_time,
                 cache=cache_bytes(manifest.dims, settings))
    config = model.config
    reference = None
    if hf_precision(settings) == "fp16":  # the tokens every system is compared with stay HF fp32's
        with report.stage("HF fp32 reference tokens (untimed), then HF in fp16", 1):
            reference = hf()
            model.half()
    pad = manifest.data["tokens"].get("pad_token_id")
    results = {}

    def load(name):
        """(name as reported, fn, generator) of a loader, or None when a peer cannot run here (said, recorded)."""
        try:
            return loaders[name]()
        except PeerUnavailable as err:
            skipped[name] = str(err)
            log(f"bench: peer {name} skipped: {err}")
            return None

    def warm_up(name, fn, gen) -> SystemResult:
        nonlocal reference
        result = SystemResult(name)
        with RssSampler() as rss:
            tokens = fn()
        result.peak_rss_growth = rss.growth
        if reference is None:
            reference = tokens
        result.tokens_equal_hf = bool(tokens.shape == reference.shape and np.array_equal(tokens, reference))
        result.rows_equal_hf = rows_equal(reference, tokens, pad)
        if gen is not None:
            tracked = gen.generate(inputs, track_memory=True, **options).memory
            result.state_bytes = max(m["state_bytes"] for m in tracked)
            result.cache_bytes = max(m["cache_bytes"] for m in tracked)
        if name != hf_name and gen is None and settings.no_repeat_ngram_size and not result.tokens_equal_hf:
            result.note = "n-gram blocking semantics differ from HF's"
        results[name] = result
        return result

    if not settings.one_at_a_time:  # every system loaded, then warm-up and rounds interleaved
        systems = {}
        for name in list(loaders):
            loaded = load(name)
            if loaded:
                systems[loaded[0]] = loaded[1:]
        _warm_up_all(systems, warm_up, report, hf_name)
        for name, seconds in timed_rounds({n: fn for n, (fn, _) in systems.items()}, settings.repeats,
                                          settings.seed, report).items():
            results[name].seconds = seconds
    else:  # each system loaded, warmed up, timed and released before the next
        for peer_name in peer_names:  # converted from HF's model while it is here; each loads after it is gone
            try:
                converted[peer_name] = convert_peer(peer_name)
            except PeerUnavailable as err:
                skipped[peer_name] = str(err)
                log(f"bench: peer {peer_name} skipped: {err}")
                del loaders[peer_name]
        elx_names = set(elx_keys.values())
        for key in [k for k in loaders if k not in elx_names] + [k for k in loaders if k in elx_names]:
            if key != hf_name and model is not None:  # HF's tokens are kept; its model goes before the next loads
                model = t_inputs = None
                release_memory()
            loaded = load(key)
            if not loaded:
                continue
            name, fn, gen = loaded
            _warm_up_all({name: (fn, gen)}, warm_up, report, hf_name)
            results[name].seconds = timed_rounds({name: fn}, settings.repeats, settings.seed, report)[name]
            del loaded, fn, gen
            gc.collect()
    ffn, gated = _ffn_of(config)
    if manifest.data.get("is_encoder_decoder", True):
        shape = (manifest.dims, ffn, settings.batch_size, settings.input_length, settings.num_beams,
                 settings.new_tokens, gated)
        phases = phase_flops(*shape)
        flops = phases["encoder"] + sum(phases["steps"])
        roof = roofline(phases, {layout: phase_bytes(*shape, cross=layout) for layout in ("kv", "el")}, peak,
                        bandwidth)
    else:  # decoder-only: FLOPs only (the byte model covers encoder-decoder generation)
        flops = decoder_only_flops(manifest.dims, ffn, settings.batch_size, settings.input_length, settings.num_beams,
                                   settings.new_tokens, gated)
        roof = None
    hf_median = statistics.median(results[hf_name].seconds)
    return {"settings": asdict(settings), "model": manifest.data["source"], "dims": manifest.dims,
            "flops_per_generate": flops, "matmul_peak_gflops": peak / 1e9,
            "read_bandwidth_gb_s": bandwidth / 1e9, "roofline": roof, "skipped_peers": skipped,
            "hf_precision": hf_precision(settings), "hf_precision_note": hf_precision_note(settings),
            "systems": [r.summary(settings, hf_median, flops, peak, roof and roof["floor_s"]) for r in results.values()]}


def system_name(manifest: Manifest, settings: BenchSettings) -> str:
    """An elx system's name in the table: its passes, a precision other than fp32, a decoder's prompt cache form."""
    name = "elx " + ("+".join(manifest.pass_names()) or "baseline")
    precision = manifest.data.get("precision", "fp32")
    if settings.backend == "tensorrt":  # engines carry their own precision
        precision = (manifest.data.get("engines") or {}).get("precision", precision)
    if precision != "fp32":
        name += f"@{precision}"
    prompt = manifest.data["cache"].get("prompt")
    if prompt:  # decoder-only: where the prompt's K/V live
        name += f" (prompt {prompt['kind']})"
    return name


def held_bytes(folder: Path) -> int:
    """Bytes an elx runner of ``folder`` holds: each graph's file and external data (one session per graph,
    each with its own copy of the weights)."""
    graphs = Manifest.load(folder).data["graphs"].values()
    return sum((folder / g["file"]).stat().st_size + sum((folder / d).stat().st_size for d in g.get("external_data", []))
               for g in graphs)


def model_bytes(model) -> int:
    """Bytes of a PyTorch model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def cache_bytes(dims: dict, settings: BenchSettings) -> int:
    """A full fp32 key/value cache of the bench's shape with one copy per beam (what HF's search and a peer that
    preallocates its cache, as onnxruntime-genai does for beams, hold at the last step): self-attention over the
    input and the new tokens for a decoder-only model; self-attention over the new tokens and cross-attention
    over the input for an encoder-decoder one."""
    rows = settings.batch_size * settings.num_beams
    heads = dims.get("num_kv_heads") or dims["num_heads"]
    per_position = 2 * dims["num_decoder_layers"] * heads * dims["d_kv"] * 4  # K and V, every layer, float32
    positions = settings.input_length + settings.new_tokens
    return rows * per_position * positions


def check_memory(folders: list[Path], peers: int, hf_bytes: int, one_at_a_time: bool,
                 available: int | None = None, cache: int = 0) -> None:
    """Refuse, before anything runs, a bench whose systems cannot be held in this machine's memory: together
    (interleaved rounds), or, with ``one_at_a_time``, the largest alone (HF's model with its cache, then each
    peer and each elx runner after HF's model is released: a peer then fits where HF's model and cache did).
    Counted: weights, and ``cache`` bytes (``cache_bytes``) for HF and for each peer (as large as HF's model);
    elx runners by their weights, so a bench that passes may still run short at long inputs.  ``available`` is
    measured with HF's model loaded."""
    from elx.runners.inputs.validation import available_memory

    available = available_memory() if available is None else available
    if available is None:
        return
    elx = [held_bytes(f) for f in folders]
    if one_at_a_time:  # HF's run beside its model; a peer or an elx runner after the model is released
        # a peer (as large as HF's model, with the same cache) fits where HF's model with its cache fits
        needs = [(cache, available, "HF generate's cache beside its model"),
                 (max(elx, default=0), available + hf_bytes, "the largest elx export")]
        for need, room, what in needs:
            if need > room:
                raise ElxError(f"{what} needs about {need / 2**30:.1f} GiB and this machine has "
                               f"{room / 2**30:.1f} GiB for it even one system at a time; bench a smaller model, "
                               "batch or input length")
        return
    need = sum(elx) + peers * (hf_bytes + cache) + cache
    if need > available:
        raise ElxError(f"the systems hold about {need / 2**30:.1f} GiB together "
                       f"({len(folders)} elx export(s) {sum(elx) / 2**30:.1f} GiB, {peers} peer(s) "
                       f"{peers * (hf_bytes + cache) / 2**30:.1f} GiB, HF's cache {cache / 2**30:.1f} GiB) beside "
                       "HF's model and this machine has "
                       f"{available / 2**30:.1f} GiB available: add --one-at-a-time (each system loaded, timed "
                       "and released in turn) or bench fewer pass sets and peers")


def _elx_system(folder: Path, settings: BenchSettings, inputs: dict, options: dict):
    g = generator_for(folder, settings)
    return (lambda: g.generate(inputs, **options).sequences), g


def _warm_up_all(systems: dict, warm_up, report: Progress, hf_name: str) -> None:
    """The warm-up stage of ``systems`` (name → (fn, generator)): ``warm_up`` records each one's tokens and live
    state and returns its ``SystemResult``."""
    names = list(systems)
    same = 0
    with report.stage("warm-up (tokens and live state)", len(names), steps=len(names)) as stage:
        for i, (name, (fn, gen)) in enumerate(systems.items()):
            equal = bool(warm_up(name, fn, gen).tokens_equal_hf)
            same += name != hf_name and equal
            stage.step(names[i + 1] if i + 1 < len(names) else None)
        others = sum(n != hf_name for n in names)
        if others:
            stage.detail = f"{same} of {others} systems give HF's tokens"


def rows_equal(reference: np.ndarray, tokens: np.ndarray, pad: int | None) -> tuple[int, int]:
    """(rows of ``tokens`` equal to ``reference``'s, rows of ``reference``): a row may differ only in trailing
    ``pad`` columns (a peer that pads its batch to another width)."""
    def row(a) -> list:
        a = list(a)
        while a and pad is not None and a[-1] == pad:
            a.pop()
        return a

    same = sum(r < len(tokens) and row(reference[r]) == row(tokens[r]) for r in range(len(reference)))
    return int(same), len(reference)


def generator_for(folder: Path, settings: BenchSettings) -> Generator:
    """The elx runner of a bench folder: ONNX Runtime on the CPU, IOBinding on the CUDA EP for cuda, or the
    folder's TensorRT engines (``backend="tensorrt"``)."""
    return Generator.from_folder(folder, backend=settings.backend, device=settings.device, threads=settings.threads)


def ensure_engines(folders: list[Path], settings: BenchSettings, quiet: bool = False, progress=None) -> None:
    """TensorRT engines for every bench folder that has none, with profiles covering the bench's shapes
    (``progress``: the builds' stages, ``exporter/progress.py``)."""
    if settings.device != "cuda":
        raise ElxError("--backend tensorrt runs engines on an NVIDIA GPU; add --device cuda")
    from elx.exporter.tensorrt.build import build_engine

    for folder in folders:
        engines = Manifest.load(folder).data.get("engines")
        if not engines or engines.get("precision", "fp32") != settings.precision:
            build_engine(folder, precision=settings.precision, max_batch_size=settings.batch_size,
                         max_beams=settings.num_beams,
                         max_input_length=settings.input_length, max_new_tokens=settings.new_tokens, quiet=quiet,
                         progress=progress)


SMOKE = "SMOKE RUN (--quick: tiny model, one repeat), not a measurement"


def model_label(source: dict) -> str:
    """``t5-small (random init, seed 0)`` or the local folder's name, from a manifest's source record."""
    name = Path(str(source.get("model") or source.get("path") or "model")).name
    return f"{name} (random init, seed {source.get('seed')})" if source.get("random_init") else name


def describe(report: dict, without: str | None = None) -> str:
    """The model and settings of a report in one line (``without``: the setting a sweep varies)."""
    s = report["settings"]
    parts = {"batch_size": f"batch {s['batch_size']}", "input_length": f"input {s['input_length']}",
             "num_beams": f"beams {s['num_beams']}", "new_tokens": f"{s['new_tokens']} forced new tokens",
             "no_repeat_ngram_size": f"n-gram {s['no_repeat_ngram_size']}", "repeats": f"median of {s['repeats']}"}
    text = model_label(report["model"]) + ", " + ", ".join(v for k, v in parts.items() if k != without)
    return (SMOKE + ": " + text) if s.get("smoke") else text


def peer_lead_note(report: dict) -> str | None:
    """Why a peer beats every elx system in this run, in numbers (None when none does).

    At small shapes the model's arithmetic is a sliver of each step: the time is fixed per-step cost, and
    elx pays it in Python (its search loop calls ONNX Runtime for the step graph and runs log-softmax, top-k
    and the cache reorder on the host between calls), where ONNX Runtime's BeamSearch op and CTranslate2 run
    the whole search in C++."""
    systems = report["systems"]
    ours = [s for s in systems if s["system"].startswith("elx")]
    peers = [s for s in systems if not s["system"].startswith(("elx", "HF generate"))]
    if not ours or not peers:
        return None
    best = min(ours, key=lambda s: s["median_s"])
    ahead = [p for p in peers if p["median_s"] < best["median_s"]]
    if not ahead:
        return None
    steps = report["settings"]["new_tokens"]
    lead = ", ".join(f"{p['system']} {best['median_s'] / p['median_s']:.1f}x" for p in ahead)
    text = (f"why a peer leads here ({lead} ahead of {best['system']}): {best['system']} spent "
            f"{best['median_s'] / steps * 1e3:.2f} ms per generated token")
    roof = report.get("roofline")
    if roof:
        text += (f", {best['median_s'] / roof['floor_s']:.0f}x this shape's floor of {roof['floor_s'] * 1e3:.2f} ms "
                 "per generate")
    return (text + ": the time is fixed per-step cost, not the model's arithmetic; elx runs its search loop in "
            "Python between ONNX Runtime calls, the peers run theirs in C++. The README's Benchmarks section has "
            "measured runs at real sizes")
