"""Issue 41's "Measure": export wall time and peak RSS of elx beside the converters, one machine, one run.

Each row is one command in a process of its own under ``/usr/bin/time -v`` (wall clock and maximum resident
set size as the kernel reports them), run one after the other, so that no two share the CPUs::

    python tools/measure_export_speed.py --work /tmp/export-speed \\
        --model smollm2-real=/work/real/smollm2-hf --model t5-base --model tinyllama-1.1b \\
        --systems elx,elx-trace,genai,ct2 --output docs/measurements/export_speed.md

``--model NAME=FOLDER`` names a real HF folder; a bare preset name is built with random weights and saved once as an
HF folder with transformers' ``save_pretrained`` (not timed; with the bench's placeholder tokenizer that the
converters need), which every system then reads: elx too, so that no row times a random initialization (1.1B:
15 s) that a real checkpoint's export does not do.  Systems:

* ``elx``: ``elx export --model M --output OUT --force`` (its verification included: logits against PyTorch fp32
  and fp64 on the verification cases), a first export: ``ELX_CACHE_DIR`` is WORK/cache/MODEL, emptied before the
  row, so the templates are built (a Llama: ``exporter/capture/llama_builder.py``) or traced;
* ``elx-traced``: the same with ``ELX_TEMPLATE_BUILDER=0``: a Llama's templates traced too (the first export before
  the builder);
* ``elx-warm``: the same again on the cache the model's ``elx`` row left (a re-export: the templates come from the
  cache, nothing is traced);
* ``elx-trace``: the same with ``ELX_CAPTURE=trace``: every layer traced by ``torch.onnx.export(dynamo=True)``,
  the mechanism before ``exporter/capture/`` (verification the same);
* ``elx-int8`` / ``elx-slim``: ``--precision int8`` / ``--pass slim=skip-bad`` on top of the export (first exports);
* ``elx+PASS``: ``--pass PASS`` on top of the export (``elx+el``, ``elx+el-self``, ``elx+unpad``; first exports);
* ``genai``: ``python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu`` (decoder-only models and
  Whisper: the builder's ``WhisperModel``, encoder and decoder built from the weights);
* ``ct2``: ``ct2-transformers-converter --model HF --output_dir OUT --force`` (fp32 weights; a BART folder through
  ``ct2_folder``'s config shim: the converter reads a key transformers 5 dropped).

The table's last column is the issue's memory bound, 2 x the fp32 weight bytes + 1 GiB.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

def timed(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 3600) -> dict:
    """Run ``cmd`` under /usr/bin/time -v; wall seconds, peak RSS (MiB), exit status, the log's last line."""
    start = time.perf_counter()
    with open(log, "w") as out:  # its own process group: a timeout stops the export too, not only /usr/bin/time
        child = subprocess.Popen(["/usr/bin/time", "-v", *cmd], stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            out.write(f"\nmeasure_export_speed: timed out after {timeout:.0f} s\n")
        done = child
    text = log.read_text(errors="replace")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    seconds = time.perf_counter() - start
    if wall:
        parts = [float(p) for p in wall.group(1).split(":")]
        seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("\t")]
    return {"seconds": round(seconds, 1), "peak_mib": int(rss.group(1)) // 1024 if rss else None,
            "status": done.returncode, "last": lines[-1][:200] if lines else ""}


def hf_folder(name: str, source: str | None, work: Path) -> Path:
    """The HF folder the converters read: the real one, or the preset saved once with random weights."""
    if source:
        return Path(source)
    folder = work / "hf" / name
    if not (folder / "config.json").exists():
        code = ("import sys, torch, transformers\n"
                "from elx.exporter.source.locate import find_preset\n"
                "p = find_preset(sys.argv[1]); torch.manual_seed(0)\n"
                "cls = getattr(transformers, p['architecture'])\n"
                "config = cls.config_class(**p['config'])\n"
                "cls(config).save_pretrained(sys.argv[2])\n"
                "from elx.exporter.bench.peers import _placeholder_tokenizer\n"
                "from pathlib import Path\n"
                "_placeholder_tokenizer(config.vocab_size, Path(sys.argv[2]))\n")
        subprocess.run([sys.executable, "-c", code, name, str(folder)], check=True)
    return folder


# the keys ctranslate2 4.x reads from a BART-like config that transformers 5 no longer writes, with each family's value
CT2_KEYS = {"bart": {"normalize_before": False},  # post-LayerNorm, the embedding LayerNorm (the default) kept
            "pegasus": {"normalize_before": True, "normalize_embedding": False}}


