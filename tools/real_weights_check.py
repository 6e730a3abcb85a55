"""Real weights, real text: an elx export of a chat model against HF ``generate`` on chat-formatted English texts.

    python3 tools/real_weights_check.py EXPORT_DIR --texts FILE [--prompts 24] [--words 60] [--batch-size 4]
                                         [--settings greedy,beam,ngram,penalty,sample] [--json OUT.json]
                                         [--batches 3,5] [--details]

FILE holds one text per line (e.g. gensim's ``test/test_data/lee_background.cor``: 300 news articles).  Each
prompt is a chat turn, "Summarize this news story in one sentence: <the first WORDS words>", rendered by the
export's own chat template (the runtime's ``Generator.encoder_inputs(messages=...)``; checked to be the ids
transformers' ``apply_chat_template`` gives), batched and left-padded as HF pads.

Settings (each over every batch):

* ``greedy``: 48 new tokens; ``beam``: beams 2..6 (one per batch, cycling) with ``num_return_sequences`` 2;
* ``ngram``: beams 4 with ``no_repeat_ngram_size`` 3 and ``num_return_sequences`` 2;
* ``penalty``: greedy with ``repetition_penalty`` 1.3;
* ``sample``: seeded sampling (temperature 0.7, top_k 50, top_p 0.9): HF seeded by ``torch.manual_seed``,
  elx by ``seed=`` (the same draws when PyTorch is installed).

``--batches`` runs only those batches (1-based, with the settings they have in a whole run: beam's beam count
follows the batch's index), to look again at one batch of a long run; ``--details`` prints each batch's compare
report (each row's first divergence, HF's stability verdict and margin, the per-step logits differences).

Greedy/beam settings go through ``elx.exporter.verification.compare.compare_loaded``: tokens per row, HF's stability rule
for differing rows (fragile rows reported, not counted), the teacher-forced logits difference; beam settings
also compare ``sequences_scores``.  An int8 or fp16 export is judged as ``elx compare`` judges it.  Prints one
line per setting and a summary; exit 1 when a row differs where HF's answer is stable.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

SETTINGS = ("greedy", "beam", "ngram", "penalty", "sample")
QUESTION = "Summarize this news story in one sentence: "


def prompts(path: str, count: int, words: int) -> list[list[dict]]:
    texts = [line.strip() for line in open(path, encoding="utf-8") if line.strip()][:count]
    return [[{"role": "user", "content": QUESTION + " ".join(t.split()[:words])}] for t in texts]


def options_for(setting: str, batch_index: int) -> dict:
    if setting == "greedy":
        return {"max_new_tokens": 48}
    if setting == "beam":
        return {"num_beams": 2 + batch_index % 5, "num_return_sequences": 2, "max_new_tokens": 32}
    if setting == "ngram":
        return {"num_beams": 4, "no_repeat_ngram_size": 3, "num_return_sequences": 2, "max_new_tokens": 32}
    if setting == "penalty":
        return {"repetition_penalty": 1.3, "max_new_tokens": 48}
    return {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9, "max_new_tokens": 48}


def hf_scores(model, inputs: dict, options: dict):
    import torch

    with torch.no_grad():
        out = model.generate(**{k: torch.from_numpy(v) for k, v in inputs.items()}, **options,
                             return_dict_in_generate=True, output_scores=True)
    return out.sequences.numpy(), (None if out.get("sequences_scores") is None else out.sequences_scores.numpy())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("--texts", required=True)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--words", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--batches", default=None, help="1-based batch numbers to run (default: all)")
    parser.add_argument("--details", action="store_true", help="print each batch's compare report")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    import elx
    from elx.exporter.verification.compare import compare_loaded, format_report
    from elx.exporter.source.load import reload_model
    from elx.exporter.verification.stability import HfVariants

    generator = elx.Generator.from_folder(args.export, threads=args.threads)
    model = reload_model(generator.manifest.data["source"])
    source = generator.manifest.data["source"].get("path")
    chats = prompts(args.texts, args.prompts, args.words)
    tokenizer = AutoTokenizer.from_pretrained(source) if source else None
    if tokenizer is not None:  # the runtime's chat ids are transformers' (tests/test_chat.py holds this widely)
        for chat in chats:
            ours = generator.encoder_inputs(messages=[chat])["input_ids"][0].tolist()
            theirs = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
            theirs = theirs["input_ids"] if hasattr(theirs, "keys") else list(theirs)
            if ours != list(theirs):
                print(f"chat ids differ from apply_chat_template on {chat!r}")
                return 1
    variants = HfVariants(model)
    batches = [chats[i: i + args.batch_size] for i in range(0, len(chats), args.batch_size)]
    chosen = (set(range(len(batches))) if args.batches is None else
              {int(b) - 1 for b in args.batches.replace(",", " ").split()})
    if not chosen or not chosen <= set(range(len(batches))):
        print(f"--batches: numbers from 1 to {len(batches)} ({len(chats)} prompts in batches of {args.batch_size})")
        return 2
    results, failed = [], False
    for setting in args.settings.split(","):
        started = time.perf_counter()
        rows = identical = fragile = failures = scored = scores_equal = 0
        worst_logits, worst_score = 0.0, 0.0
        for b, batch in enumerate(batches):
            if b not in chosen:
                continue
            # a line per batch: an int8 export's differing rows each run HF's stability probes (minutes a batch)
            print(f"real_weights_check: {setting}: batch {b + 1} of {len(batches)} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            inputs = generator.encoder_inputs(messages=batch)
            options = options_for(setting, b)
            if setting == "sample":
                seed = 1000 + b
                torch.manual_seed(seed)
                with torch.no_grad():
                    hf = model.generate(**{k: torch.from_numpy(v) for k, v in inputs.items()}, **options).numpy()
                ours = generator.generate(inputs, seed=seed, **options).sequences
                for r in range(hf.shape[0]):
                    rows += 1
                    identical += int(r < ours.shape[0] and np.array_equal(hf[r], ours[r]))
                continue
            report = compare_loaded(generator, model, inputs=inputs, variants=variants, **options)
            # each batch's verdict as it is known (a run stopped by a time limit keeps the batches it finished)
            print(f"real_weights_check: {setting}: batch {b + 1}: {sum(r.identical for r in report.rows)} of "
                  f"{len(report.rows)} rows identical, {len(report.fragile)} fragile, {len(report.failures)} failures "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            if args.details:
                print(f"batch {b + 1} (prompts {b * args.batch_size + 1}-{b * args.batch_size + len(batch)}), "
                      f"{options}:\n{format_report(report, generator.manifest.pass_names())}", flush=True)
            rows += len(report.rows)
            identical += sum(r.identical for r in report.rows)
            fragile += len(report.fragile)
            failures += len(report.failures)
            worst_logits = max(worst_logits, report.max_logits_diff)
            if options.get("num_beams", 1) > 1:
                hf_seq, hf_s = hf_scores(model, inputs, options)
                out = generator.generate(inputs, **options)
                for r in range(hf_seq.shape[0]):
                    if report.rows[r].identical and hf_s is not None and out.sequences_scores is not None:
                        scored += 1
                        diff = abs(float(hf_s[r]) - float(out.sequences_scores[r]))
                        worst_score = max(worst_score, diff)
                        scores_equal += int(diff <= 1e-4)
        failed |= failures > 0 or (setting == "sample" and identical < rows)
        line = {"setting": setting, "rows": rows, "identical": identical, "fragile": fragile, "failures": failures,
                "max_teacher_forced_logits_diff": worst_logits, "beam_scores_compared": scored,
                "beam_scores_within_1e-4": scores_equal, "max_beam_score_diff": worst_score,
                "seconds": round(time.perf_counter() - started, 1)}
        results.append(line)
        print(json.dumps(line), flush=True)
    total = sum(r["rows"] for r in results)
    same = sum(r["identical"] for r in results)
    print(f"{args.export}: {same}/{total} rows identical to HF generate; "
          f"{sum(r['fragile'] for r in results)} fragile, {sum(r['failures'] for r in results)} failures")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"export": args.export, "precision": generator.manifest.data.get("precision"),
                       "prompts": len(chats), "words": args.words, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
