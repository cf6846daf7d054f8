"""The prepared GPU check (scripts/gpu_check, docs/cuda.md "The prepared GPU check"), here on the CPU.

The packer's plan and its refusals on small fake files (nothing is downloaded); the device half's receive and
install on fake artifacts; and the run script end to end on --device cpu at its small sizes, on a tiny checkpoint
with a tokenizer, through every step's real command, with the resume and the one-line missing device.
"""

from __future__ import annotations

import json
import lzma
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts" / "gpu_check"
sys.path.insert(0, str(SCRIPTS))
import install  # noqa: E402
import plan  # noqa: E402

MIB = plan.MIB


def test_plan_fills_each_call_under_the_limit_and_rejoins():
    arts = [{"name": "a.whl", "bytes": 700}, {"name": "b.tar.xz", "bytes": 2500}, {"name": "c.gguf.xz", "bytes": 4100}]
    calls = plan.plan_calls(arts, tree_bytes=300, limit=2000, margin=100)  # room 1600 a call
    assert [c["bytes"] for c in calls] == [1600, 1600, 1600, 1600, 900]  # 7300 bytes: ceil(7300 / 1600) = 5 calls
    assert all(c["total_bytes"] == c["bytes"] + 300 <= 2000 - 100 for c in calls)
    for art in arts:  # the pieces of each artifact cover it in order, without gap or overlap
        pieces = sorted((p for c in calls for p in c["pieces"] if p["artifact"] == art["name"]),
                        key=lambda p: p["index"])
        assert [p["offset"] for p in pieces] == [sum(q["bytes"] for q in pieces[:i]) for i in range(len(pieces))]
        assert sum(p["bytes"] for p in pieces) == art["bytes"]
    assert calls[0]["pieces"][0]["file"] == "a.whl.p00" and calls[0]["folder"] == ".gpu-pack/call1"
    with pytest.raises(plan.PackError, match="leaves no room"):
        plan.plan_calls(arts, tree_bytes=1950, limit=2000, margin=100)