def ct2_folder(folder: Path, work: Path) -> Path:
    """The folder CTranslate2's converter reads: ``folder``, or for a BART or Pegasus config without the keys
    ctranslate2 4.x's loaders read and transformers 5 no longer writes (``CT2_KEYS``: BART's post-LayerNorm, what the
    converter assumed before; Pegasus' pre-LayerNorm and no embedding LayerNorm) a copy of it of links to the same
    files, its config.json given them."""
    config = json.loads((folder / "config.json").read_text())
    keys = {k: v for k, v in CT2_KEYS.get(config.get("model_type"), {}).items() if k not in config}
    if not keys:
        return folder
    shim = work / "ct2-shim" / folder.name
    shutil.rmtree(shim, ignore_errors=True)
    shim.mkdir(parents=True)
    for path in folder.iterdir():
        if path.name != "config.json":
            (shim / path.name).symlink_to(path.resolve())
    (shim / "config.json").write_text(json.dumps({**config, **keys}, indent=2))
    return shim


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) or sum(
        p.stat().st_size for p in folder.glob("*.bin"))


def dirty_mib() -> int:
    """The kernel's dirty page cache, MiB (``/proc/meminfo``): writes not yet on disk."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Dirty:"):
            return int(line.split()[1]) // 1024
    return 0


def measure_round(args, systems: list, round_: int) -> list:
    """Every model's systems once, each after ``os.sync()`` (the previous row's writes on disk: a converter that
    writes at its end was held to the disk's speed by the rows before it, GenAI's TinyLlama 17.2 s quiet against
    29.9 s after two exports)."""
    rows = []
    for spec in args.model:
        name, _, source = spec.partition("=")
        folder = hf_folder(name, source or None, args.work)
        weights = weight_bytes(folder)
        architecture = (folder / "config.json").read_text()  # as save_pretrained wrote it
        # GenAI's builder (0.18) builds decoder-only models and Whisper; no other encoder-decoder family
        genai_builds = "CausalLM" in architecture or "LMHeadModel" in architecture or "Whisper" in architecture
        for system in systems:
            if system == "genai" and not genai_builds:
                continue
            out = args.work / "out" / f"{name}-{system}"
            shutil.rmtree(out, ignore_errors=True)
            # elx's template cache (exporter/capture/template_cache.py): every elx row but ``elx-warm`` starts from an
            # empty one (a first export: templates built or traced); ``elx-warm`` reuses what the ``elx`` row left
            cache = args.work / "cache" / name
            if system.startswith("elx") and system != "elx-warm":
                shutil.rmtree(cache, ignore_errors=True)
            env = {"ELX_CACHE_DIR": str(cache)}
            if system.startswith("elx"):
                # every system reads the same HF folder (a preset's random init is not export time)
                cmd = [sys.executable, "-m", "elx", "export", "--model", str(folder), "--output", str(out), "--force"]
                cmd += {"elx-int8": ["--precision", "int8"], "elx-slim": ["--pass", "slim=skip-bad"]}.get(system, [])
                if "+" in system:  # elx+PASS: ``--pass PASS`` (one pass; ``elx+slim=skip-bad``, ``elx+el-self``)
                    cmd += ["--pass", system.partition("+")[2]]
                if system == "elx-trace":
                    env["ELX_CAPTURE"] = "trace"
                if system == "elx-traced":
                    env["ELX_TEMPLATE_BUILDER"] = "0"
            elif system == "genai":
                cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o", str(out),
                       "-p", "fp32", "-e", "cpu", "-c", str(args.work / "genai-cache")]
            elif system == "ct2":
                cmd = [shutil.which("ct2-transformers-converter") or "ct2-transformers-converter", "--model",
                       str(ct2_folder(folder, args.work)), "--output_dir", str(out), "--force"]
            else:
                raise SystemExit(f"unknown system {system}")
            os.sync()
            time.sleep(1)
            load, dirty = os.getloadavg()[0], dirty_mib()
            result = timed(cmd, args.work / f"{name}-{system}.log", env, args.timeout)
            row = {"model": name, "system": system, "round": round_, "weights_mb": round(weights / 2**20),
                   "load": round(load, 2), "dirty_mib": dirty, **result}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--model", action="append", required=True, help="preset, or NAME=HF_FOLDER")
    parser.add_argument("--systems", default="elx,genai,ct2")
    parser.add_argument("--output", type=Path, help="markdown table (default WORK/export_speed.md)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--keep", action="store_true", help="keep the outputs (WORK/out/MODEL-SYSTEM)")
    parser.add_argument("--rounds", type=int, default=1, help="every model and system again, N times in all")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    systems = [s for s in args.systems.split(",") if s]
    rows = []
    for round_ in range(1, args.rounds + 1):
        rows += measure_round(args, systems, round_)
    lines = ["| model | system | round | wall s | peak RSS MiB | bound 2W+1G MiB | exit | load before | dirty before MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bound = 2 * r["weights_mb"] + 1024
        lines.append(f"| {r['model']} | {r['system']} | {r['round']} | {r['seconds']} | {r['peak_mib']} | {bound} | "
                     f"{r['status']} | {r['load']} | {r['dirty_mib']} |")
    text = "\n".join(lines) + "\n"
    (args.output or args.work / "export_speed.md").write_text(text)
    (args.work / "export_speed.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
