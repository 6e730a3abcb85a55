"""``elx bench``: the smoke run end to end with the ORT BeamSearch peer (no timing assertions), the
byte-counting roofline against hand counts, honest labels (smoke runs, per-graph export times,
compare's warm timing, the matplotlib extra), and the IOBinding backend."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest


def _results_of(work):
    """A bench's results folder: ``results/latest`` (each run in its own timestamped folder), or ``results``
    itself while elx/cli.py still writes there."""
    from elx.exporter.bench.results import latest_folder

    return latest_folder(work / "results") or work / "results"


def test_bench_quick(tmp_path, capsys):
    from elx.cli import main

    assert main(["bench", "--quick", "--peers", "ort-beamsearch,ct2", "--work", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    results = _results_of(tmp_path / "t5-tiny")
    report = json.loads((results / "bench.json").read_text())
    systems = {s["system"]: s for s in report["systems"]}
    expected = {"HF generate (PyTorch)", "elx baseline", "elx el", "ORT BeamSearch op"}
    try:
        import ctranslate2  # noqa: F401
        expected.add("CTranslate2")
    except ImportError:
        assert "ctranslate2 is not installed" in report["skipped_peers"]["ct2"]
        assert "peer ct2 skipped: ctranslate2 is not installed" in printed
    assert set(systems) == expected
    assert all(systems[name]["tokens_equal_hf"] for name in expected - {"CTranslate2"})
    base, el = systems["elx baseline"], systems["elx el"]
    dims = report["dims"]
    # live tensors: el holds one [B, N, D] encoder output, the baseline 2·L cross K/V [B, h, N, d_kv]
    assert base["state_bytes"] > el["state_bytes"] > 0
    float_bytes = base["state_bytes"] - 2 * 32 * 8, el["state_bytes"] - 2 * 32 * 8  # minus the int64 mask
    assert float_bytes[0] / float_bytes[1] == pytest.approx(2 * dims["num_decoder_layers"] * dims["num_heads"]
                                                           * dims["d_kv"] / dims["d_model"])
    assert base["cache_bytes"] == el["cache_bytes"]
    assert report["flops_per_generate"] > 0 and report["matmul_peak_gflops"] > 0 and report["read_bandwidth_gb_s"] > 0
    assert report["roofline"]["floor_s"] > 0 and all(s["time_over_floor"] > 0 for s in systems.values())
    table = (results / "bench.md").read_text()
    summary, details = table.split("\n## Details\n")
    assert summary.count("| elx") == 2 and details.count("| elx") == 2 and "| ORT BeamSearch op |" in summary
    first = summary.splitlines()[:2]  # the conclusion, one line per pass set, from this run's numbers
    assert first[0].startswith("elx baseline: ") and first[1].startswith("elx el: ")
    el_speed = systems["HF generate (PyTorch)"]["median_s"] / el["median_s"]
    assert first[1].startswith(f"elx el: {el_speed:.2f}× HF, ") and "tokens = HF on 2/2 rows" in first[1]
    assert "smaller than elx baseline's" in first[1] and first[1].endswith("(smoke run, not a measurement)")
    assert " KB" in summary and "| 0.0 |" not in summary  # t5-tiny's state in KB, not 0.0 MB
    assert report["settings"]["smoke"] and "time / floor" in details and "time / floor" not in summary
    assert any(line.startswith("SMOKE RUN") for line in printed.splitlines())  # the table as printed
    assert printed.lstrip().startswith("elx baseline: ")
    assert "t5-tiny (random init, seed 0), batch 2, input 32, beams 2" in table
    # the BeamSearch op's file: loadable IR, fed elx's attention mask; an n-gram variant shares its weights
    import onnx

    from elx.exporter.bench.peers import with_ngram

    path = tmp_path / "t5-tiny" / "peers" / "ort-beamsearch" / "beam_search.onnx"
    converted = onnx.load(str(path), load_external_data=False)
    assert converted.ir_version <= 10 and "attention_mask" in [i.name for i in converted.graph.input]
    blocked = onnx.load(str(with_ngram(path, 3)), load_external_data=False)
    op = next(n for n in blocked.graph.node if n.op_type == "BeamSearch")
    assert onnx.helper.get_attribute_value(next(a for a in op.attribute if a.name == "no_repeat_ngram_size")) == 3


def test_repeats_default_to_three():
    from elx.cli import build_parser
    from elx.exporter.bench.bench import BenchSettings

    assert build_parser().parse_args(["bench"]).repeats == 3 == BenchSettings().repeats


# hand counts for a tiny config: d = 8, i = 2·4 = 8, f = 16 (not gated), L_e = 2, L_d = 3, V = 10,
# B = 2, N = 5, beams 3 (r = 6), 2 steps; values of 4 bytes
TINY = dict(d_model=8, num_heads=2, d_kv=4, num_encoder_layers=2, num_decoder_layers=3, vocab_size=10)


def test_phase_bytes_against_hand_counts():
    from elx.exporter.bench.bench import phase_bytes

    layer = 4 * 8 * 8 + 2 * 8 * 16  # 256 attention + 256 FFN = 512 values
    kv = phase_bytes(TINY, 16, batch=2, source=5, beams=3, new_tokens=2, cross="kv")
    # encoder: 2 layers (1024) + embeddings in and output out (2·2·5·8 = 160) + K/V weights (2·3·64 = 384)
    # + beam-shared K/V written (2·3·2·5·8 = 480)
    assert kv["encoder"] == 4 * (1024 + 160 + 384 + 480)
    # step: 3 layers of (512 + q/o 128) = 1920, LM head 80, embedding rows 48, cross K/V read 480;
    # self cache: read 2·3·6·t·8 = 288 t, written 2·3·6·8 = 288
    assert kv["steps"] == [4 * (1920 + 80 + 48 + 480 + 288), 4 * (1920 + 80 + 48 + 480 + 288 + 288)]
    el = phase_bytes(TINY, 16, batch=2, source=5, beams=3, new_tokens=2, cross="el")
    assert el["encoder"] == 4 * (1024 + 160)
    # EL: 3 layers of (512 + 4·64 = 256) = 2304; encoder output read once per layer 3·2·5·8 = 240
    assert el["steps"] == [4 * (2304 + 80 + 48 + 240 + 288), 4 * (2304 + 80 + 48 + 240 + 288 + 288)]
    gated = phase_bytes(TINY, 16, batch=2, source=5, beams=3, new_tokens=1, cross="kv", gated=True)
    assert gated["encoder"] - kv["encoder"] == 4 * 2 * 8 * 16  # a third FFN matrix per encoder layer
    with pytest.raises(ValueError):
        phase_bytes(TINY, 16, 2, 5, 3, 2, cross="slim")


def test_roofline_takes_the_slower_bound_per_phase_and_the_cheaper_layout():
    from elx.exporter.bench.bench import generation_flops, phase_flops, roofline

    flops = {"encoder": 100.0, "steps": [10.0, 10.0]}
    moved = {"a": {"encoder": 50.0, "steps": [40.0, 5.0]}, "b": {"encoder": 50.0, "steps": [40.0, 40.0]}}
    roof = roofline(flops, moved, peak=10.0, bandwidth=10.0)
    assert roof["layout"] == "a" and roof["floor_s"] == pytest.approx(10 + 4 + 1)
    assert roof["memory_bound_phases"] == 1 and roof["phases"] == 3 and roof["bytes"] == 95.0
    split = phase_flops(TINY, 16, 2, 5, 3, 4)
    assert split["encoder"] + sum(split["steps"]) == generation_flops(TINY, 16, 2, 5, 3, 4)
    assert split["steps"] == sorted(split["steps"]) and len(split["steps"]) == 4  # attention grows with the past


def test_export_logs_each_graphs_own_time(monkeypatch, tmp_path):
    import io

    import elx.exporter.export as export
    import elx.exporter.progress as progress

    clock = iter([0.0, 1.0, 10.0, 12.0, 20.0, 23.0])
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(export, "export_encoder", lambda *a: "enc")
    monkeypatch.setattr(export, "export_cross_kv", lambda *a: "kv")
    monkeypatch.setattr(export, "export_decoder", lambda *a: ("dec", []))
    monkeypatch.setattr(export, "describe_decoder", lambda *a: ("described", []))  # before the decoder is traced
    manifest, stream = {"graphs": {}, "cache": {}}, io.StringIO()
    export.export_graphs(None, None, tmp_path, manifest, progress.Progress("elx export", 3, "plain", stream))
    assert stream.getvalue().splitlines() == ["elx export: encoder.onnx (1.0 s)", "elx export: cross_kv.onnx (2.0 s)",
                                              "elx export: decoder.onnx (3.0 s)"]
    assert manifest["graphs"] == {"encoder": "enc", "cross_kv": "kv", "decoder": "dec"}


def test_compare_prints_no_one_run_speed_ratio(exported, monkeypatch):
    """A ratio of one warm run each swung 5.7x-16.9x between runs (issue 27): compare times on request, prints none."""
    import elx.exporter.verification.compare as compare

    calls = []
    real = compare._hf_generate
    monkeypatch.setattr(compare, "_hf_generate", lambda *a: calls.append(1) or real(*a))
    report = compare.compare(exported("bart"), batch_size=2, input_length=6, max_new_tokens=3, timed=True)
    assert len(calls) == 2 and report.all_identical  # a warm-up (whose tokens are compared), then the timed run
    assert report.hf_seconds > 0 and report.elx_seconds > 0
    text = compare.format_report(report, [])
    assert " s, elx " not in text and "x;" not in text and "speed" not in text
    untimed = compare.compare(exported("bart"), batch_size=2, input_length=6, max_new_tokens=3)
    assert len(calls) == 3 and untimed.hf_seconds is None


def test_sweep_without_matplotlib_is_one_line_error(monkeypatch, capsys, tmp_path):
    from elx.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["bench", "--quick", "--sweep", "input", "--work", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elx: error: ") and "matplotlib" in err[0] and "elx[bench]" in err[0]
    assert not any(tmp_path.iterdir())  # refused before any export


def test_unknown_peer_is_refused(capsys, tmp_path):
    from elx.cli import main

    assert main(["bench", "--peers", "ort-beamsearch,vllm", "--work", str(tmp_path)]) == 2
    assert "unknown peer vllm; choose from ort-beamsearch, ct2" in capsys.readouterr().err


@pytest.mark.parametrize("passes", [None, "el", "ngram=2"])
def test_iobinding_backend_matches_plain_backend(exported, passes):
    """The IOBinding path (device-resident state/cache, Gather-graph reorder) runs on the CPU EP here."""
    from elx.runners.generate import Generator
    from elx.runners.inputs.random_inputs import random_inputs
    from elx.runners.manifest import Manifest

    folder = exported("bart", passes)
    manifest = Manifest.load(folder)
    io, plain = Generator.from_folder(folder, backend="ort-io"), Generator.from_folder(folder)
    assert type(io.model.backend).__name__ == "OrtIoBackend"
    inputs = random_inputs(manifest, 3, 9, np.random.default_rng(0))
    for options in (dict(max_new_tokens=8, no_repeat_ngram_size=2),
                    dict(num_beams=4, num_return_sequences=2, max_new_tokens=8, no_repeat_ngram_size=2)):
        a = io.generate(inputs, track_memory=True, **options)
        b = plain.generate(inputs, track_memory=True, **options)
        np.testing.assert_array_equal(a.sequences, b.sequences)
        assert a.memory == b.memory


def test_cuda_backend_needs_onnxruntime_gpu(exported):
    import onnxruntime as ort

    from elx.runners.errors import ElxError
    from elx.runners.manifest import Manifest
    from elx.runners.backends.ort_io import OrtIoBackend

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    with pytest.raises(ElxError, match="onnxruntime-gpu"):
        OrtIoBackend(Manifest.load(exported("t5")), device="cuda")


def test_a_cuda_session_that_fell_back_to_the_cpu_is_one_line():
    """ORT puts a graph on the CPU, with a log line only, when its CUDA provider cannot load its libraries:
    a "cuda" bench would time the CPU.  The backend refuses such sessions by name."""
    from elx.runners.errors import ElxError
    from elx.runners.backends.ort_io import check_on_cuda

    class Session:
        def __init__(self, providers):
            self.providers = providers

        def get_providers(self):
            return self.providers

    check_on_cuda({"encoder": Session(["CUDAExecutionProvider", "CPUExecutionProvider"])})
    with pytest.raises(ElxError, match="could not put the decoder graph on the GPU"):
        check_on_cuda({"encoder": Session(["CUDAExecutionProvider", "CPUExecutionProvider"]),
                       "decoder": Session(["CPUExecutionProvider"])})


def test_the_cuda_provider_multiplies_in_float32_as_pytorch_does():
    """TF32 off (ORT's CUDA default is on; PyTorch's matmul default, HF's reference, is off)."""
    from elx.runners.backends.ort_io import cuda_options

    assert cuda_options(3) == {"device_id": 3, "use_tf32": 0}


def test_titles_name_model_and_settings_and_smoke_runs():
    from dataclasses import asdict

    from elx.exporter.bench.bench import SMOKE, BenchSettings, describe

    source = {"kind": "random-init", "model": "t5-small", "random_init": True, "seed": 0}
    title = describe({"settings": asdict(BenchSettings(num_beams=8)), "model": source}, without="input_length")
    assert title == "t5-small (random init, seed 0), batch 4, beams 8, 32 forced new tokens, n-gram 0, median of 3"
    smoke = describe({"settings": asdict(BenchSettings(smoke=True, repeats=1)), "model": {"path": "/m/my-t5"}})
    assert smoke.startswith(SMOKE + ": my-t5, batch 4, input 256") and smoke.endswith("median of 1")


def test_bench_tensorrt_backend_needs_a_gpu_before_any_work(tmp_path, capsys):
    """``--backend tensorrt`` on the CPU is refused in one line before anything is exported."""
    from elx.cli import main

    work = tmp_path / "bench"
    assert main(["bench", "--quick", "--backend", "tensorrt", "--work", str(work)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elx: error:") and "--device cuda" in err and "\n" not in err
    assert not work.exists()


def test_timed_rounds_shuffle_the_order_after_the_first_round():
    """Each system is timed once a round; the first round keeps the listed order, later rounds are seeded
    shuffles, so no system always runs right after the same one."""
    from elx.exporter.bench.bench import round_orders, timed_rounds

    names = ["hf", "a", "b", "c", "d", "e"]
    orders = round_orders(names, 5, seed=0)
    assert orders[0] == names and all(sorted(o) == sorted(names) for o in orders)
    assert orders == round_orders(names, 5, seed=0)  # seeded: a rerun takes the same turns
    after_hf = {o[o.index("hf") + 1] for o in orders if o.index("hf") + 1 < len(o)}
    assert len(after_hf) > 1

    calls = []
    seconds = timed_rounds({n: (lambda n=n: calls.append(n)) for n in names}, 3, seed=1)
    assert calls == [n for o in round_orders(names, 3, seed=1) for n in o]
    assert all(len(v) == 3 and all(x >= 0 for x in v) for v in seconds.values())


def test_a_peer_lead_is_explained_in_numbers():
    """The smoke bench showed a peer 2x ahead of elx on t5-tiny with no word of why (issue 27)."""
    from elx.exporter.bench.bench import peer_lead_note
    from elx.exporter.bench.results import report_markdown as markdown_table

    def system(name, median):
        return {"system": name, "median_s": median, "samples_per_s": 1, "tokens_per_s": 1, "speedup_vs_hf": 1,
                "state_bytes": None, "cache_bytes": None, "peak_rss_growth_bytes": None, "tokens_equal_hf": True,
                "note": "", "gflops_per_s": 1, "time_over_floor": 1}

    report = {"settings": {"batch_size": 2, "input_length": 32, "num_beams": 2, "new_tokens": 8,
                           "no_repeat_ngram_size": 0, "repeats": 1, "smoke": True},
              "model": {"model": "t5-tiny", "random_init": True, "seed": 0}, "matmul_peak_gflops": 100,
              "read_bandwidth_gb_s": 10, "flops_per_generate": 1e6,
              "roofline": {"floor_s": 0.0004, "bytes": 1e6, "layout": "el", "memory_bound_phases": 9, "phases": 9},
              "systems": [system("HF generate (PyTorch)", 0.4), system("elx baseline", 0.08), system("elx el", 0.1),
                          system("ORT BeamSearch op", 0.04)]}
    note = peer_lead_note(report)
    assert note.startswith("why a peer leads here (ORT BeamSearch op 2.0x ahead of elx baseline)")
    assert "10.00 ms per generated token, 200x this shape's floor of 0.40 ms" in note and note in markdown_table(report)
    report["systems"][-1]["median_s"] = 0.09  # elx ahead: nothing to explain
    assert peer_lead_note(report) is None and "why a peer leads" not in markdown_table(report)


def test_plot_titles_fit_the_figure(tmp_path, monkeypatch):
    """sweep_budget.png's smoke-run title ran past both edges of the figure (issue 27): titles wrap to its width."""
    pytest.importorskip("matplotlib")
    from dataclasses import asdict

    import matplotlib.pyplot as plt

    import elx.exporter.bench.sweeps as sweeps
    from elx.exporter.bench.bench import BenchSettings, describe

    figures = []
    real = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig) or real(fig))
    title = describe({"settings": asdict(BenchSettings(smoke=True, repeats=1, batch_size=2, input_length=32,
                                                       num_beams=2, new_tokens=8)),
                      "model": {"model": "t5-tiny", "random_init": True, "seed": 0}}, without="batch_size")
    rows = [{"system": name, "max_batch": 4, "samples_per_s": 2.0} for name in ("elx baseline", "elx el")]
    sweeps._plot_budget(tmp_path / "sweep_budget.png", rows, 64, title)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figures[-1]
    extent = fig._suptitle.get_window_extent(FigureCanvasAgg(fig).get_renderer())
    assert 0 <= extent.x0 and extent.x1 <= fig.bbox.x1 and extent.y1 <= fig.bbox.y1
    assert fig._suptitle.get_text().replace("\n", " ") == title and (tmp_path / "sweep_budget.png").stat().st_size


def test_a_bench_run_is_plotted_whenever_matplotlib_is_there(tmp_path, monkeypatch):
    from elx.exporter.bench.sweeps import plot_bench

    report = {"settings": {"batch_size": 1, "input_length": 8, "num_beams": 2, "new_tokens": 2,
                           "no_repeat_ngram_size": 0, "repeats": 1, "smoke": True},
              "model": {"model": "t5-tiny", "random_init": True, "seed": 0},
              "systems": [{"system": "HF generate (PyTorch)", "median_s": 0.2, "speedup_vs_hf": 1.0},
                          {"system": "elx baseline", "median_s": 0.1, "speedup_vs_hf": 2.0}]}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plot_bench(report, tmp_path / "bench.png").startswith("no plot: matplotlib is not installed")
    else:
        assert plot_bench(report, tmp_path / "bench.png") == f"wrote {tmp_path / 'bench.png'}"
        assert (tmp_path / "bench.png").stat().st_size > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_bench(report, tmp_path / "none.png").startswith("no plot: matplotlib is not installed")
    assert not (tmp_path / "none.png").exists()


def test_bench_on_cuda_without_a_cuda_device_is_one_line_before_any_export(tmp_path, capsys):
    """Found by the GPU check's dry run: ``bench --device cuda`` on a CPU-only PyTorch exported the model, then
    died with PyTorch's 'Torch not compiled with CUDA enabled' traceback."""
    import torch

    from elx.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert main(["bench", "--quick", "--device", "cuda", "--work", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elx: error: --device cuda:") and "\n" not in err
    assert not (tmp_path / "work").exists()


def test_one_at_a_time_runs_each_system_alone_with_the_same_tokens(exported, capsys):
    """``--one-at-a-time``: HF, then the peers (converted from HF's model), then each elx runner after HF's model
    is released; each system warmed up and timed alone, with the tokens compared with HF's as in interleaved runs."""
    from elx.exporter.bench.bench import BenchSettings, run_bench
    from elx.exporter.bench.results import report_markdown as markdown_table

    from elx.runners.generate import Generator

    folder = exported("t5")
    settings = BenchSettings(batch_size=2, input_length=6, num_beams=2, new_tokens=2, repeats=2, threads=1)
    together = run_bench([folder], settings, progress="none")
    gen, calls = Generator.from_folder(folder, threads=1), []

    def peer(inputs):  # a stand-in peer: elx's tokens, which the interleaved run found equal to HF's
        calls.append("peer")
        return gen.generate(inputs, **settings.generation()).sequences

    settings.one_at_a_time = True
    alone = run_bench([folder], settings, peers={"stand-in": peer}, progress="plain")
    err = capsys.readouterr().err
    assert [s["system"] for s in alone["systems"]] == ["HF generate (PyTorch)", "stand-in", "elx baseline"]
    assert calls == ["peer"] * 3  # warm-up and two rounds
    assert all(s["tokens_equal_hf"] for s in together["systems"] + alone["systems"])
    assert [len(s["all_seconds"]) for s in alone["systems"]] == [2, 2, 2]
    assert err.count("warm-up (tokens and live state)") == 3 and err.count("round 2 of 2") == 3
    by_name = {s["system"]: s for s in together["systems"]}
    assert alone["systems"][2]["state_bytes"] == by_name["elx baseline"]["state_bytes"]
    assert "systems ran one at a time" in markdown_table(alone)
    assert "one at a time" not in markdown_table(together)


def test_one_at_a_time_converts_the_peers_before_hf_and_loads_them_after_its_model_is_released(exported,
                                                                                                 monkeypatch):
    """At SmolLM2-1.7B a peer ran beside HF's model (22.7 GB, past this machine's memory for onnxruntime-genai's
    preallocated beam cache): under ``--one-at-a-time`` each peer is now converted from HF's model first, and
    loaded only after HF has run and its model is gone; an unavailable peer is skipped with its reason."""
    import gc
    import weakref

    import elx.exporter.bench.peers as peers
    import elx.exporter.source.load as sources
    from elx.exporter.bench.bench import BenchSettings, run_bench
    from elx.runners.generate import Generator

    folder = exported("t5")
    settings = BenchSettings(batch_size=2, input_length=6, num_beams=2, new_tokens=2, repeats=1, threads=1,
                             one_at_a_time=True)
    gen, events, hf = Generator.from_folder(folder, threads=1), [], []
    reload = sources.reload_model
    monkeypatch.setattr(sources, "reload_model", lambda source: hf.append(weakref.ref(m := reload(source))) or m)

    class Stand(peers.Peer):
        name = "stand-in"

        def __init__(self, hf_model, source, work, settings):
            events.append(("convert", hf_model is hf[0]()))

        def load(self):
            gc.collect()
            events.append(("load", hf[0]() is None))
            self.model = gen

        def _generate(self, inputs, settings):
            return self.model.generate(inputs, **settings.generation()).sequences

    class Missing(peers.Peer):
        def __init__(self, *args):
            raise peers.PeerUnavailable("not here")

    monkeypatch.setitem(peers.PEERS, "ct2", Stand)
    monkeypatch.setitem(peers.PEERS, "ort-genai", Missing)
    report = run_bench([folder], settings, peer_names=["ct2", "ort-genai"], progress="none")
    assert events == [("convert", True), ("load", True)]  # converted from HF's model; loaded once it was released
    assert [s["system"] for s in report["systems"]] == ["HF generate (PyTorch)", "stand-in", "elx baseline"]
    assert all(s["tokens_equal_hf"] for s in report["systems"])
    assert report["skipped_peers"] == {"ort-genai": "not here"}


def test_a_bench_that_cannot_fit_in_memory_is_refused_before_it_runs(exported):
    """Weights that cannot be held together refuse the interleaved bench in one line naming --one-at-a-time;
    one at a time, only a system larger than the memory left is refused."""
    from elx.exporter.bench.bench import check_memory, held_bytes
    from elx.runners.errors import ElxError

    folder = exported("t5")
    size = held_bytes(folder)
    assert size >= sum(p.stat().st_size for p in folder.glob("*.onnx"))
    check_memory([folder, folder], 1, 100, False, available=2 * size + 100)
    with pytest.raises(ElxError, match="add --one-at-a-time") as refused:
        check_memory([folder, folder], 1, 100, False, available=2 * size + 99)
    assert "2 elx export(s)" in str(refused.value) and "1 peer(s)" in str(refused.value)
    check_memory([folder, folder], 1, 100, True, available=size - 100)  # HF's model released before elx runs
    with pytest.raises(ElxError, match="the largest elx export needs"):
        check_memory([folder], 0, 100, True, available=size - 101)
    check_memory([folder], 1, 2**31, True, available=size)  # a peer loads after HF's model is released
    with pytest.raises(ElxError, match="HF generate's cache beside its model needs"):  # HF's run: model + cache
        check_memory([folder], 1, 2**31, True, available=size, cache=size + 1)
    check_memory([folder], 1, 100, False, available=size + 202, cache=51)  # interleaved: HF's cache and the peer's
    with pytest.raises(ElxError, match="HF's cache"):
        check_memory([folder], 1, 100, False, available=size + 201, cache=51)


def test_a_pass_set_is_made_from_the_baseline_without_loading_the_model_again(tmp_path, monkeypatch):
    """The 1.7B slim bench exported the model a second time for ``slim`` after the baseline, in the same
    process, and was killed for memory: a pass set whose baseline is cached or asked for is now the baseline
    with the passes applied (their verification as in ``elx export --pass``); pass sets come back in the order
    asked, and a second call reuses every folder."""
    import shutil

    import elx.exporter.export as export
    from elx.exporter.bench.bench import ensure_exports

    exports, applied = [], []
    real_export, real_apply = export.export_model, export.apply_passes
    monkeypatch.setattr(export, "export_model", lambda *a, **k: exports.append(a[1].name) or real_export(*a, **k))
    monkeypatch.setattr(export, "apply_passes", lambda *a, **k: applied.append(a[1].name) or real_apply(*a, **k))
    folders = ensure_exports("t5-tiny", True, ["el", "baseline", "el@int8"], tmp_path)
    assert [f.name for f in folders] == ["el", "baseline", "el-int8"]
    assert exports == ["baseline", "el-int8"] and applied == ["el"]  # int8 quantizes after the passes: its own
    from elx.runners.manifest import Manifest

    manifest = Manifest.load(folders[0])
    assert [p["name"] for p in manifest.data["passes"]] == ["el"] and "max_abs_logits_diff" in manifest.data["passes"][0]
    assert Manifest.load(folders[1]).data["verification"] == manifest.data["verification"]  # the baseline's, vs PyTorch
    assert ensure_exports("t5-tiny", True, ["baseline", "el", "el@int8"], tmp_path) == [folders[1], folders[0], folders[2]]
    assert len(exports) == 2 and len(applied) == 1
    # a damaged cached baseline (a file its manifest lists is gone) is exported again, never derived from
    (folders[1] / "weights.data").unlink()
    shutil.rmtree(folders[0])
    assert ensure_exports("t5-tiny", True, ["baseline", "el"], tmp_path) == folders[1:2] + folders[:1]
    assert exports[2:] == ["baseline"] and applied[1:] == ["el"] and (folders[1] / "weights.data").is_file()


# -- what the bench prints and keeps (exporter/bench/results.py) -----------------------------------------------

def _fabricated(medians: dict, states: dict, rows: dict, smoke=False, new_tokens=32, batch=32) -> dict:
    """A bench report as run_bench returns it, from medians, input-state bytes and (same, of) rows per system."""
    hf = medians["HF generate (PyTorch)"]
    systems = [{"system": name, "median_s": m, "samples_per_s": batch / m, "tokens_per_s": batch * new_tokens / m,
                "speedup_vs_hf": hf / m, "state_bytes": states.get(name), "cache_bytes": states.get(name) and 3 * 2**20,
                "peak_rss_growth_bytes": 700 * 2**10, "tokens_equal_hf": rows[name][0] == rows[name][1],
                "rows_equal_hf": list(rows[name]), "note": "", "gflops_per_s": 12.5, "roofline_fraction": 0.1,
                "time_over_floor": m / 0.25, "all_seconds": [m, m * 1.05, m * 0.98]} for name, m in medians.items()]
    return {"settings": {"batch_size": batch, "input_length": 256, "num_beams": 4, "new_tokens": new_tokens,
                         "no_repeat_ngram_size": 0, "repeats": 3, "smoke": smoke},
            "model": {"model": "t5-small", "random_init": True, "seed": 0}, "matmul_peak_gflops": 180.0,
            "read_bandwidth_gb_s": 13.5, "flops_per_generate": 2.5e10,
            "roofline": {"floor_s": 0.25, "bytes": 4e9, "layout": "kv", "memory_bound_phases": 32, "phases": 33},
            "skipped_peers": {}, "systems": systems}


def test_the_first_lines_conclude_from_the_runs_own_numbers():
    """One line per elx pass set, first: its speed against HF and each peer (medians of the same run), its rows
    with HF's tokens, its input state against the elx baseline's; nothing in it is fixed text but the words."""
    from elx.exporter.bench.results import report_markdown as markdown_table
    from elx.exporter.bench.results import conclusion_lines

    medians = {"HF generate (PyTorch)": 2.84, "elx baseline": 1.9, "elx el": 2.0, "CTranslate2": 1.94,
               "ORT BeamSearch op": 2.5}
    states = {"elx baseline": 12 * 2**20, "elx el": 2**20}
    rows = {name: (32, 32) for name in medians} | {"CTranslate2": (27, 32)}
    report = _fabricated(medians, states, rows)
    assert conclusion_lines(report) == [
        "elx baseline: 1.49× HF, 1.02× CTranslate2, 1.32× ORT BeamSearch op, tokens = HF on 32/32 rows; "
        "input state 12.0 MB",
        "elx el: 1.42× HF, 0.97× CTranslate2, 1.25× ORT BeamSearch op, tokens = HF on 32/32 rows; "
        "input state 12× smaller than elx baseline's (1.00 MB vs 12.0 MB)"]
    assert markdown_table(report).splitlines()[:2] == conclusion_lines(report)
    # other numbers, other words: a slower el, two rows off HF's, a larger state; a smoke run says so
    medians["elx el"], states["elx el"], rows["elx el"] = 4.0, 18 * 2**20, (30, 32)
    changed = conclusion_lines(_fabricated(medians, states, rows, smoke=True))
    assert changed[1] == ("elx el: 0.71× HF, 0.48× CTranslate2, 0.62× ORT BeamSearch op, tokens = HF on 30/32 rows; "
                          "input state 1.50× larger than elx baseline's (18.0 MB vs 12.0 MB) "
                          "(smoke run, not a measurement)")
    # no baseline in the run: the state is said, not compared; no peers: HF alone
    only = _fabricated({"HF generate (PyTorch)": 1.0, "elx el": 0.5}, {"elx el": 96 * 2**10},
                       {"HF generate (PyTorch)": (4, 4), "elx el": (4, 4)})
    assert conclusion_lines(only) == ["elx el: 2.00× HF, tokens = HF on 4/4 rows; input state 96.0 KB"]
    # a decoder's per-beam prompt keeps no input state: said as 0 B beside the reference's
    forms = ["HF generate (PyTorch)", "elx baseline (prompt beam-shared)", "elx baseline (prompt per-beam)"]
    decoder = _fabricated(dict(zip(forms, (1.0, 0.5, 0.8))), dict(zip(forms[1:], (3000, 0))),
                          {n: (2, 2) for n in forms})
    assert conclusion_lines(decoder)[1] == ("elx baseline (prompt per-beam): 1.25× HF, tokens = HF on 2/2 rows; input "
                                            "state 0 B (elx baseline (prompt beam-shared)'s: 2.93 KB)")


def test_memory_takes_the_unit_that_keeps_its_digits():
    """The input-state column rounded to 0.0/0.1 MB at t5-tiny sizes (issue 42): each value takes its own unit."""
    from elx.exporter.bench.results import details_markdown, human_bytes, summary_markdown

    assert [human_bytes(n) for n in (None, 0, 512, 1536, 96 * 2**10, 1023 * 2**10, 12 * 2**20, 5 * 2**30)] == \
        ["-", "0 B", "512 B", "1.50 KB", "96.0 KB", "1023 KB", "12.0 MB", "5.00 GB"]
    assert human_bytes(2**20 + 2**19) == "1.50 MB" and human_bytes(40_000) == "39.1 KB"
    names = ["HF generate (PyTorch)", "elx baseline", "elx el"]
    report = _fabricated(dict(zip(names, (0.4, 0.1, 0.12))), {"elx baseline": 49_408, "elx el": 12_544},
                         {n: (2, 2) for n in names}, new_tokens=8, batch=2)
    summary = summary_markdown(report)
    assert "| elx el | 15.0 | 133 | 0.120 | 3.33× | 12.2 KB | 3.00 MB | 700 KB | yes |" in summary
    assert "| elx baseline | 12.5 | 160 | 0.100 | 4.00× | 48.2 KB |" in summary
    assert "input state 3.94× smaller than elx baseline's (12.2 KB vs 48.2 KB)" in summary
    assert "0.0 MB" not in summary and " 0.0 " not in summary
    # the jargon is in the details section only
    assert "time / floor" not in summary and "GFLOP" not in summary and "memory" not in summary.split("|")[0]
    assert "| elx el | 0.120 | 16.67 | 12.5 | 0.48× | 0.120, 0.126, 0.118 |" in details_markdown(report)


def test_each_run_has_its_own_results_folder_and_latest_points_at_the_newest(tmp_path, monkeypatch):
    import os

    from elx.exporter.bench.results import latest_folder, new_results_folder, save_bench

    root = tmp_path / "t5-tiny" / "results"
    names = ["HF generate (PyTorch)", "elx el"]
    first = new_results_folder(root, now=1_795_861_865.0)
    save_bench(_fabricated(dict(zip(names, (1.0, 0.5))), {}, {n: (2, 2) for n in names}), first)
    second = new_results_folder(root, now=1_795_861_865.0)  # the same second: a suffix, not the same folder
    save_bench(_fabricated(dict(zip(names, (1.0, 0.25))), {}, {n: (2, 2) for n in names}), second)
    import time

    assert first.name == time.strftime("%Y-%m-%dT%H-%M-%S", time.localtime(1_795_861_865.0))
    assert second.name == first.name + "-2" and first != second
    assert sorted(p.name for p in root.iterdir()) == [first.name, second.name, "latest"]
    assert latest_folder(root) == second and (root / "latest").resolve() == second.resolve()
    assert (root / "latest" / "bench.md").read_text().startswith("elx el: 4.00× HF")
    assert (first / "bench.md").read_text().startswith("elx el: 2.00× HF")  # the earlier run is kept as it was
    assert json.loads((first / "bench.json").read_text())["systems"][1]["median_s"] == 0.5
    unfinished = new_results_folder(root, now=1_795_861_865.5, point=False)  # the CLI's: pointed once written
    assert unfinished.is_dir() and latest_folder(root) == second
    unfinished.rmdir()
    third = new_results_folder(root, now=1_795_861_866.0)
    assert third.name > second.name and latest_folder(root) == third
    # where links cannot be made, latest is a file holding the folder's name
    monkeypatch.setattr(os, "symlink", lambda *a, **k: (_ for _ in ()).throw(OSError("no links here")))
    fourth = new_results_folder(root, now=1_795_861_867.0)
    assert (root / "latest").is_file() and not (root / "latest").is_symlink()
    assert latest_folder(root) == fourth and len(list(root.iterdir())) == 5


def test_a_saved_run_has_its_plot_whenever_matplotlib_imports(tmp_path, monkeypatch):
    """``tools/setup.sh`` installs matplotlib: there the plot is drawn; without it, one line says why not."""
    import importlib.util

    from elx.exporter.bench.results import save_bench

    names = ["HF generate (PyTorch)", "elx baseline", "elx el"]
    report = _fabricated(dict(zip(names, (0.4, 0.1, 0.12))), {}, {n: (2, 2) for n in names}, smoke=True)
    (tmp_path / "a").mkdir()
    printed = save_bench(report, tmp_path / "a").splitlines()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "a" / "bench.png").stat().st_size > 1000
        assert f"wrote {tmp_path / 'a' / 'bench.png'}" in printed
    else:
        assert not (tmp_path / "a" / "bench.png").exists()
    assert printed[0].startswith("elx baseline: 4.00× HF") and printed[-1].startswith("details (roofline")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    (tmp_path / "b").mkdir()
    printed = save_bench(report, tmp_path / "b").splitlines()
    assert [line for line in printed if line.startswith("no plot: matplotlib is not installed")]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["bench.json", "bench.md"]


def test_setup_installs_matplotlib_on_its_own_line():
    """The bench extra fails as a whole when one of its packages cannot install; matplotlib has its own line."""
    from pathlib import Path

    lines = (Path(__file__).parents[1] / "tools" / "setup.sh").read_text().splitlines()
    assert any(line.startswith("$PIP matplotlib") for line in lines)