def _pack(tmp_path: Path, sizes: dict[str, int], tree: int, limit: int, margin: int = 0):
    src = {}
    for name, n in sizes.items():
        src[name] = tmp_path / name
        src[name].write_bytes(bytes(range(256)) * (n // 256) + b"x" * (n % 256))
    arts = [{"name": k, "bytes": v} for k, v in sizes.items()]
    calls = plan.plan_calls(arts, tree, limit=limit, margin=margin)
    pack = tmp_path / ".gpu-pack"
    plan.write_pieces(src, calls, pack)
    return pack, {"version": 1, "tree_bytes": tree, "artifacts": arts, "calls": calls}, src


def test_check_refuses_a_piece_over_the_limit_naming_it(tmp_path):
    pack, manifest, _ = _pack(tmp_path, {"w.whl": 3000}, tree=100, limit=2000)
    assert len(plan.check_pack(pack, manifest, limit=2000)) == 2
    big = pack / "call1" / "stray.bin"
    big.write_bytes(b"0" * 2100)  # a file in a call's folder over the limit, manifest or not
    with pytest.raises(plan.PackError, match=r"stray\.bin: .* over the"):
        plan.check_pack(pack, manifest, limit=2000)
    big.unlink()
    (pack / "call2" / "extra.bin").write_bytes(b"0" * 1000)  # the call's folder plus the tree over the limit
    with pytest.raises(plan.PackError, match="call 2 .* plus the working tree"):
        plan.check_pack(pack, manifest, limit=2000)
    with pytest.raises(plan.PackError, match="call 1 .* plus the working tree"):  # a tree that grew since
        plan.check_pack(pack, manifest, tree_bytes=1500, limit=2000)


def test_prepare_check_refuses_a_64_mib_piece_in_one_line(tmp_path):
    pack, manifest, _ = _pack(tmp_path, {"w.whl": 1000}, tree=0, limit=plan.LIMIT)
    manifest["tree_bytes"] = 0
    (pack / plan.MANIFEST).write_text(json.dumps(manifest))
    with open(pack / "call1" / "huge.p00", "wb") as f:  # sparse: 65 MiB long, nothing written
        f.truncate(65 * MIB)
    r = subprocess.run([sys.executable, str(SCRIPTS / "prepare.py"), "--check", "--pack", str(pack)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "huge.p00: 65.0 MiB, over the 64 MiB" in r.stderr


def _prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / "prepare.py"), *args], capture_output=True, text=True,
                          timeout=120)


def _saved_pack(tmp_path: Path, sizes: dict[str, int], limit: int = plan.LIMIT) -> Path:
    pack, manifest, _ = _pack(tmp_path, sizes, tree=0, limit=limit)
    manifest["limit_bytes"] = limit
    (pack / plan.MANIFEST).write_text(json.dumps(manifest))
    return pack


def test_prepare_check_honours_the_64_mib_limit_and_limit_mib(tmp_path):
    """Issue 53, item 12: a pack built with --limit-mib 100 (99.8 MiB calls) passed --check, and --check ignored
    --limit-mib. The device tool sends at most 64 MiB a call, whatever the pack says."""
    pack = _saved_pack(tmp_path, {"w.whl": 1000}, limit=100 * MIB)  # a pack made for 100 MiB calls
    with open(pack / "call1" / "w.whl.p00", "r+b") as f:  # its one call: 99.8 MiB (sparse)
        f.truncate(int(99.8 * MIB))
    manifest = json.loads((pack / plan.MANIFEST).read_text())
    manifest["calls"][0]["pieces"][0]["bytes"] = int(99.8 * MIB)
    (pack / plan.MANIFEST).write_text(json.dumps(manifest))
    r = _prepare("--check", "--pack", str(pack))
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "w.whl.p00: 99.8 MiB, over the 64 MiB a call may send" in r.stderr
    (tmp_path / "small").mkdir()
    small = _saved_pack(tmp_path / "small", {"w.whl": 1000})
    assert _prepare("--check", "--pack", str(small)).returncode == 0
    tree = plan.tree_bytes(ROOT) / MIB  # a limit under this checkout's tree refuses every call
    limit = f"{tree * 0.9:.2f}"
    r = _prepare("--check", "--pack", str(small), "--limit-mib", limit)
    # the message prints the limit with :g ("5.4", never "5.40": once the tree grew to 6.0 MiB this assertion failed)
    assert r.returncode == 2 and f"over the {float(limit):g} MiB a call may send" in r.stderr


@pytest.mark.parametrize("flags, message", [
    (["--limit-mib", "100"], "--limit-mib 100: give more than 0 and at most 64 (what one call of the device tool"),
    (["--limit-mib", "0"], "--limit-mib 0: give more than 0 and at most 64"),
    (["--limit-mib", "nan"], "--limit-mib nan: give more than 0"),
    (["--margin-mib", "-100"], "--margin-mib -100: give 0 or more, and less than the 64 MiB a call may send"),
    (["--margin-mib", "62", "--limit-mib", "60"], "--margin-mib 62: give 0 or more, and less than the 60 MiB"),
    (["--pack", "{tmp}/elsewhere"], "a pack is built only in this repository's .gpu-pack"),
])
def test_prepare_refuses_a_bad_flag_before_touching_anything(tmp_path, monkeypatch, capsys, flags, message):
    """Issue 53, items 12 and 23: `--margin-mib -100` deleted a good pack before it refused; `--limit-mib 100` made
    calls the device tool refuses; a pack outside the repository was printed with a carry that does not exist."""
    import prepare

    touched = []
    monkeypatch.setattr(prepare, "build", lambda *a, **k: touched.append("build"))
    monkeypatch.setattr(prepare, "ignore_pack", lambda: touched.append("exclude"))
    assert prepare.main([f.format(tmp=tmp_path) for f in flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prepare: ") and message in err, err
    assert touched == []
    if flags[0] == "--pack":  # --pack elsewhere is for --check; with no pack there, that is said in one line
        r = _prepare("--check", "--pack", str(tmp_path / "nothing"))
        assert r.returncode == 2 and r.stderr == (f"prepare: {tmp_path / 'nothing' / plan.MANIFEST}: missing (no pack "
                                                  "there: run prepare.py first)\n")
        return
    pack = _saved_pack(tmp_path, {"w.whl": 1000})  # --check validates its flags too, and leaves the pack as it is
    before = sorted((p.name, p.stat().st_size) for p in pack.rglob("*"))
    assert prepare.main(["--check", "--pack", str(pack), *flags]) == 2
    assert sorted((p.name, p.stat().st_size) for p in pack.rglob("*")) == before


def test_the_plan_says_the_margin_it_was_given():
    """Issue 53, item 31: a margin of 0.25 MiB was printed as "margin 0 MiB"."""
    with pytest.raises(plan.PackError, match=r"leaves no room under 64 MiB per call \(margin 0\.25 MiB\)"):
        plan.plan_calls([{"name": "a", "bytes": 10}], tree_bytes=plan.LIMIT - 100, margin=plan.MARGIN)


def test_prepare_prints_each_call_with_a_carry_that_exists_and_the_figures(tmp_path, monkeypatch, capsys):
    """Issue 53, item 23: the printed carry is the call's folder in this repository (a pack elsewhere is said to be
    uncarriable), the last call waits W = T - 40 as RUNBOOK.md says, and the figures of the pack are printed."""
    import prepare

    pieces = int(prepare.PIECES_MIB * MIB)
    arts = [{"name": "all.bin", "bytes": pieces}]
    tree = plan.tree_bytes(ROOT)
    calls = plan.plan_calls(arts, tree)
    for c in calls:
        c["command"], c["carry"] = prepare.command(c["call"], len(calls)), [c["folder"]]
    manifest = {"version": 1, "limit_bytes": plan.LIMIT, "margin_bytes": plan.MARGIN, "tree_bytes": tree,
                "artifacts": arts, "calls": calls}
    monkeypatch.setattr(prepare, "ignore_pack", lambda: None)
    monkeypatch.setattr(prepare, "build", lambda *a: manifest)
    monkeypatch.setattr(plan, "check_pack", lambda *a, **k: [])
    assert prepare.main([]) == 0
    out = capsys.readouterr().out
    n = len(calls)
    assert n == prepare.calls_needed(pieces, tree)
    assert out.splitlines()[0].startswith(f"{n} calls: {prepare.PIECES_MIB} MiB of pieces, the working tree "
                                          f"{tree / MIB:.2f} MiB, 64 MiB a call less a margin of 0.25 MiB; a tree over ")
    last = prepare.LAST_TIMEOUT_S - prepare.WAIT_SLACK_S
    assert f"--call {n} --wait {last}\n      carry: [\".gpu-pack/call{n}\"]\n      timeout_s: 600 " in out
    assert out.count("--wait 0") == n - 1 and out.count("timeout_s: 120") == n - 1
    assert all((ROOT / c["folder"]).parent == ROOT / plan.PACK for c in calls)  # the carry: a repository path
    small = _saved_pack(tmp_path, {"w.whl": 1000})
    monkeypatch.undo()
    assert prepare.main(["--check", "--pack", str(small)]) == 0
    out = capsys.readouterr().out
    assert "carry:" not in out and f"{small.resolve()} is not this repository's .gpu-pack: no call can carry it" in out


WORDS = {5: "five", 6: "six", 7: "seven", 8: "eight"}


def test_the_docs_count_the_calls_prepare_makes():
    """Issue 53, item 23: docs/cuda.md and RUNBOOK.md promised five calls and a 3.55 MiB tree where prepare.py made
    six with 4.4 MiB. The docs' count follows from the pack's size (PIECES_MIB) and this checkout's tree."""
    import prepare

    pieces = prepare.PIECES_MIB * MIB
    n = prepare.calls_needed(pieces, plan.tree_bytes(ROOT))
    low, high = prepare.tree_for(n - 1, pieces) / MIB, prepare.tree_for(n, pieces) / MIB
    cuda = (ROOT / "docs" / "cuda.md").read_text(encoding="utf-8")
    runbook = (SCRIPTS / "RUNBOOK.md").read_text(encoding="utf-8")
    assert f"**{WORDS[n]} calls**" in cuda and f"{prepare.PIECES_MIB} MiB of pieces" in cuda
    assert f"a tree between {low:.2f} and {high:.2f} MiB" in cuda, (low, high)
    assert f"{WORDS[n]} calls with this tree" in runbook
    wait = prepare.LAST_TIMEOUT_S - prepare.WAIT_SLACK_S
    for text in (cuda, runbook):
        assert f"W = T - {prepare.WAIT_SLACK_S}" in text and f"--wait {wait}" in text
        assert "--wait 540" not in text and "five calls" not in text and "3.55 MiB" not in text


def _fake_wheel(path: Path, name: str) -> None:
    """A wheel with a module and a RECORD (sha256 of each file, as pip writes them)."""
    files = {f"{name}/__init__.py": b"VALUE = 42\n", f"{name}-1.0.dist-info/METADATA":
             f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    import base64
    import hashlib

    rec = "".join(f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b'=').decode()},"
                  f"{len(v)}\n" for k, v in files.items()) + f"{name}-1.0.dist-info/RECORD,,\n"
    files[f"{name}-1.0.dist-info/RECORD"] = rec.encode()
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)


def test_receive_and_install_fake_artifacts_call_by_call(tmp_path):
    built = tmp_path / "built"
    built.mkdir()
    _fake_wheel(built / "plainpkg-1.0-py3-none-any.whl", "plainpkg")
    _fake_wheel(built / "xzpkg-1.0-py3-none-any.whl", "xzpkg")
    with zipfile.ZipFile(built / "xzpkg-1.0-py3-none-any.whl") as z, lzma.open(built / "xzpkg.tar.xz", "wb") as xz, \
            tarfile.open(fileobj=xz, mode="w") as t:
        for info in z.infolist():
            ti = tarfile.TarInfo(info.filename)
            ti.size = info.file_size
            t.addfile(ti, z.open(info))
    weights = bytes(range(256)) * 40
    (built / "model.gguf.xz").write_bytes(lzma.compress(weights))
    import hashlib

    arts = [{"name": "plainpkg-1.0-py3-none-any.whl", "kind": "wheel", "encoding": "raw", "target": "site"},
            {"name": "xzpkg.tar.xz", "kind": "wheel", "encoding": "tar.xz", "target": "site",
             "wheel": "xzpkg-1.0-py3-none-any.whl"},
            {"name": "model.gguf.xz", "kind": "gguf", "encoding": "xz", "target": "gguf", "file": "model.gguf",
             "decoded_sha256": hashlib.sha256(weights).hexdigest()}]
    for a in arts:
        a["bytes"] = (built / a["name"]).stat().st_size
        a["sha256"] = plan.sha256_file(built / a["name"])
    repo = tmp_path / "repo"
    calls = plan.plan_calls(arts, tree_bytes=0, limit=700, margin=0)
    assert len(calls) >= 3
    plan.write_pieces({a["name"]: built / a["name"] for a in arts}, calls, repo / plan.PACK)
    manifest = {"version": 1, "artifacts": arts, "calls": calls}
    work = tmp_path / "work"
    last = calls[-1]["call"]
    # the machine went cold: only the last call's folder is there
    hidden = [repo / c["folder"] for c in calls[:-1]]
    for h in hidden:
        h.rename(h.with_name(h.name + ".away"))
    got = install.receive(repo, manifest, work, last)
    assert sorted(got["missing"]) == [c["call"] for c in calls[:-1]]
    for h in hidden:
        h.with_name(h.name + ".away").rename(h)
    (repo / calls[0]["folder"] / calls[0]["pieces"][0]["file"]).write_bytes(b"altered")
    with pytest.raises(plan.PackError, match="sha256"):
        install.receive(repo, manifest, work, 1)
    plan.write_pieces({a["name"]: built / a["name"] for a in arts}, calls, repo / plan.PACK)
    for c in calls:
        got = install.receive(repo, manifest, work, c["call"])
        assert not got["missing"]
        state = install.install(manifest, work)
    assert (work / "cache" / "gguf" / "model.gguf").read_bytes() == weights
    assert (work / "site" / "plainpkg" / "__init__.py").is_file() and (work / "site" / "xzpkg" / "__init__.py").is_file()
    assert state["site"] and install.install(manifest, work) == state  # idempotent


def _tiny_checkpoint(d: Path) -> None:
    """The tiny gemma3_text of conftest with a small SentencePiece tokenizer (byte fallback), so that every command
    reads the built-in essay as it does on the embedded Gemma."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from sentencepiece import sentencepiece_model_pb2 as pb

    from conftest import TINY_CONFIG, make_tiny

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = 3, 2, 1, 0
    m.trainer_spec.unk_piece, m.trainer_spec.bos_piece = "<unk>", "<bos>"
    m.trainer_spec.eos_piece, m.trainer_spec.pad_piece = "<eos>", "<pad>"
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    T = pb.ModelProto.SentencePiece
    pieces = [("<pad>", T.CONTROL), ("<eos>", T.CONTROL), ("<bos>", T.CONTROL), ("<unk>", T.UNKNOWN)]
    pieces += [(f"<0x{b:02X}>", T.BYTE) for b in range(256)] + [("▁", T.NORMAL)]
    for text, typ in pieces:
        p = m.pieces.add()
        p.piece, p.score, p.type = text, 0.0, typ
    m.trainer_spec.vocab_size = len(pieces)
    d.mkdir()
    (d / "tokenizer.model").write_bytes(m.SerializeToString())
    config = dict(TINY_CONFIG, vocab_size=len(pieces), num_hidden_layers=2, sliding_window=512)
    lm = make_tiny(vocab_size=len(pieces), num_hidden_layers=2, sliding_window=512)
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    (d / "config.json").write_text(json.dumps(config))
    (d / "gemmdrift_source.json").write_text(json.dumps({"note": "the tests' tiny model", "tensor_types": {}}))


def _run(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPTS / "run.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT)


def test_run_end_to_end_on_the_cpu_resumes_and_keeps_every_finished_step(tmp_path):
    model = tmp_path / "tiny"
    _tiny_checkpoint(model)
    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--no-install", "--device", "cpu", "--sizes", "small", "--model", str(model), "--work", str(work),
              "--out", str(out), "--foreground"]
    r = _run(*common, "--only", "env,repeat")  # an interrupted run: two steps finished
    assert r.returncode == 0, r.stderr
    first = json.loads((out / "result.json").read_text())
    assert set(first["steps"]) == {"env", "repeat"} and first["steps"]["repeat"]["answer_repeatable"] is True
    r = _run(*common)
    assert r.returncode == 0, r.stderr
    result = json.loads((out / "result.json").read_text())
    steps = result["steps"]
    assert list(steps) == ["env", "repeat", "primitives", "replay-check", "kernels", "stack", "predict"]
    bad = {k: (s["status"], [c.get("error") for c in s["commands"]]) for k, s in steps.items() if s["status"] != "done"}
    assert not bad
    assert steps["env"]["tries"] == 1 and steps["repeat"]["tries"] == 1  # kept, not run again
    assert steps["env"]["commands"][0]["answer"]["backend"] == "cpu"
    assert [c["label"] for c in steps["primitives"]["commands"]] == ["gemma3-270m-bf16", "gemma3-270m-q4"]
    assert all(c["answer"]["ok"] for c in steps["primitives"]["commands"])
    assert "max_abs_dlogit/sm90/decode-vs-cpu/default" in steps["predict"]["commands"][0]["answer"]["figures"]
    assert steps["kernels"]["commands"][0]["answer"]["paths"][0]["path"] == "model"  # the summary came through
    assert "qualifier" not in result and all(s["seconds"] > 0 for s in steps.values())
    with tarfile.open(out / "steps.tar.gz") as t:
        names = t.getnames()
    assert "steps/repeat/repeat.json" in names and "steps/stack/stack.log" in names
    assert any(n.startswith("steps/stack/") and n.endswith("result.json") for n in names)
    assert len(list(out.iterdir())) <= 8


def test_run_no_device_is_one_line_and_a_timeout_keeps_going(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    r = _run("--no-install", "--device", "gpu", "--sizes", "small", "--work", str(work), "--out", str(out),
             "--foreground")
    assert r.returncode == 0
    result = json.loads((out / "result.json").read_text())
    assert result["device"]["ok"] is False and "\n" not in result["device"]["error"]
    assert "CUDA" in result["device"]["error"] and result["steps"] == {} and "Traceback" not in r.stdout
    assert r.stdout.strip().startswith("device: ")
    # A step over its budget is 'timeout' and the next step runs; a device found not repeatable qualifies it.
    (work / "result.json").write_text(json.dumps({"device": {"ok": True}, "steps": {
        "repeat": {"status": "done", "answer_repeatable": False}}}))
    r = _run("--no-install", "--device", "cpu", "--sizes", "small", "--work", str(work), "--out", str(out),
             "--foreground", "--only", "env,primitives", "--budget", "env=0.01", "--budget", "primitives=0.01")
    steps = json.loads((out / "result.json").read_text())["steps"]
    assert steps["env"]["status"] == "timeout" and steps["primitives"]["status"] == "timeout"
    assert "not repeatable" in steps["env"]["qualified"]


def test_bad_input_is_one_line_before_anything_runs(tmp_path):
    work = tmp_path / "work"
    r = _run("--no-install", "--device", "cpu", "--work", str(work), "--budget", "env")
    assert r.returncode == 2 and r.stderr == "run: --budget takes STEP=SECONDS\n"
    work.mkdir()
    (work / "result.json").write_text(json.dumps({"device_asked": "gpu", "sizes": "gpu", "model": "embedded"}))
    r = _run("--no-install", "--device", "cpu", "--sizes", "small", "--work", str(work), "--foreground")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "other inputs: device_asked 'gpu' (now 'cpu'); sizes 'gpu' (now 'small')" in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPTS / "measure.py"), "repeat", "--device", "cpu", "--tokens", "8",
                        "--split", "8", "--json", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr == "measure repeat: ValueError: --split 8 must lie inside --tokens 8\n"
    assert not (tmp_path / "r.json").exists()


def test_rebuild_wheel_refuses_a_file_that_differs_from_its_record(tmp_path):
    _fake_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", "pkg")
    for altered in (False, True):
        tar = tmp_path / f"pkg{altered}.tar.xz"
        with zipfile.ZipFile(tmp_path / "pkg-1.0-py3-none-any.whl") as z, lzma.open(tar, "wb") as xz, \
                tarfile.open(fileobj=xz, mode="w") as t:
            for info in z.infolist():
                data = z.read(info)
                if altered and info.filename == "pkg/__init__.py":
                    data = b"VALUE = 43\n"  # one byte changed on the way
                ti = tarfile.TarInfo(info.filename)
                ti.size = len(data)
                import io

                t.addfile(ti, io.BytesIO(data))
        dest = tmp_path / f"out{altered}"
        dest.mkdir()
        if altered:
            with pytest.raises(plan.PackError, match="1 files differ from its RECORD, e.g. pkg/__init__.py"):
                install.rebuild_wheel(tar, "pkg-1.0-py3-none-any.whl", dest)
        else:
            wheel = install.rebuild_wheel(tar, "pkg-1.0-py3-none-any.whl", dest)
            with zipfile.ZipFile(wheel) as z:
                assert z.read("pkg/__init__.py") == b"VALUE = 42\n" and z.namelist()[-1].endswith("RECORD")
