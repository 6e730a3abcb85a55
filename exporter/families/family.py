"""What a model family is at export time: the ``Family`` strategy object (one per family, ``catalog.py`` and
``rope.py`` declare them) and the graph inputs it names (``TensorSpec``)."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only: the command line reads families before importing PyTorch
    from torch import nn


@dataclass(frozen=True)
class TensorSpec:
    """One graph input: its name, element type and symbolic shape (ints are fixed sizes)."""

    name: str
    dtype: str  # "int64" | "float32"
    shape: tuple  # e.g. ("batch", "encoder_sequence")
    role: str  # what a runner feeds: "input_ids", "attention_mask", "input_features"


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    encoder_inputs: Callable[[object], tuple[TensorSpec, ...]]
    decoder_layers: Callable[[nn.Module], list]
    cross_attention: Callable[[nn.Module], nn.Module]
    cross_projections: Callable[[nn.Module], tuple[nn.Linear, nn.Linear]]
    dims: Callable[[object], dict]
    uses_encoder_mask: bool = True
    is_encoder_decoder: bool = True  # False: the prompt is the decoder's own input (exporter/capture/decoder_only.py)
    # refuses (one-line ``ElxError`` naming the config key) a config whose model elx would not reproduce
    check_config: Callable[[object], None] = lambda config: None
    # a context manager routing the family's attention through elx's attention function while a graph is
    # traced (``exporter/capture/attention.py``), for families whose attention does not call transformers'
    # ``AttentionInterface`` (FSMT); the model is as it was on exit
    attention_patch: Callable[[nn.Module], object] = lambda model: nullcontext()
    # the encoder mask [B, N] (0/1) → what the HF decoder takes as ``attention_mask`` (exporter/capture/wrappers.py)
    step_mask: Callable = None  # None: HF's eager additive [B, 1, 1, N] mask
    # whether HF's forward over a whole decoder sequence (no cache) computes what its cached ``generate``
    # computes step by step; False: M2M100 and FSMT count positions past pad tokens differently in the two,
    # and FSMT's uncached decoder is not causal (``exporter/verification/hf_decoding.py`` replays the steps there)
    full_sequence_is_stepwise: bool = True
    attention_implementations: tuple = ("eager", "sdpa")  # what HF can switch this family's attention to
    # whether its inputs come as a padded batch with an attention mask (token ids); False: fixed-length features
    padded_inputs: bool = True
    # whether its projections run as Gemm on flattened [B·N, d] rows (GPT-2's Conv1D): the unpad pass packs
    # products on [B, N, d] rows only, and refuses these
    flattened_projections: bool = False
