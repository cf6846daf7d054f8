"""Each modelled dispatch change names its mlx commit (issue 54): the registry of gemmdrift.dispatch.commits, the
proof that a rule reverted alone gives the older release's prediction, and `gemmdrift dispatch --vs`."""

import json
import re

import pytest

from gemmdrift import cli, dispatch
from gemmdrift.dispatch import chip_named, choose, commits

TAGS = ("0.26.5 0.27.1 0.28.0 0.29.0 0.29.1 0.29.2 0.29.3 0.29.4 0.30.0 0.30.1 0.30.3 0.30.4 0.30.5 0.30.6 0.31.0 "
        "0.31.1 0.31.2 0.32.0 0.32.1 0.32.2").split()  # every tag read, then the mirror's HEAD (846d176, 0.32.2)
V = {t: dispatch.parse_version(t) for t in TAGS}

# One call per rule that the rule moves (chip, op, choose's keywords).
PROBES = {
    "gemv_small_k": ("M1", "matmul", dict(T=1, K=64, N=4096, dtype="bfloat16")),
    "nax": ("M5", "matmul", dict(T=64, K=4096, N=4096, dtype="bfloat16")),
    "nax_splitk": ("M5", "matmul", dict(T=2048, K=16384, N=2048, dtype="bfloat16")),
    "splitk_tuning": ("M3", "matmul", dict(T=3, K=640, N=1024, dtype="bfloat16")),
    "nax_gemm_tiles": ("M5 Max", "matmul", dict(T=512, K=4096, N=4096, dtype="bfloat16")),
    "nax_splitk_tuning": ("M5", "matmul", dict(T=64, K=4096, N=64, dtype="bfloat16")),
    "dot_product": ("M1", "matmul", dict(T=1, K=4096, N=1, dtype="bfloat16")),
    "gemv_wide": ("M3", "matmul", dict(T=2, K=640, N=1024, dtype="bfloat16")),
    "fp_mxfp4": ("M1", "quantized_matmul", dict(T=1, K=640, N=1024, dtype="bfloat16", mode="mxfp4", bits=4,
                                                 group_size=32)),
    "fp_nvfp4_mxfp8": ("M1", "quantized_matmul", dict(T=1, K=640, N=1024, dtype="bfloat16", mode="nvfp4", bits=4,
                                                       group_size=16)),
    "qmm_splitk": ("M1", "quantized_matmul", dict(T=16, K=4096, N=256, dtype="bfloat16", bits=4, group_size=64)),
    "qmv_wide": ("M3", "quantized_matmul", dict(T=2, K=640, N=1024, dtype="bfloat16", bits=4, group_size=64)),
    "qmv_batch_limit_m5": ("M5", "quantized_matmul", dict(T=20, K=640, N=1024, dtype="bfloat16", bits=4,
                                                           group_size=64)),
    "qmv_fast_alignment": ("M1", "quantized_matmul", dict(T=1, K=256, N=1024, dtype="bfloat16", bits=8,
                                                          group_size=64)),
    "qmm_splitk_k_align": ("M1", "quantized_matmul", dict(T=16, K=4096, N=32, dtype="bfloat16", mode="nvfp4",
                                                          bits=4, group_size=16)),
    "sdpa_two_pass_tuning": ("M1 Max", "sdpa", dict(T=1, K=2048, N=128, dtype="bfloat16", n_heads=8, n_kv_heads=8)),
    "sdpa_vector_192_128": ("M1", "sdpa", dict(T=1, K=1024, N=192, dtype="bfloat16", v_head_dim=128)),
    "sdpa_full_96": ("M1", "sdpa", dict(T=64, K=1024, N=96, dtype="bfloat16")),
    "sdpa_full_72": ("M1", "sdpa", dict(T=64, K=1024, N=72, dtype="bfloat16")),
    "sdpa_nax_256": ("M5", "sdpa", dict(T=1024, K=2048, N=256, dtype="bfloat16")),
    "sdpa_gqa8": ("M1", "sdpa", dict(T=1, K=8192, N=128, dtype="bfloat16", n_heads=8, n_kv_heads=1)),
    "cuda_sdpa_vector": ("sm90", "sdpa", dict(T=1, K=1024, N=128, dtype="bfloat16")),
    "cuda_sdpa_cudnn": ("sm90", "sdpa", dict(T=64, K=64, N=128, dtype="bfloat16")),
    "cuda_sdpa_cudnn_cross": ("sm90", "sdpa", dict(T=64, K=1024, N=128, dtype="bfloat16")),
    "cuda_sdpa_causal_align": ("sm90", "sdpa", dict(T=64, K=32, N=128, dtype="bfloat16")),
    "cuda_sdpa_decode": ("sm90", "sdpa", dict(T=1, K=1024, N=128, dtype="bfloat16")),
    "cuda_gemv": ("sm90", "matmul", dict(T=1, K=4096, N=4096, dtype="bfloat16")),
    "cuda_gemv_sizes": ("sm90", "matmul", dict(T=1, K=96, N=4096, dtype="bfloat16")),
    "cuda_gemv_any_k": ("sm90", "matmul", dict(T=1, K=100, N=4096, dtype="bfloat16")),
    "cuda_fp_qmv": ("sm90", "quantized_matmul", dict(T=1, K=640, N=1024, dtype="bfloat16", mode="mxfp4", bits=4,
                                                     group_size=32)),
    "cuda_qmm_sm90": ("sm90", "quantized_matmul", dict(T=1, K=640, N=1024, dtype="bfloat16", bits=4, group_size=64)),
    "cuda_qmv": ("sm80", "quantized_matmul", dict(T=1, K=640, N=1024, dtype="bfloat16", bits=4, group_size=64)),
    "cuda_qmm_sm80_naive": ("sm80", "quantized_matmul", dict(T=16, K=640, N=1024, dtype="bfloat16", bits=4,
                                                             group_size=64)),
    "cuda_qmm_sm90_bits": ("sm90", "quantized_matmul", dict(T=16, K=64, N=1024, dtype="bfloat16", bits=2,
                                                            group_size=64)),
}


