"""Capture: HF's PyTorch modules traced into the export's ONNX graphs (``elx export``'s first stage).

``onnx_export.py`` traces the graph wrappers (``wrappers.py``; ``decoder_only.py`` for the prefill and step graphs of
decoder-only models) with torch's dynamo exporter, through elx's attention function (``attention.py``, with
``grouped_attention.py`` for GQA/MQA, ``shared_prompt.py`` for the beam-shared prompt, ``fsmt_attention.py`` for
FSMT's own modules); ``last_position.py`` rewrites the traced head; ``shared_weights.py`` stores each weight once.
``stitched.py`` (``Capture``) traces a 3-layer template and stitches the other layers (``template.py``,
``stitch.py``, ``weights.py``, ``parallel.py``) where it applies, else traces the whole model.
"""
