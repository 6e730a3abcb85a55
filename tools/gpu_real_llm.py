"""A real chat LLM on a GPU: an elx export on ONNX Runtime's CUDA provider against HF ``generate`` on the same GPU.

    python3 tools/gpu_real_llm.py EXPORT_DIR --texts FILE [--device cuda] [--prompts 24] [--batches 1,8,24]
                                  [--settings greedy,beam] [--budget 240] [--json OUT.json]

The prompts are ``tools/real_weights_check.py``'s (a chat turn asking for a one-sentence summary of a news
story, rendered by the export's chat template, left-padded as HF pads).  For each setting (``greedy``: 48 new
tokens; ``beam``: 4 beams, 32 new tokens) and batch size, every batch runs once untimed (a warm-up and the
tokens compared), then twice more timed, HF and elx alternating; the faster round of each is kept.  Both are
fp32: PyTorch multiplies fp32 matrices in full fp32 on CUDA (``allow_tf32`` False, checked), elx's CUDA sessions
too (``use_tf32`` 0, ``runners/backends/ort_io.py``).

Exactness: each elx row against HF's row on the same GPU.  A differing row is then held against HF itself: HF
on the CPU (the same weights, fp32) for that batch, and for greedy rows HF's own top-1 / top-2 logit gap at the
first differing token (the margin), printed beside the export's verified logits error (the manifest's): a row
whose margin is below that error is fragile (HF's own answer does not survive perturbations of that size), one
above it a failure.  ``--budget`` seconds: settings and batch sizes not started by then are listed as skipped.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_weights_check import prompts  # noqa: E402  (the same chat prompts as the CPU check)

OPTIONS = {"greedy": {"max_new_tokens": 48, "do_sample": False},
           "beam": {"num_beams": 4, "max_new_tokens": 32, "do_sample": False}}


def strip(row: np.ndarray, pad: int) -> list[int]:
    """A generated row without the trailing pads HF and elx add to finished rows."""
    row = list(int(t) for t in row)
    while row and row[-1] == pad:
        row.pop()
    return row


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("--texts", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--words", type=int, default=60)
    parser.add_argument("--batches", default="1,8,24")
    parser.add_argument("--settings", default="greedy,beam")
    parser.add_argument("--budget", type=float, default=240.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()

    import torch

    import elx
    from elx.exporter.source.load import reload_model

    cuda = args.device == "cuda"
    generator = elx.Generator.from_folder(args.export, backend="ort-io" if cuda else "ort", device=args.device)
    manifest = generator.manifest.data
    verified = manifest["verification"]["export"]["max_abs_logits_diff"]
    reference = reload_model(manifest["source"]).float().eval()
    model = copy.deepcopy(reference).to(args.device) if cuda else reference
    pad = int(manifest["tokens"].get("pad_token_id") or 0) if isinstance(manifest.get("tokens"), dict) else 0
    device_line = torch.cuda.get_device_name(0) if cuda else "cpu"
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    print(f"gpu_real_llm: {device_line}; torch {torch.__version__} allow_tf32={tf32}; export verified logits error "
          f"{verified:.3g}; loaded in {time.perf_counter() - started:.0f} s", flush=True)
    if tf32:
        raise SystemExit("gpu_real_llm: error: PyTorch multiplies fp32 in TF32 here; HF would not be full fp32")
    chats = prompts(args.texts, args.prompts, args.words)

    def hf(batch_inputs: dict, options: dict, on) -> np.ndarray:
        with torch.no_grad():
            out = on.generate(**{k: torch.from_numpy(v).to(on.device) for k, v in batch_inputs.items()}, **options)
        if cuda:
            torch.cuda.synchronize()
        return out.cpu().numpy()

    def margin(row_ids: list[int], mask_prefix: int, position: int) -> float:
        """HF's own top-1 minus top-2 logit where the rows part (greedy: the token HF picked there)."""
        ids = torch.tensor([row_ids[mask_prefix:position]], device=args.device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])

    results = []
    for setting in args.settings.split(","):
        options = dict(OPTIONS[setting])
        for size in (int(b) for b in args.batches.split(",")):
            label = f"{setting} batch {size}"
            if time.perf_counter() - started > args.budget:
                results.append({"setting": setting, "batch": size, "skipped": "time budget"})
                print(f"gpu_real_llm: {label}: skipped (budget {args.budget:.0f} s spent)", flush=True)
                continue
            chosen = chats[: min(len(chats), 4)] if size == 1 else chats
            batches = [generator.encoder_inputs(messages=chosen[i: i + size]) for i in range(0, len(chosen), size)]
            rows = identical = fragile = failures = 0
            details = []
            for inputs in batches:  # untimed: warm-up and the tokens compared
                theirs = hf(inputs, options, model)
                ours = generator.generate(inputs, decode=False, **options).sequences
                prompt_len = inputs["input_ids"].shape[1]
                cpu_rows = None
                for r in range(theirs.shape[0]):
                    rows += 1
                    a, b = strip(theirs[r], pad), strip(ours[r], pad) if r < ours.shape[0] else []
                    if a == b:
                        identical += 1
                        continue
                    if cpu_rows is None:
                        cpu_rows = hf(inputs, options, reference) if cuda else theirs
                    on_cpu = strip(cpu_rows[r], pad)
                    hf_cpu_agrees = on_cpu == a
                    at = first_difference(a, b)
                    detail = {"row": r, "first_difference": at - prompt_len, "hf_cuda_equals_hf_cpu": hf_cpu_agrees,
                              "elx_equals_hf_cpu": on_cpu == b}
                    if setting == "greedy" and at < len(a):
                        left = int(inputs["attention_mask"][r].argmax())  # left padding: the first real token
                        detail["hf_margin"] = margin(a, left, at)
                        detail["fragile"] = detail["hf_margin"] <= verified or not hf_cpu_agrees
                    else:
                        detail["fragile"] = not hf_cpu_agrees
                    fragile += int(detail["fragile"])
                    failures += int(not detail["fragile"])
                    details.append(detail)
            times = {"hf": [], "elx": []}
            for _ in range(2):
                for system in ("hf", "elx"):
                    t0 = time.perf_counter()
                    for inputs in batches:
                        if system == "hf":
                            hf(inputs, options, model)
                        else:
                            generator.generate(inputs, decode=False, **options)
                    times[system].append(time.perf_counter() - t0)
            hf_s, elx_s = min(times["hf"]), min(times["elx"])
            line = {"setting": setting, "batch": size, "inputs": len(chosen), "rows": rows, "identical": identical,
                    "fragile": fragile, "failures": failures, "differing_rows": details,
                    "hf_s": round(hf_s, 3), "elx_s": round(elx_s, 3), "speedup": round(hf_s / elx_s, 2),
                    "rounds": {k: [round(t, 3) for t in v] for k, v in times.items()}}
            results.append(line)
            print(f"gpu_real_llm: {label}: {len(chosen)} inputs, HF {hf_s:.3f} s, elx {elx_s:.3f} s "
                  f"({hf_s / elx_s:.2f}x); {identical}/{rows} rows = HF ({fragile} fragile, {failures} failures); "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
            for d in details:
                print(f"    differing row: {json.dumps(d)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"export": args.export, "device": device_line,
                                               "torch": torch.__version__, "verified_logits_error": verified,
                                               "prompts": len(chats), "words": args.words, "results": results},
                                              indent=1), encoding="utf-8")
    return 1 if any(r.get("failures") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
