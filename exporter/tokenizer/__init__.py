"""Tokenizer: what the torch-free runtime needs of the checkpoint's tokenizer, written at export and checked.

``export.py`` writes ``tokenizer/`` (``tokenizer.json``, ``elx_text.json``) for every tokenizer the checkpoint
ships, and ``check.py`` holds the runtime's tokenizer to HF's answers; ``languages.py`` reads a translation
tokenizer's language codes for the manifest; ``chat_template.py`` keeps the chat template and checks it renders
as transformers does.  (Not ``tokenizers/``, the name of the library it uses.)
"""
