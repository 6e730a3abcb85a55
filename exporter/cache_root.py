"""Where elx keeps what it can make again (exports of ``elx.from_pretrained``, traced templates, compiled TensorRT
plugins): ``$ELX_CACHE_DIR``, else ``$XDG_CACHE_HOME/elx``, else ``~/.cache/elx``."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ELX_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                                os.path.expanduser("~/.cache"), "elx"))
