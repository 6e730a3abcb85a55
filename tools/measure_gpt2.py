"""Issue 12's measurement: HF generate vs elx with the per-beam prompt cache vs elx with the prompt shared.

    python tools/measure_gpt2.py [--model gpt2] [--batch-size 4] [--input-length 256] [--num-beams 4]
                                 [--new-tokens 32] [--repeats 3] [--work out/bench] [--genai]

Runs ``elx bench``'s machinery (one process, the same seeded left-padded prompts, warm-up, interleaved
repeats, tokens compared with HF's) on two exports of the same random-init model (``--prompt-cache
shared`` and ``per-beam``), and adds HF's own live cache: the bytes of the ``DynamicCache`` its
model returns at the last step (read with a forward hook), next to elx's per-input state and
cache bytes (the runner's live tensors).  ``--genai`` adds ONNX Runtime GenAI with its own search
(``tools/genai_peer.py``; needs ``pip install onnxruntime-genai``).  Prints a Markdown table and
writes it with the JSON report under ``WORK/<model>/results/gpt2_prompt_cache.*``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def hf_live_cache_bytes(model, inputs: dict, options: dict) -> int:
    """Bytes of the K/V cache HF's model holds after its last forward of one ``generate`` call."""
    import torch

    seen = {}

    def hook(_module, _args, output):
        cache = getattr(output, "past_key_values", None)
        if cache is not None:
            seen["bytes"] = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))

    handle = model.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model.generate(**{k: torch.from_numpy(v) for k, v in inputs.items()}, **options)
    finally:
        handle.remove()
    return seen["bytes"]


def main() -> None:
    import numpy as np

    from elx.exporter.bench.bench import BenchSettings, ensure_exports, run_bench
    from elx.exporter.bench.results import report_markdown as markdown_table
    from elx.exporter.source.load import reload_model
    from elx.runners.inputs.random_inputs import random_inputs
    from elx.runners.manifest import Manifest

    parser = argparse.ArgumentParser(description="GPT-2: HF vs elx per-beam prompt cache vs elx shared prompt")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--input-length", type=int, default=256)
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--work", default="out/bench")
    parser.add_argument("--genai", action="store_true", help="add onnxruntime-genai (own search) as a peer")
    args = parser.parse_args()

    work = Path(args.work) / args.model
    folders = ensure_exports(args.model, True, [""], work / "exports", prompt_caches=["per-beam", "shared"],
                             quiet=False)
    settings = BenchSettings(batch_size=args.batch_size, input_length=args.input_length, num_beams=args.num_beams,
                             new_tokens=args.new_tokens, repeats=args.repeats, threads=args.threads)
    manifest = Manifest.load(folders[0])
    peers = {}
    if args.genai:
        import importlib.util

        spec = importlib.util.spec_from_file_location("genai_peer", Path(__file__).with_name("genai_peer.py"))
        genai = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(genai)
        hf_model = reload_model(manifest.data["source"])
        peer = genai.GenAIPeer(genai.build(hf_model, work / "genai", manifest.dims["max_position_embeddings"]))
        peers[peer.name] = lambda inputs: peer.generate(inputs, settings.num_beams, settings.new_tokens)
    report = run_bench(folders, settings, peers=peers)
    inputs = random_inputs(manifest, settings.batch_size, settings.input_length, np.random.default_rng(settings.seed))
    hf_bytes = hf_live_cache_bytes(reload_model(manifest.data["source"]), inputs, settings.generation())
    report["hf_cache_bytes"] = hf_bytes
    table = markdown_table(report)
    table += f"\n\nHF generate's live K/V cache at its last step (DynamicCache, per row): {hf_bytes / 2**20:.1f} MB"
    out = work / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpt2_prompt_cache.json").write_text(json.dumps(report, indent=1))
    (out / "gpt2_prompt_cache.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