def _key(c):
    return c.kernel, tuple(sorted(c.params.items()))


def _previous(first: tuple) -> str:
    return [t for t in TAGS if V[t] < first][-1]


def test_the_registry_names_a_commit_a_pull_request_and_a_read_tag_for_every_rule():
    assert set(PROBES) == set(commits.RULES)  # a probe for every rule, and a rule for every probe
    for r in commits.RULES.values():
        assert r.first_tag in TAGS and r.backend in ("metal", "cuda") and r.ops and r.what and r.commits
        for c in r.commits:
            assert re.fullmatch(r"[0-9a-f]{9}", c.hash) and c.pr > 0 and c.subject
            assert c.commit_url == f"https://github.com/ml-explore/mlx/commit/{c.hash}"
            assert c.pr_url == f"https://github.com/ml-explore/mlx/pull/{c.pr}"
            assert c.markdown() == f"[{c.hash}]({c.commit_url}) {c.subject} ([#{c.pr}]({c.pr_url}))"


@pytest.mark.parametrize("rule", sorted(commits.RULES))
def test_a_rule_reverted_alone_gives_the_older_release_prediction(rule):
    r = commits.RULES[rule]
    chip, op, kw = PROBES[rule]
    c, old, first = chip_named(chip), _previous(r.first), r.first_tag
    before, after = choose(c, op, mlx_version=old, **kw), choose(c, op, mlx_version=first, **kw)
    assert _key(before) != _key(after), "the probe does not show the rule's change"
    assert _key(choose(c, op, mlx_version=first, reverted={rule}, **kw)) == _key(before)
    assert [x.name for x in dispatch.changed_by(c, op, old, first, **kw)] == [rule]


def _grid():
    for chip in ("M1", "M1 Max", "M2 Ultra", "M3", "M4 Max", "M5", "M5 Max", "sm80", "sm90"):
        for op in ("matmul", "quantized_matmul", "sdpa"):
            for T in (1, 2, 3, 9, 16, 33, 300, 1100):
                for K, N in ((64, 4096), (640, 1024), (2048, 640), (5376, 21504), (16384, 2048), (4096, 64)):
                    kw = dict(T=T, K=K, N=N, dtype="bfloat16")
                    if op == "sdpa":
                        kw.update(n_heads=8, n_kv_heads=1 if K > 1000 else 8, head_dim={4096: 128, 1024: 256,
                                                                                       640: 64, 21504: 256,
                                                                                       2048: 128, 64: 96}[N])
                    if op == "quantized_matmul":
                        kw.update(bits=4, group_size=64)
                    yield chip, op, kw


def test_every_version_dependence_is_a_named_rule():
    # The newer release with every rule between two consecutive tags reverted dispatches as the older one: no
    # condition on the version is left outside the registry (so each predicted change can name its commit).
    grid = list(_grid())
    for old, new in zip(TAGS, TAGS[1:]):
        for chip, op, kw in grid:
            c = chip_named(chip)
            names = {r.name for r in commits.between(V[old], V[new], c.backend, op)}
            assert _key(choose(c, op, mlx_version=new, reverted=names, **kw)) == _key(
                choose(c, op, mlx_version=old, **kw)), (old, new, chip, op, kw)


