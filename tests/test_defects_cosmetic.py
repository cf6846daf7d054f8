"""Issue 33 D17 (and D8's fingerprint part): the cosmetic and help-text items, each checked."""

import json
import subprocess
import sys
import warnings

import pytest

from gemmdrift import cli


def _one_error(capsys, argv) -> str:
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_plugin_that_exits_at_import_is_one_line(tmp_path, capsys, monkeypatch):
    import gemmdrift.model as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    plug = tmp_path / "exitmod.py"
    plug.write_text("import sys\nsys.exit(3)\n\ndef factory(model):\n    return []\n")
    err = _one_error(capsys, ["state", "--cache-impl", f"{plug}:factory", "--out", tmp_path / "o"])
    assert "--cache-impl" in err and "SystemExit" in err


def test_self_draft_ranges_agree(tmp_path):
    from gemmdrift.model.draft_self import self_draft
    from gemmdrift.errors import GemmdriftError

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 18, "sliding_window_pattern": 6}))
    said = set()
    for n in (2, 18, 100):
        with pytest.raises(GemmdriftError) as e:
            self_draft(tmp_path, n)
        said.add(str(e.value).rsplit("(choose ", 1)[1])
    assert said == {"6..17)"}


def test_state_grid_draws_without_a_tight_layout_warning():
    import pandas as pd

    from gemmdrift.view import plots

    t = pd.DataFrame([{"cache": "gemmdrift.caches.exact:make_cache", "operation": "rollback", "where": "below",
                       "verdict": "EXACT"}])
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        plots.state_grid(t)
    assert not [w for w in got if "Tight layout" in str(w.message)]


def test_state_help_lists_draft_trim():
    r = subprocess.run([sys.executable, "-m", "gemmdrift", "state", "--help"], capture_output=True, text=True)
    assert "draft_trim" in r.stdout


@pytest.mark.parametrize("argv,prog", [(["stack", "--bogus"], "gemmdrift stack"),
                                       (["replay", "check", "--bogus"], "gemmdrift replay check"),
                                       (["--bogus"], "gemmdrift")])
def test_unrecognized_arguments_point_at_the_subcommands_help(capsys, argv, prog):
    err = _one_error(capsys, argv)
    assert err.startswith(f"{prog}: error: unrecognized arguments: --bogus") and err.endswith(f"(see {prog} --help)")


def test_fingerprint_refuses_an_unreplayable_t_before_computing(tmp_path, capsys):
    out = tmp_path / "fp"
    err = _one_error(capsys, ["fingerprint", "--paths", "replay:sm90:matmul:bfloat16", "--ts", "1,2", "--out", out])
    assert "T=2" in err and "cublaslt" in err
    assert not out.exists()  # T=1 was not recovered (and checkpointed) first


def test_fingerprint_names_the_replayed_kernel(tmp_path):
    from gemmdrift import fingerprint

    r = fingerprint.measure(["replay:M3:matmul:bfloat16"], K=256, ts=[1, 2], N=64, workers=1)
    t = r.tables["fingerprints"] if "fingerprints" in r.tables else next(iter(r.tables.values()))
    pred = dict(zip(t["T"], t["predicted_kernel"]))
    assert pred[1] == "gemv" and pred[2].startswith("gemv_wide")
    assert "replay recipe" in r.details["prediction_origin"]
