"""Verification: an export held to HF's PyTorch model, at export (``verify.py``) and afterwards (``elx compare``).

``verify.py`` runs reference and candidate on the same seeded cases (shapes in ``shapes.py``) and bounds the
logits difference, with ``fp32_noise.py`` measuring fp32's own error; ``compare.py`` (``compare_decoder_only.py``
for decoder-only models) runs HF ``generate`` against the runner; ``hf_reference.py`` and ``hf_decoding.py`` give
HF's side; ``stability.py`` tells a bug from a fragile row; ``agreement.py`` measures token agreement over seeds.
(The folder is not ``verify/`` so that its main module keeps the name ``verify.py``.)
"""
