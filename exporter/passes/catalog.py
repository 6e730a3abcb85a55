"""Each graph pass as the command line sees it: its name, its place in the order, its argument, the passes
it cannot be combined with and the models it does not apply to.  The math is in the pass's own module.

Light on purpose (no numpy, onnx, onnx-graphsurgeon or PyTorch): ``elx export --pass ...`` checks every
name, argument, combination and model kind with it before any heavy import, so that a bad ``--pass``
is refused at once (issue 27).  Each pass module takes its declaration from here (``SPEC``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from elx.runners.errors import ElxError

SKIP_BAD = "skip-bad"  # slim, slim-cross: leave the layers that fail verification as they are
FP64 = "fp64"  # el-self: the score product (q_i·W_K,iᵀ)·Xᵀ accumulated in float64
KINDS = ("decoder-only", "encoder-decoder")


@dataclass(frozen=True)
class PassSpec:
    name: str
    module: str  # the module of elx.exporter.passes that applies it
    order: int  # passes run in this order, whatever order they are listed in
    parse: Callable[[str | None], object]  # the NAME=ARGUMENT argument (None when absent), checked and parsed
    conflicts: dict = field(default_factory=dict)  # other pass name → why they cannot be combined
    # (family, kind, dims) → why the pass does not apply to such a model, or None; dims may be None when
    # only the family is known yet (the command line before loading the model): then only what the family
    # alone decides is refused
    refuses: Callable[[str, str, dict | None], str | None] = lambda family, kind, dims: None
    kind_modules: dict = field(default_factory=dict)  # model kind → the module that applies it there instead


def _no_argument(name: str):
    def parse(argument: str | None) -> None:
        if argument:
            raise ElxError(f"pass {name} takes no argument (got {argument!r}); use --pass {name}")
    return parse


def skip_bad_argument(name: str):
    """A per-layer pass's argument: none, or ``skip-bad`` (leave out the layers that fail instead of refusing)."""
    def parse(argument: str | None) -> bool:
        if argument in (None, ""):
            return False
        if argument == SKIP_BAD:
            return True
        raise ElxError(f"pass {name} takes no argument or {SKIP_BAD!r} (got {argument!r}); e.g. "
                       f"--pass {name}={SKIP_BAD}")
    return parse


def _fp64_argument(argument: str | None) -> str | None:
    if argument not in (None, "", FP64):
        raise ElxError(f"pass el-self takes no argument or {FP64!r} (got {argument!r}); e.g. --pass el-self or "
                       f"--pass el-self={FP64}")
    return argument or None


def _ngram_size(argument: str | None) -> int:
    try:
        n = int(argument)
    except (TypeError, ValueError):
        raise ElxError(f"pass ngram needs the n-gram size, e.g. --pass ngram=3 (got {argument!r})")
    if n < 1:
        raise ElxError(f"pass ngram needs an n-gram size >= 1 (got {n})")
    return n


def _refuses_kind(reasons: dict):
    return lambda family, kind, dims: reasons.get(kind)


def _is_rotary(family: str) -> bool:
    from elx.exporter.families.rope import is_rotary

    return is_rotary(family)


GQA = ("slim attention needs W_K square ([d, h·d_k] with h·d_k = d) to compute V from K; with {kv} key/value heads "
       "for {heads} query heads (GQA/MQA) K spans only {kv}·d_k of d dimensions and does not determine V")
KEY_NORM = ("{family} normalizes each head's key (an RMSNorm of x·W_K per head, k_norm) before RoPE and the cache: the "
            "cached K is no affine function of the layer's input, so V is no function of the cached K (slim attention "
            "needs V = K·W_K⁻¹·W_V)")
# families whose attention normalizes K per head before caching it (decided from the family alone)
KEY_NORM_FAMILIES = {"qwen3": "Qwen3"}
ROPE = ("RoPE rotates each cached key by its own position (K_n = R_n·(x_n·W_K)), so W_K cannot move to the query "
        "side as one product (q·W_Kᵀ)·Xᵀ over all keys: EL-attention would recompute every key each step; "
        "--pass slim keeps the keys before RoPE instead (MHA models)")


def _slim_refuses(family: str, kind: str, dims: dict | None) -> str | None:
    """Decoder-only models without rotary positions, models that normalize K per head (Qwen3), and GQA/MQA models
    (``slim_rope.py``: V is no function of K there; decided only when ``dims`` give both head counts)."""
    if kind == "encoder-decoder":
        return None
    if not _is_rotary(family):
        return ("its decoder-only rewrite is for models with rotary positions (Llama-family: the K cache kept "
                "before RoPE); GPT-2/OPT graphs are not supported")
    if family in KEY_NORM_FAMILIES:
        return KEY_NORM.format(family=KEY_NORM_FAMILIES[family])
    heads, kv = (dims or {}).get("num_heads"), (dims or {}).get("num_kv_heads")
    if heads and kv and kv != heads:
        return GQA.format(kv=kv, heads=heads)
    return None


def _el_self_refuses(family: str, kind: str, dims: dict | None) -> str | None:
    """el-self applies to every model kind except rotary-position decoder-only models (``ROPE``)."""
    return ROPE if _is_rotary(family) else None


