"""GGUF files (llama.cpp's format) read into normal HF models: ``elx import-gguf`` and ``elx export --model X.gguf``.

transformers loads a GGUF file itself (``from_pretrained(..., gguf_file=...)``), dequantizing every tensor to
float32; elx adds what a command line needs around that: refusals in one line before any heavy import
(``header.py``: is it a GGUF file at all; ``metadata.py``: is it whole, what it holds; ``support.py``: can
transformers load its architecture and tensor types, does it fit in memory), the load into a plain HF model
that ``save_pretrained`` accepts (``load.py``), and the atomic write of an HF folder (``import_gguf.py``).
"""
