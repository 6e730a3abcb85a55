"""Source: where ``--model`` comes from (a local HF folder, the HF cache, a preset with random weights, a GGUF file).

``locate.py`` reads what ``--model`` names without loading it (json only, no PyTorch: the command line finds the
architecture there and refuses what does not apply before any heavy import); ``load.py`` loads the model from the
same location, in eval mode, with its family and the manifest's ``source`` record.  Nothing here downloads.
"""
