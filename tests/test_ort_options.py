"""elx's ONNX Runtime session options: pool threads spin (ORT's default) unless ``ELX_ORT_SPINNING=0``; the
verification's sessions (``prepack=False``) do not prepack their weights."""
from __future__ import annotations

import pytest

SPIN = "session.intra_op.allow_spinning"


def _entry(options, key):
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # ORT raises for a key never set
        return None


@pytest.mark.parametrize("value, expected", [(None, None), ("1", None), ("0", "0"), ("off", "0"), (" False ", "0"), ("yes", None)])
def test_spinning_follows_the_environment(monkeypatch, value, expected):
    from elx.runners.backends.ort import session_options

    if value is None:
        monkeypatch.delenv("ELX_ORT_SPINNING", raising=False)
    else:
        monkeypatch.setenv("ELX_ORT_SPINNING", value)
    assert _entry(session_options(2), SPIN) == expected


def test_prepacking_off_only_when_asked():
    from elx.runners.backends.ort import session_options

    assert _entry(session_options(2), "session.disable_prepacking") is None
    assert _entry(session_options(2, prepack=False), "session.disable_prepacking") == "1"
