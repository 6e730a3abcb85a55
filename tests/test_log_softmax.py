"""The search's log-softmax (``elx.runners.search.log_softmax``): HF's kernel bit for bit, numpy without PyTorch, a clear
error for a bad ``ELX_LOG_SOFTMAX``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from elx.runners.search import log_softmax as ls
from elx.runners.errors import ElxError


def _rows(shape, scale=4.0, seed=0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("shape", [(7, 359), (32, 32128), (3, 51865), (1, 24)])
def test_default_is_hfs_kernel_bit_for_bit(shape, monkeypatch):
    """What HF's beam search computes (``log_softmax`` of float32 logits), in one batch or row by row."""
    monkeypatch.delenv(ls.ENV, raising=False)
    x = _rows(shape)
    want = torch.nn.functional.log_softmax(torch.from_numpy(x.copy()), dim=-1).numpy()
    assert ls.kernel() == "torch"
    buffer = x.copy()
    got = ls.log_softmax(buffer)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.shares_memory(got, buffer)  # in place: no fresh array each step
    assert np.array_equal(np.concatenate([ls.log_softmax(x[r:r + 1].copy()) for r in range(shape[0])]), want)


def test_numpy_kernel_is_close_but_not_bit_equal(monkeypatch):
    """Why the default is torch's: numpy's rounding of L = log Σ exp(x − m) differs by an ulp in some rows."""
    monkeypatch.setenv(ls.ENV, "numpy")
    x = _rows((2000, 512), scale=3.0, seed=1)
    want = torch.log_softmax(torch.from_numpy(x.copy()), dim=-1).numpy()
    got = ls.log_softmax(x.copy())
    assert ls.kernel() == "numpy"
    assert np.abs(got - want).max() <= 4 * np.finfo(np.float32).eps * np.abs(want).max()
    assert not np.array_equal(got, want)


def test_non_contiguous_input(monkeypatch):
    monkeypatch.delenv(ls.ENV, raising=False)
    x = _rows((6, 300))[:, ::2]
    want = torch.log_softmax(torch.from_numpy(x.copy()), dim=-1).numpy()
    assert np.array_equal(ls.log_softmax(x), want)
    frozen = _rows((6, 300))
    frozen.flags.writeable = False
    assert np.array_equal(ls.log_softmax(frozen), torch.log_softmax(torch.tensor(frozen), dim=-1).numpy())


@pytest.mark.parametrize("value", ["sleef", "TORCH2", "cupy"])
def test_unknown_kernel_is_refused(value, monkeypatch):
    monkeypatch.setenv(ls.ENV, value)
    with pytest.raises(ElxError, match=f"{ls.ENV}=.* is not a log-softmax kernel: set it to one of torch, numpy"):
        ls.log_softmax(_rows((2, 8)))


def test_without_torch(monkeypatch):
    """The runtime needs no PyTorch: numpy then, unless torch is asked for by name (one-line error)."""
    monkeypatch.setattr(ls, "_torch", lambda: None)
    monkeypatch.delenv(ls.ENV, raising=False)
    assert ls.kernel() == "numpy"
    x = _rows((3, 40))
    assert np.allclose(ls.log_softmax(x.copy()), torch.log_softmax(torch.from_numpy(x), dim=-1).numpy(), atol=1e-6)
    monkeypatch.setenv(ls.ENV, "torch")
    with pytest.raises(ElxError, match="PyTorch cannot be imported: install torch, or set ELX_LOG_SOFTMAX=numpy"):
        ls.kernel()


def test_bad_kernel_through_the_cli(monkeypatch, exported, capsys):
    """A bad setting reaches the user as one ``elx: error:`` line, exit 2."""
    from elx.cli import main

    folder = str(exported("t5"))
    capsys.readouterr()
    monkeypatch.setenv(ls.ENV, "fast")
    code = main(["generate", folder, "--input-ids", "5 6 7", "--num-beams", "2",
                 "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("elx: error: ELX_LOG_SOFTMAX='fast'"), err


def test_bad_kernel_is_refused_before_the_encoder_runs(monkeypatch, exported):
    """The setting is checked before any graph runs, not after the encoder's work."""
    from elx.runners.generate import Generator
    from elx.runners.model import Model

    gen = Generator.from_folder(exported("t5"))
    monkeypatch.setattr(Model, "encode", lambda *a, **k: pytest.fail("the encoder ran before the check"))
    monkeypatch.setenv(ls.ENV, "fast")
    with pytest.raises(ElxError, match="ELX_LOG_SOFTMAX='fast'"):
        gen.generate(input_ids=np.array([[5, 6, 7]]), num_beams=2, max_new_tokens=2)
