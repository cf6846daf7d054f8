"""A bisection's commits as asv's own results JSON (gemmdrift.history.bisect.asv_json, issue 55).

The known answer is asv's: benchmarks/reference/bisect/asv-mlx-with-lm0.30.2 holds what ``asv run`` wrote over
mlx's commits 6f35017d and f46877bc (track_flips 1.0 and 0.0), and the bisection's own records of the same two
commits sit in benchmarks/reference/bisect/mlx-v0.29.4..v0.30.0-with-lm0.30.2. Converted, the records must give asv's
values, and asv's own reader must read the files.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from gemmdrift.history.bisect import asv_json

REF = Path(__file__).resolve().parents[1] / "benchmarks" / "reference" / "bisect"
RECORDS = REF / "mlx-v0.29.4..v0.30.0-with-lm0.30.2"
ASV_RUN = REF / "asv-mlx-with-lm0.30.2" / "vm"
PAIR = "prefill:512,decode vs prefill:512,verify:2"


@pytest.fixture()
def results(tmp_path):
    """The two commits' shipped records in a results directory, with an answer (not a commit: ignored)."""
    res = tmp_path / "results"
    res.mkdir()
    for sha in ("6f35017d1baf7764a01893dc54e818dd5cc94aa5", "f46877bc08b58e7da12063fae380013b9be7fec8"):
        shutil.copy(RECORDS / f"{sha}.json", res)
    shutil.copy(RECORDS / "answer.json", res)
    return res


@pytest.fixture()
def dated(monkeypatch):
    """git's answer for the two mlx commits' dates (no mlx clone in CI): the ones asv recorded for them."""
    dates = {"6f35017d1baf7764a01893dc54e818dd5cc94aa5": "1763507630", "f46877bc08b58e7da12063fae380013b9be7fec8":
             "1763561241"}
    monkeypatch.setattr(asv_json.gitrepo, "git", lambda repo, *a: dates[a[-1]])
    return dates


def test_each_commit_gives_asvs_own_values(results, dated):
    written = asv_json.write(results, Path("mlx"), machine="vm")
    assert len(written) == 2
    for f in written:
        ours = json.loads(f.read_text())
        theirs = json.loads((ASV_RUN / f"{ours['commit_hash'][:8]}-virtualenv-py3.11.json").read_text())
        assert ours["commit_hash"] == theirs["commit_hash"] and ours["date"] == theirs["date"]
        name = "bench_tier.TierDecodeVsVerify.track_flips"
        assert ours["results"][name][:3] == theirs["results"][name][:3]  # value, params, version
        # and from the record directly, not through the benchmark's method
        rec = json.loads((results / f"{ours['commit_hash']}.json").read_text())
        assert ours["results"][name][0] == [rec["parts"]["decode"][f"flips/{PAIR}"]]
    assert {json.loads(f.read_text())["results"]["bench_tier.TierDecodeVsVerify.track_flips"][0][0]
            for f in written} == {1.0, 0.0}


