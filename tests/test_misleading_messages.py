"""Messages that named the wrong thing (issue 23, class 6): ``elx bench --work`` refusals named ``--output`` (an
option bench does not have).  Each is refused before any export, in one line naming ``--work``.  (The manifest
version written as a string: ``tests/test_manifest_schema.py``.)
"""
from __future__ import annotations

import json
import shutil

import pytest

from elx.cli import main


def bench_refusal(capsys, work) -> str:
    code = main(["bench", "--quick", "--work", str(work)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("elx: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def export_spot(work):
    """Where ``elx bench --quick --work WORK`` keeps its baseline export."""
    return work / "t5-tiny" / "exports" / "baseline"


@pytest.mark.parametrize("setup,expected", [
    (lambda work: work.write_text("a file"), "is a file; choose another --work"),
    (lambda work: (export_spot(work).mkdir(parents=True), (export_spot(work) / "notes.txt").write_text("mine")),
     "holds 'notes.txt', which elx did not write"),
    (lambda work: ((work / "elsewhere").mkdir(parents=True), export_spot(work).parent.mkdir(parents=True),
                   export_spot(work).symlink_to(work / "elsewhere")), "is a symbolic link; choose another --work"),
])
def test_bench_work_refusals_name_work(tmp_path, capsys, setup, expected):
    work = tmp_path / "work"
    setup(work)
    line = bench_refusal(capsys, work)
    assert expected in line and "--work" in line and "--output" not in line


def test_bench_work_holding_an_elx_export_with_a_user_file(tmp_path, capsys, exported):
    """An earlier bench export (of another model) that the user added a file to: kept, refused naming --work."""
    work = tmp_path / "work"
    spot = export_spot(work)
    spot.parent.mkdir(parents=True)
    shutil.copytree(exported("t5"), spot)
    (spot / "notes.txt").write_text("mine")
    line = bench_refusal(capsys, work)
    assert "holds 'notes.txt'" in line and "--work" in line and "--output" not in line
    assert (spot / "notes.txt").read_text() == "mine" and json.loads((spot / "manifest.json").read_text())