def test_known_answers_qmv_wide_and_gemv_wide_name_their_pull_requests():
    m3 = chip_named("M3")
    q = dict(K=640, N=1024, dtype="bfloat16", bits=4, group_size=64)
    [r] = dispatch.changed_by(m3, "quantized_matmul", "0.31.2", "0.32.0", T=2, **q)
    assert (r.name, r.first_tag, [(c.hash, c.pr) for c in r.commits]) == ("qmv_wide", "0.32.0", [("548dd80e8", 3764)])
    assert dispatch.changed_by(chip_named("M2"), "quantized_matmul", "0.31.2", "0.32.0", T=2, **q) == []  # gen 14
    [r] = dispatch.changed_by(m3, "matmul", "0.32.0", "0.32.1", T=2, K=640, N=1024, dtype="bfloat16")
    assert (r.name, [(c.hash, c.pr) for c in r.commits]) == ("gemv_wide", [("0ebcee8db", 3888)])
    # Across several releases each step is named, oldest first; reverting them all gives the older prediction.
    two = dispatch.changed_by(m3, "matmul", "0.30.4", "0.32.1", T=2, K=640, N=1024, dtype="bfloat16")
    assert [x.name for x in two] == ["splitk_tuning", "gemv_wide"]


@pytest.fixture
def planted(monkeypatch):
    """A planted rule: from 0.31.0 on, gemv on M1 takes bm 2 (commit abcdef012, #99999)."""
    rule = commits.Rule("planted_gemv", (0, 31, 0), "metal", ("matmul",), "a planted gemv tile",
                        (commits.Commit("abcdef012", "Planted gemv tile", 99999),))
    monkeypatch.setitem(commits.RULES, rule.name, rule)
    monkeypatch.setattr(commits, "_RULES", commits._RULES + (rule,))
    from gemmdrift.dispatch import metal

    real = metal.gemv_params

    def gemv_params(M, N, K, version=(0, 32, 2)):
        p = real(M, N, K, version)
        return {**p, "bm": 2} if commits.has(version, "planted_gemv") else p

    monkeypatch.setattr(metal, "gemv_params", gemv_params)
    return rule


def test_a_planted_rule_is_named_with_its_commit_and_reverting_it_restores_the_older_prediction(planted):
    m1, kw = chip_named("M1"), dict(T=1, K=4096, N=4096, dtype="bfloat16")
    assert choose(m1, "matmul", mlx_version="0.31.0", **kw).params["bm"] == 2
    assert choose(m1, "matmul", mlx_version="0.30.6", **kw).params["bm"] == 8
    [r] = dispatch.changed_by(m1, "matmul", "0.30.6", "0.31.0", **kw)
    assert r is planted and r.commits[0].hash == "abcdef012"
    assert _key(choose(m1, "matmul", mlx_version="0.31.0", reverted={"planted_gemv"}, **kw)) == _key(
        choose(m1, "matmul", mlx_version="0.30.6", **kw))


