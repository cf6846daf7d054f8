"""Atomic writes: a failed write leaves the old file and no debris; files get the usual permissions."""

import json
import os
import stat

import pytest

from gemmdrift import files


def test_failed_write_keeps_the_old_file_and_leaves_nothing_behind(tmp_path):
    path = files.write_json(tmp_path / "summary.json", {"a": 1})
    with pytest.raises(RuntimeError):
        with files.atomic_path(path) as tmp:
            tmp.write_text("half written")
            raise RuntimeError("interrupted")
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = files.write_text(tmp_path / "report.html", "<p>x</p>")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600: results are meant to be shared


def test_json_has_no_nan(tmp_path):
    import numpy as np

    path = files.write_json(tmp_path / "x.json", {"nan": float("nan"), "inf": np.float64("inf"), "arr": np.arange(2)})
    assert json.loads(path.read_text()) == {"nan": None, "inf": None, "arr": [0, 1]}