def _unpad_refuses(family: str, kind: str, dims: dict | None) -> str | None:
    """Families whose inputs are never a padded batch (Whisper's fixed-length features): nothing to remove."""
    from elx.exporter.families.catalog import family_named

    rules = family_named(family)
    if rules is not None and not rules.padded_inputs:
        return "its inputs are never padded (fixed-length features, no attention mask): there is nothing to remove"
    if rules is not None and rules.flattened_projections:
        return ("its projections run as Gemm on flattened [batch·sequence, d] rows (GPT-2's Conv1D), which the pass "
                "does not pack")
    return None


EL = PassSpec("el", "el", 10, _no_argument("el"),
              conflicts={"slim-cross": "el removes the cross-attention cache that slim-cross shrinks"},
              refuses=_refuses_kind({"decoder-only": "EL-attention rewrites cross-attention, which decoder-only "
                                                     "models do not have (their prompt's K/V are already shared by "
                                                     "the beams: --prompt-cache shared)"}))
SLIM_CROSS = PassSpec("slim-cross", "slim_cross", 15, skip_bad_argument("slim-cross"),
                      refuses=_refuses_kind({"decoder-only": "it shrinks the cross-attention cache, which "
                                                             "decoder-only models do not have"}))
SLIM = PassSpec("slim", "slim", 20, skip_bad_argument("slim"), refuses=_slim_refuses,
                kind_modules={"decoder-only": "slim_rope"})  # RoPE models: keys cached before RoPE
EL_SELF = PassSpec("el-self", "el_self", 25, _fp64_argument, refuses=_el_self_refuses,
                   kind_modules={"decoder-only": "el_self_decoder_only"},  # the prompt part too
                   conflicts={"slim": "both replace the self-attention K/V cache (slim keeps K only, el-self keeps X)"})
NGRAM = PassSpec("ngram", "ngram", 90, _ngram_size,  # last: it consumes the final logits
                 refuses=_refuses_kind({"decoder-only": "its in-graph blocker sees generated tokens only, while HF "
                                                        "counts the prompt's n-grams for decoder-only models; their "
                                                        "n-gram blocking runs in the search"}))

FUSED_ATTENTION = PassSpec(
    "fused-attention", "fused_attention", 70, _no_argument("fused-attention"),
    conflicts={"slim": "both rewrite the step graph's attention and its key cache",
               "el-self": "both rewrite the step graph's attention and its cache"},
    refuses=_refuses_kind({"encoder-decoder": "it fuses a decoder-only step graph's self-attention over one cache "
                                              "per row (--prompt-cache per-beam); encoder-decoder graphs are not "
                                              "supported"}))
RMS_NORM_FAMILIES = ("t5", "llama", "mistral", "qwen2", "qwen3", "phi3")  # Gemma's g is (1 + w): computed, not matched


def _fused_norm_refuses(family: str, kind: str, dims: dict | None) -> str | None:
    if family in RMS_NORM_FAMILIES:
        return None
    return (f"it fuses RMSNorm, which {family} does not use (its LayerNorms are one ONNX LayerNormalization node each "
            f"already); it applies to {', '.join(RMS_NORM_FAMILIES)}")


FUSED_NORM = PassSpec("fused-norm", "fused_norm", 85, _no_argument("fused-norm"), refuses=_fused_norm_refuses)
UNPAD = PassSpec("unpad", "unpad", 80, _no_argument("unpad"),  # after the passes that match projections by structure
                 refuses=_unpad_refuses)

PASSES = {spec.name: spec for spec in (EL, SLIM_CROSS, SLIM, EL_SELF, FUSED_ATTENTION, UNPAD, FUSED_NORM, NGRAM)}
PER_BEAM = {"fused-attention"}  # passes that need a decoder-only export's one cache per row (--prompt-cache per-beam)


def prompt_cache_refusal(names, form: str | None) -> str | None:
    """Why passes ``names`` cannot run on a decoder-only export whose prompt cache is ``form`` (None: the default,
    shared), or None."""
    needs = [name for name in names if name in PER_BEAM]
    if needs and (form or "shared") != "per-beam":
        return (f"pass {needs[0]} needs one cache per row (--prompt-cache per-beam): the default shared prompt cache "
                f"keeps the prompt's keys apart from the generated ones, which its fused kernel cannot take; add "
                f"--prompt-cache per-beam")
    return None


def precision_refusal(names, precision: str | None) -> str | None:
    """Why passes ``names`` cannot be converted to ``precision``, or None."""
    if precision == "fp16" and "fused-attention" in names:
        return ("--pass fused-attention runs ONNX Runtime's GroupQueryAttention in fp32 on the CPU; it is not converted "
                "to fp16: drop one of them (--precision int8 combines with it)")
    if precision == "fp16" and "fused-norm" in names:
        return ("--pass fused-norm matches fp32 RMSNorms; an fp16 export computes them in fp32 between two Casts, a "
                "form it does not rewrite: drop one of them (--precision int8 combines with it)")
    return None