def test_every_commit_asv_find_measured_agrees_with_the_bisection(tmp_path, monkeypatch):
    """`asv find` over the same range (shipped beside the records) measured six of the bisection's seven commits:
    converted, each record gives the value asv's own run recorded there."""
    res = tmp_path / "all"
    shutil.copytree(RECORDS, res)
    runs = [json.loads(f.read_text()) for f in ASV_RUN.glob("*-virtualenv-*.json")]
    theirs = {d["commit_hash"]: d for d in runs}
    dates = {sha: str(d["date"] // 1000) for sha, d in theirs.items()}
    dates["60d80a3728a8cc002c121ff6c89ae74bf63df53b"] = "1762875870"  # v0.29.4 (asv find starts after it)
    monkeypatch.setattr(asv_json.gitrepo, "git", lambda repo, *a: dates[a[-1]])
    written = asv_json.write(res, Path("mlx"), machine="vm")
    assert len(written) == 7
    name = "bench_tier.TierDecodeVsVerify.track_flips"
    both = 0
    for f in written:
        ours = json.loads(f.read_text())
        if ours["commit_hash"] in theirs:
            both += 1
            assert ours["results"][name][:3] == theirs[ours["commit_hash"]]["results"][name][:3]
    assert both == 6


def test_only_the_measured_parts_and_parameters_as_asv_writes_them(results, dated):
    sha = "6f35017d1baf7764a01893dc54e818dd5cc94aa5"
    rec = json.loads((results / f"{sha}.json").read_text())
    assert len(rec["parts"]) == 5
    (results / f"{sha}.json").write_text(json.dumps({**rec, "parts": {"decode": rec["parts"]["decode"]}}))
    f = asv_json.write(results, Path("mlx"), machine="vm")[0]
    d = json.loads(f.read_text())
    assert d["commit_hash"] == sha
    assert {n.split(".")[1] for n in d["results"]} == {"TierDecodeVsVerify", "TierDecodeLayers"}  # decode alone
    value, params, version = d["results"]["bench_tier.TierDecodeLayers.track_rel_l2"][:3]
    assert params == [["'layer 0'", "'layer 5'", "'layer 17'", "'logits'"]] and version == "1"
    rec = json.loads((results / f"{d['commit_hash']}.json").read_text())
    rel = rec["parts"]["decode"]
    assert value == [rel[f"rel_l2/{PAIR}/accumulated/{tap}"] for tap in ("layer 0", "layer 5", "layer 17", "logits")]
    assert d["env_name"] == "bisect-lm0.30.2" and d["requirements"] == {"mlx-lm": "0.30.2"}
    assert d["results"]["bench_tier.TierDecodeLayers.track_rel_l2"][3] == d["date"]  # no measured_at kept: the date
    bench = json.loads((results / "asv" / "benchmarks.json").read_text())
    assert set(d["results"]) <= set(bench) and bench["version"] == 2  # the union over the commits
    assert all(bench[n]["version"] == d["results"][n][2] for n in d["results"])
    assert json.loads((results / "asv" / "vm" / "machine.json").read_text())["machine"] == "vm"


def test_asvs_reader_reads_them(results, dated):
    from asv.results import Results

    for f in asv_json.write(results, Path("mlx"), machine="vm"):
        r = Results.load(str(f), machine_name="vm")
        flips = r.get_result_value("bench_tier.TierDecodeVsVerify.track_flips", [])
        assert flips in ([1.0], [0.0])
        taps = r.get_result_value("bench_tier.TierDecodeLayers.track_rel_l2",
                                  r.get_result_params("bench_tier.TierDecodeLayers.track_rel_l2"))
        assert len(taps) == 4 and all(v >= 0 for v in taps)


def test_a_figure_not_measured_is_null_and_a_skipped_commit_has_no_file(results, dated):
    sha = "6f35017d1baf7764a01893dc54e818dd5cc94aa5"
    rec = json.loads((results / f"{sha}.json").read_text())
    del rec["parts"]["decode"][f"flips/{PAIR}"]
    (results / f"{sha}.json").write_text(json.dumps(rec))
    other = "f46877bc08b58e7da12063fae380013b9be7fec8"
    rec2 = json.loads((results / f"{other}.json").read_text())
    (results / f"{other}.json").write_text(json.dumps({**rec2, "skipped": "does not build: x"}))
    written = asv_json.write(results, Path("mlx"), machine="vm")
    assert [f.name for f in written] == ["6f35017d-bisect-lm0.30.2.json"]
    d = json.loads(written[0].read_text())
    assert d["results"]["bench_tier.TierDecodeVsVerify.track_flips"][0] == [None]  # asv: skipped, never 0
    assert not math.isnan(d["results"]["bench_tier.TierDecodeVsVerify.track_identical_through"][0][0])


def test_the_commit_date_comes_from_the_repository(tmp_path):
    repo = tmp_path / "r"
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "GIT_AUTHOR_DATE": "1700000000 +0000", "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "commit", "-q", "--allow-empty", "-m", "x (#1)"], check=True, env=env)
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = tmp_path / "res"
    res.mkdir()
    rec = json.loads((RECORDS / "f46877bc08b58e7da12063fae380013b9be7fec8.json").read_text())
    (res / f"{sha}.json").write_text(json.dumps({**rec, "commit": sha, "measured_at": 1796000000123}))
    (f,) = asv_json.write(res, repo, machine="m")
    d = json.loads(f.read_text())
    assert d["date"] == 1700000000 * 1000
    assert {r[3] for r in d["results"].values()} == {1796000000123}  # started_at: when it was measured
