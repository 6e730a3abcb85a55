"""Precision: ``--precision fp16`` and ``--precision int8``, applied to the verified fp32 graphs last.

fp16: ``fp16.py`` holds the rule (which parts compute in fp16, shared with the TensorRT engines),
``fp16_check.py`` the tolerance and the fp16-arithmetic twins, ``fp16_export.py`` the conversion, checks and
record of an export.  int8: ``int8.py`` the rule and conversion, ``int8_layers.py`` which layers stay fp32,
``int8_check.py`` what is measured against HF fp32, ``int8_export.py`` the export's int8 step.
``decoder_only.py`` is the PyTorch side of both checks for decoder-only exports.
"""
