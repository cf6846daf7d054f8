"""The Result record and the store: validation, and a write/read round trip that loses nothing."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from gemmdrift.errors import GemmdriftError
from gemmdrift.result import TIDY_COLUMNS, Result, Verdict, tidy
from gemmdrift.store import check_out_dir, read_result, write_result


def _result(**kw):
    frame = tidy([{"tap": "logits", "metric": "rel_l2", "value": 0.25, "T": 3}], backend="cpu", mlx="0.32.4",
                 model="tiny", dtype="bfloat16")
    base = dict(kind="demo", inputs={"tokens": [1, 2, 3]}, env={"backend": "cpu"}, frame=frame,
                figures={"flips": 2, "max_abs_dlogit": 0.5}, tables={"extra": pd.DataFrame({"a": [1, 2]})},
                details={"note": "x"})
    base.update(kw)
    return Result(**base)


def test_tidy_has_the_same_columns_for_every_kind():
    df = tidy([{"metric": "m", "value": 1}], backend="cpu")
    assert list(df.columns[: len(TIDY_COLUMNS)]) == list(TIDY_COLUMNS)
    assert df["backend"].iloc[0] == "cpu" and df["tap"].iloc[0] == "" and math.isnan(df["layer"].iloc[0])


def test_result_is_validated_and_read_only():
    r = _result()
    assert r.figure("flips") == 2.0
    with pytest.raises(KeyError, match="no figure 'nope'"):
        r.figure("nope")
    with pytest.raises(TypeError):
        r.figures["flips"] = 3  # read-only view
    with pytest.raises(GemmdriftError, match="never NaN"):
        _result(figures={"x": float("nan")})
    with pytest.raises(GemmdriftError, match="lacks columns"):
        _result(frame=pd.DataFrame({"metric": ["m"], "value": [1.0]}))
    with pytest.raises(GemmdriftError, match="kind"):
        _result(kind="Bad Kind")
    with pytest.raises(GemmdriftError, match="table name"):
        _result(tables={"result": pd.DataFrame()})


def test_verdict_values_are_the_strings_on_disk():
    assert Verdict.NEAR_TIE == "NEAR-TIE" and f"{Verdict.OUTSIDE}" == "OUTSIDE ENVELOPE"
    assert Verdict("rounding") is Verdict.ROUNDING


def test_write_read_round_trip(tmp_path):
    r = _result()
    written = write_result(r, tmp_path / "out", draw=False)
    assert (tmp_path / "out" / "result.json").is_file() and written["marker"].name == "result.json"
    back = read_result(tmp_path / "out")
    assert back.kind == "demo" and dict(back.figures) == dict(r.figures)
    assert back.inputs["tokens"] == [1, 2, 3] and back.details["note"] == "x"
    pd.testing.assert_frame_equal(back.frame, r.frame, check_dtype=False)
    assert list(back.tables["extra"]["a"]) == [1, 2]


def test_read_refuses_incomplete_or_corrupt(tmp_path):
    with pytest.raises(GemmdriftError, match="not a gemmdrift result"):
        read_result(tmp_path)
    write_result(_result(), tmp_path, draw=False)
    (tmp_path / "figures.json").write_text("{not json")
    with pytest.raises(GemmdriftError, match="figures.json is corrupt"):
        read_result(tmp_path)


def test_check_out_dir(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(GemmdriftError, match="is a file"):
        check_out_dir(f / "sub")
    assert check_out_dir(tmp_path / "new" / "dir") == tmp_path / "new" / "dir"
