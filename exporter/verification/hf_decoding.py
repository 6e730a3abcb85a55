"""HF's decoder logits along known token sequences, computed as HF ``generate`` computes them.

Teacher forcing (``elx compare``), the prefill reference of the fp16 checks and the tests' HF
logits backend need HF's logits at every position of given decoder sequences.  For most families
one uncached forward over the whole sequence gives them: the decoder is causal and a token's
position is its index.  For M2M100 and FSMT it does not (``Family.full_sequence_is_stepwise``):

* their positions count the non-pad tokens of the chunk fed (``cumsum(ids != pad)``, plus the cache
  length), so a pad token inside a sequence (HF pads finished rows; a random model may also emit
  the pad id) shifts every later position in one forward but not step by step;
* FSMT's uncached forward builds its causal mask only when handed ``input_ids`` with
  ``use_cache=False``: over encoder outputs it attends to later tokens.

There the sequence is replayed one token at a time through HF's own cache: the computation of HF's
cached ``generate``, which the exported step graphs reproduce.
"""
from __future__ import annotations

from elx.exporter.families.catalog import hf_full_sequence_is_stepwise


def hf_decoder_logits(model, encoder_hidden_states, attention_mask, decoder_input_ids, **full_sequence_options):
    """Logits [rows, T, vocab] of ``model`` at every position of ``decoder_input_ids`` [rows, T] over the
    encoder output; ``full_sequence_options`` go to the single forward where that is HF's computation."""
    if hf_full_sequence_is_stepwise(model):
        return model(encoder_outputs=(encoder_hidden_states,), attention_mask=attention_mask,
                     decoder_input_ids=decoder_input_ids, **full_sequence_options).logits
    import torch

    cache, steps = None, []
    for t in range(decoder_input_ids.shape[1]):
        out = model(encoder_outputs=(encoder_hidden_states,), attention_mask=attention_mask,
                    decoder_input_ids=decoder_input_ids[:, t: t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(out.logits[:, -1])
    return torch.stack(steps, dim=1)