def test_dispatch_vs_names_the_commit(capsys):
    argv = ["dispatch", "--chip", "M3", "--K", "640", "--N", "1024", "--ts", "1-2", "--mlx", "0.32.1", "--vs", "0.32.0"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("mlx 0.32.1 (against mlx 0.32.0)")
    said = [ln for ln in out if "changed by" in ln]
    assert said == ["        mlx 0.32.0: steel GEMM; changed by: 0ebcee8db metal: add gemv_wide for fp16/bf16 matmuls "
                    "of a few rows (#3888, first in 0.32.1)"]
    assert cli.main(argv + ["--json"]) == 0
    recs = json.loads(capsys.readouterr().out)
    assert recs[0]["changed_by"] == [] and recs[1]["vs"]["kernel"] == "steel_gemm"
    assert recs[1]["changed_by"][0]["commits"][0]["pr_url"] == "https://github.com/ml-explore/mlx/pull/3888"


def test_dispatch_newer_than_the_mirror_says_so_in_one_line(capsys):
    # Never a silent "as 0.32.2": the release is named with the source whose rules it takes.
    assert cli.main(["dispatch", "--chip", "M3", "--K", "640", "--N", "1024", "--ts", "1-2", "--mlx", "0.33.0"]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note:")]
    assert notes == ["note: mlx 0.33.0 is newer than the source read (846d176 (mlx 0.32.2)): the rules read there "
                     "are used"]


def test_a_planted_rule_is_named_in_the_changelog_rows(monkeypatch):
    """The changelog's predicted rows name the planted commit, and only the pair that has it."""
    rule = commits.Rule("planted_kernel", (0, 31, 0), "metal", ("matmul",), "a planted kernel",
                        (commits.Commit("0123456ab", "Planted kernel", 77777),))
    monkeypatch.setitem(commits.RULES, rule.name, rule)
    monkeypatch.setattr(commits, "_RULES", commits._RULES + (rule,))
    from gemmdrift.changelog import predicted
    from gemmdrift.changelog.pages import markdown
    from gemmdrift.dispatch import Choice, metal

    real = metal.matmul

    def matmul(chip, M, K, N, dtype, version, **kw):
        if M == 1 and chip.name == "M1" and commits.has(version, "planted_kernel"):
            return Choice("planted", {}, "planted")
        return real(chip, M, K, N, dtype, version, **kw)

    monkeypatch.setattr(metal, "matmul", matmul)
    p = predicted.Predictor()
    rows = [r for r in p.differences("0.30.6", "0.31.0") if r["new"] == "planted"]
    assert rows and all(r["chips"] == ["M1"] and r["T"] == [1] and r["rules"] == ["planted_kernel"] for r in rows)
    text = markdown(p.blocks("0.30.6", "0.31.0"))
    assert ("[0123456ab](https://github.com/ml-explore/mlx/commit/0123456ab) Planted kernel "
            "([#77777](https://github.com/ml-explore/mlx/pull/77777))") in text
    assert not [r for r in p.differences("0.30.5", "0.30.6") if r["new"] == "planted"]
    m1 = chip_named("M1")
    kw = dict(T=1, K=640, N=1024, dtype="bfloat16")
    assert _key(choose(m1, "matmul", mlx_version="0.31.0", reverted={"planted_kernel"}, **kw)) == _key(
        choose(m1, "matmul", mlx_version="0.30.6", **kw))


def test_a_pair_whose_files_changed_in_nothing_modelled_says_so():
    """0.29.2 -> 0.29.3 changes Metal files but no modelled rule; 0.29.1 -> 0.29.2's rule (#2620) moves no shape."""
    from gemmdrift.changelog import predicted
    from gemmdrift.changelog.pages import markdown

    p = predicted.Predictor()
    quiet = markdown(p.blocks("0.29.2", "0.29.3"))
    assert "The source files of metal matmul" in quiet and "no modelled rule changed between the two" in quiet
    gemv = markdown(p.blocks("0.29.1", "0.29.2"))
    assert "[#2620](https://github.com/ml-explore/mlx/pull/2620))) move none of the shapes listed." in gemv


def test_a_recorded_mlx_older_than_the_first_tag_read_is_one_line(tmp_path, capsys):
    """An --env record from mlx 0.25.0: one line naming the record's mlx, never a silent answer."""
    from test_dispatch import RECORDS

    (tmp_path / "old.json").write_text(json.dumps(dict(RECORDS["M1"], mlx="0.25.0")))
    assert cli.main(["dispatch", "--env", str(tmp_path / "old.json"), "--K", "640", "--N", "2048"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "(its mlx) 0.25.0: older than the first tag read (v0.26.5)" in err


def test_fp_modes_before_their_kernels_are_unsupported_and_their_recipes_not_guessed():
    """mxfp4 from 0.29.0 (#2499), nvfp4/mxfp8 from 0.30.3 (#2946); fp_quantized.h's recipes hold from 0.30.4."""
    from gemmdrift.errors import GemmdriftError
    from gemmdrift.replay.paths import plan_for

    m1, q = chip_named("M1"), dict(T=1, K=640, N=1024, dtype="bfloat16")
    assert choose(m1, "quantized_matmul", mlx_version="0.28.0", mode="mxfp4", **q).kernel == "unsupported"
    assert choose(m1, "quantized_matmul", mlx_version="0.29.0", mode="mxfp4", **q).kernel == "qmv"
    assert choose(m1, "quantized_matmul", mlx_version="0.30.1", mode="mxfp8", **q).kernel == "unsupported"
    assert choose(m1, "quantized_matmul", mlx_version="0.30.3", mode="mxfp8", **q).kernel == "qmv"
    with pytest.raises(GemmdriftError, match="fp-mode Metal kernels .* were read from 0.30.4 on"):
        plan_for(m1, "quantized_matmul", mlx_version="0.29.4", bits=4, group_size=32, mode="mxfp4", **q)
    assert plan_for(m1, "quantized_matmul", mlx_version="0.30.4", bits=4, group_size=32, mode="mxfp4",
                    **q).recipe.kernel == "fp_qmv"
