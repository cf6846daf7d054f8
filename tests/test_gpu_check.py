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
