"""Families: what differs between the model architectures elx exports, answered without loading a model.

``family.py`` defines the ``Family`` strategy object and the graph inputs it names; ``catalog.py`` declares the
encoder-decoder families, GPT-2 and OPT and finds a family by architecture; ``rope.py`` declares the decoder-only
families with rotary positions; ``config_checks.py`` refuses config values that would crash or corrupt an export.
Light on purpose (no PyTorch): the command line reads families before any heavy import.
"""
