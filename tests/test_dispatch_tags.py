"""Every mlx release tag against the sources the dispatch rules were read from (issues 47 and 54): a part read from
its first tag (Metal and CUDA matmul and quantized matmul, Metal sdpa: v0.26.5) follows its own rules; an older
part whose files are byte-identical to a release read takes its rules ("as 0.30.5"); any other is "not read",
never "not knowable" (kept for orders chosen at run time or hidden in hardware)."""

import pytest

from gemmdrift.changelog import predicted
from gemmdrift.dispatch import tags

MATRIX = ("0.26.5 0.27.1 0.28.0 0.29.0 0.29.1 0.29.2 0.29.3 0.29.4 0.30.0 0.30.1 0.30.3 0.30.4 0.30.5 0.30.6 0.31.0 "
          "0.31.1 0.31.2 0.32.0 0.32.1").split()  # the mlx-cpu releases of issue 47 up to the mirror's last tag


def test_every_release_tag_of_the_matrix_is_recorded_with_every_file():
    rec = tags.record()
    assert set(MATRIX) <= set(rec["tags"]) and rec["mirror_version"] == "0.32.2"
    files = {f for fs in tags.SOURCES.values() for f in fs}
    assert set(rec["files"]) == files and all(set(t) == files for t in rec["tags"].values())


def test_known_answers_of_the_recorded_tags():
    # Regression (issue 54): every tag older than 0.30.5 whose files were not byte-identical was "not knowable".
    for v in MATRIX:
        for b, op in (("metal", "matmul"), ("metal", "quantized_matmul"), ("metal", "sdpa"), ("cuda", "matmul"),
                      ("cuda", "quantized_matmul"), ("cuda", "sdpa")):
            assert tags.rules_for(v, b, op) == (v, ""), (v, b, op)
    nope = tags.rules_for("0.29.4", "cpu", "sdpa")  # the CPU read from 0.30.5 on
    assert nope.version is None and nope.why == ("not read: the cpu sdpa rules were read from 0.30.5 on, and "
                                                 "mlx/fast.cpp at v0.29.4 differs from every release read")
    assert tags.rules_for("0.29.4", "cpu", "matmul").why.startswith("as 0.30.5 (files compared: cpu/matmul.cpp")
    older = tags.rules_for("0.26.3", "metal", "matmul")
    assert older.version is None and older.why == "not read: mlx 0.26.3 is older than the first tag read (0.26.5)"
    assert not any("knowable" in tags.rules_for(v, b, op).why for v in ("0.26.3", *MATRIX) for b, op in tags.SOURCES)
    assert tags.rules_for("0.30.6", "metal", "matmul") == ("0.30.6", "")
    assumed = tags.rules_for("0.32.4", "metal", "sdpa")
    assert assumed.version == "0.32.2" and "not compared" in assumed.why
    assert tags.same_sources("0.30.5", "0.30.6", "metal", "matmul") is True
    assert tags.same_sources("0.31.2", "0.32.1", "metal", "matmul") is False
    assert tags.same_sources("0.31.2", "0.32.4", "metal", "matmul") is None  # 0.32.4 not recorded


@pytest.fixture
def planted(monkeypatch):
    read = {f: f"r-{i}" for i, f in enumerate(sorted({f for fs in tags.SOURCES.values() for f in fs}))}
    same_sdpa = dict(read, **{tags.SOURCES[("metal", "matmul")][0]: "old-matmul"})
    rec = {"mirror": "abc1234", "mirror_version": "0.31.0", "files": sorted(read),
           "tags": {"0.30.5": read, "0.31.0": dict(read), "0.28.0": same_sdpa}}
    monkeypatch.setattr(tags, "record", lambda: rec)
    return rec


def test_planted_tags_as_a_read_release_or_not_read(planted, monkeypatch):
    monkeypatch.setitem(tags.READ_FROM, ("metal", "sdpa"), (0, 30, 5))
    monkeypatch.setitem(tags.READ_FROM, ("metal", "matmul"), (0, 30, 5))
    assert tags.rules_for("0.28.0", "metal", "sdpa").version == "0.30.5"
    r = tags.rules_for("0.28.0", "metal", "matmul")
    assert r.version is None and r.why.startswith("not read: ") and "metal/matmul.cpp at v0.28.0 differs" in r.why
    assert "not a recorded release tag" in tags.rules_for("0.27.0", "metal", "sdpa").why
    assert tags.rules_for("0.31.4", "cuda", "sdpa").version == "0.31.0"  # newer than the mirror: assumed


def test_the_predicted_section_uses_the_tags(planted, monkeypatch):
    monkeypatch.setitem(tags.READ_FROM, ("metal", "sdpa"), (0, 30, 5))
    monkeypatch.setitem(tags.READ_FROM, ("metal", "matmul"), (0, 30, 5))
    assert "metal matmul" in predicted.knowable("0.28.0", "metal")
    assert predicted.knowable("0.28.0", "cuda") is None  # every cuda part read from 0.26.5
    blocks = predicted.sources_blocks("0.28.0", "0.30.5")
    rows = {(r[0], r[1]): r[2:] for r in blocks[1][2]}
    assert rows[("metal", "sdpa")][0].startswith("as 0.30.5 (files compared: metal/scaled_dot_product_attention.cpp")
    assert rows[("metal", "matmul")][0].startswith("not read") and rows[("metal", "matmul")][2] == "no"
    assert rows[("metal", "quantized_matmul")][0] == "read"
    assert rows[("cuda", "sdpa")] == [rows[("cuda", "sdpa")][0], "read", "yes"]
