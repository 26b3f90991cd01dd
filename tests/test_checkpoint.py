"""Steps 1-2 and verify on generated checkpoints, read back with independent tools.

References: the `safetensors` library + torch (not our parser) read every file we write; INT4 and FP8 values
are decoded with torch bit operations written here, not with onespark's own decoders.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from onespark.checkpoint.hybrid import hybrid
from onespark.checkpoint.lock import LOCK_FILE
from onespark.checkpoint.mtp import mtp
from onespark.checkpoint.safetensors_io import Range, copy_file_tmp, read_header, write_safetensors
from onespark.checkpoint.synth import REAL_TEXT, REAL_VISION, TINY_TEXT, synth
from onespark.checkpoint.verify import verify
from onespark.checkpoint.writer import MANIFEST_FILE, Output, Writer
from onespark.errors import UserError
from onespark.model import qwen35, specs
from tests._checkpoints import load_all, synth_pair

ROOT = Path(__file__).resolve().parents[1]


def tree_digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One INT4 (122B-like: MTP 16-bit, not in the index) + FP8 pair from the same seed."""
    return synth_pair(tmp_path_factory.mktemp("pair"), seed=7)


def test_synth_files_read_with_safetensors_library(pair):
    for fmt in ("int4", "fp8"):
        d = pair / fmt
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        tensors = load_all(d)
        assert set(idx["weight_map"]) <= set(tensors)
        expected = qwen35.expected_tensors(json.loads((d / "config.json").read_text()))
        for name, t in tensors.items():
            e = expected[name]
            assert tuple(t.shape) == e.shape, name
        required = {n for n in expected if not qwen35.is_optional(n)}
        assert required <= set(tensors)
    qc = json.loads((pair / "int4" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "auto-round" and qc["packing_format"] == "auto_round:auto_gptq"
    assert qc["bits"] == 4 and qc["group_size"] == 128 and qc["sym"] is True
    assert json.loads((pair / "int4" / "quantization_config.json").read_text()) == qc
    # the 122B layout: MTP head in model_extra_tensors.safetensors, absent from the index
    idx = json.loads((pair / "int4" / "model.safetensors.index.json").read_text())
    assert not any(n.startswith("mtp.") for n in idx["weight_map"])
    with safe_open(str(pair / "int4" / "model_extra_tensors.safetensors"), framework="pt") as g:
        assert all(k.startswith("mtp.") for k in g.keys())
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for n, t in load_all(pair / "int4").items()
                                                if n in idx["weight_map"])


def _unpack_gptq(qweight: torch.Tensor) -> torch.Tensor:
    """auto_gptq v1: int32 [in/8, out], input row 8j+k in bits 4k -> [out, in] ints 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = (qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
    return nib.reshape(-1, qweight.shape[1]).T


def test_int4_packing_decodes_to_the_master_weight(pair):
    from onespark.checkpoint.synth import master_weight
    t = load_all(pair / "int4")
    p = "model.language_model.layers.3.self_attn.q_proj"  # a full-attention layer (layer_types[3])
    q, s, z, g = t[p + ".qweight"], t[p + ".scales"], t[p + ".qzeros"], t[p + ".g_idx"]
    assert q.dtype == torch.int32 and s.dtype == torch.float16 and z.dtype == torch.int32 and g.dtype == torch.int32
    assert bool((z == 0x77777777).all())  # GPTQ v1 stores zero-1 = 7 in every nibble for symmetric int4
    assert torch.equal(g, torch.arange(q.shape[0] * 8, dtype=torch.int32) // 128)
    w = (_unpack_gptq(q).double() - 8) * s.double().T.repeat_interleave(128, dim=1)
    ref = torch.from_numpy(master_weight(7, p, tuple(w.shape))).double()
    # round-to-nearest error is at most half a quantization step (the group's scale), + fp16 scale rounding
    step = s.double().T.repeat_interleave(128, dim=1)
    assert bool(((w - ref).abs() <= 0.5 * step * (1 + 1e-3) + 1e-7).all())


def test_hybrid_splices_fp8_equal_to_bf16_and_copies_everything_else(pair, tmp_path):
    before = tree_digest(pair)
    out = tmp_path / "hyb"
    man = hybrid(pair / "int4", str(pair / "fp8"), out, log=lambda m: None)
    assert tree_digest(pair) == before, "inputs must never change"
    src, fp8, res = load_all(pair / "int4"), load_all(pair / "fp8"), load_all(out)
    targets = qwen35.shared_expert_weights(json.loads((pair / "int4" / "config.json").read_text()))
    assert len(targets) == 12 and sorted(man["steps"]["hybrid"]["replaced"]) == sorted(targets)
    for name in targets:
        w, s = res[name], res[name[:-6] + "weight_scale_inv"]
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.bfloat16
        assert torch.equal(w.view(torch.uint8), fp8[name].view(torch.uint8))
        deq = w.double() * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        ref = src[name].double()
        # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4; below 2^-6 * scale it is subnormal
        # with spacing 2^-9 * scale, so allow that absolute floor too.
        floor = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]] * 2.0**-9
        assert bool(((deq - ref).abs() <= ref.abs() * 2.0**-4 + floor).all()), name
    for name, t in src.items():
        if name not in targets:
            assert torch.equal(res[name].view(torch.uint8), t.view(torch.uint8)), name
    assert set(res) == set(src) | {n[:-6] + "weight_scale_inv" for n in targets}
    # the MTP head's file has nothing to replace: it is carried byte for byte
    extra = "model_extra_tensors.safetensors"
    assert (out / extra).read_bytes() == (pair / "int4" / extra).read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    h = cfg["quantization_config"]["onespark_fp8"]
    assert sorted(h["layers"]) == sorted(n[: -len(".weight")] for n in targets)
    assert h["weight_block_size"] == [128, 128] and h["scale_name"] == "weight_scale_inv"
    assert cfg["quantization_config"]["quant_method"] == "auto-round"
    assert json.loads((out / "quantization_config.json").read_text()) == cfg["quantization_config"]
    for f, e in man["files"].items():
        assert hashlib.sha256((out / f).read_bytes()).hexdigest() == e["sha256"], f
    assert man["steps"]["hybrid"]["unmatched_fp8_by_category"]["routed experts"] > 0
    # re-running is a no-op
    logs = []
    hybrid(pair / "int4", str(pair / "fp8"), out, log=logs.append)
    assert "already done" in logs[0]


@pytest.mark.parametrize("mtp_in_index", [False, True], ids=["mtp-not-in-index", "mtp-in-index"])
@pytest.mark.parametrize("mtp_dtype", ["bf16", "int4"], ids=["mtp-bf16", "mtp-int4"])
def test_pipeline_synth_hybrid_mtp_verify(tmp_path, mtp_in_index, mtp_dtype):
    synth(tmp_path / "int4", "int4", seed=1, mtp_in_index=mtp_in_index, mtp_dtype=mtp_dtype)
    synth(tmp_path / "fp8", "fp8", seed=1)
    out = tmp_path / "hyb"
    hybrid(tmp_path / "int4", str(tmp_path / "fp8"), out, log=lambda m: None)
    problems, _ = verify(out)
    if mtp_in_index:
        assert problems == []
    else:
        assert len(problems) == 1 and "onespark mtp" in problems[0]
    r = mtp(out, log=lambda m: None)
    assert r["added"] == (0 if mtp_in_index else r["mtp_tensors"])
    assert mtp(out, log=lambda m: None)["added"] == 0  # idempotent
    problems, summary = verify(out)
    assert problems == [], problems
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    mtp_names = {n for n in idx["weight_map"] if n.startswith("mtp.")}
    with safe_open(str(out / "model_extra_tensors.safetensors"), framework="pt") as g:
        assert mtp_names == set(g.keys())
    exp_mtp = [n for n in qwen35.expected_tensors(json.loads((out / "config.json").read_text())) if n.startswith("mtp.")]
    assert summary["mtp_tensors"] == len(exp_mtp) == len(mtp_names)  # synth writes the optional g_idx too
    assert summary["mtp_required"] == len([n for n in exp_mtp if not n.endswith(".g_idx")])
    if mtp_dtype == "int4":
        assert any(n.endswith(".qweight") for n in mtp_names)
    else:
        assert all(n.endswith((".weight", "A_log", "dt_bias")) for n in mtp_names)


def test_real_config_implies_785_mtp_333_vision_tensors_and_144_targets(tmp_path):
    synth(tmp_path / "real", "int4", dims=REAL_TEXT, weights=False, vision=REAL_VISION)
    cfg = json.loads((tmp_path / "real" / "config.json").read_text())
    expected = qwen35.expected_tensors(cfg)
    assert len([n for n in expected if n.startswith("mtp.")]) == 785
    assert len([n for n in expected if n.startswith("model.visual.")]) == 333  # the INT4 model card's count
    assert len(qwen35.shared_expert_weights(cfg)) == 144


def test_mtp_restores_a_dropped_head_from_source(pair, tmp_path):
    out = tmp_path / "hyb"
    hybrid(pair / "int4", str(pair / "fp8"), out, log=lambda m: None)
    (out / "model_extra_tensors.safetensors").unlink()  # what the public fork's splice did
    problems, _ = verify(out)
    assert any("MTP head incomplete" in p for p in problems)
    with pytest.raises(UserError, match="MTP head incomplete.*--source"):
        mtp(out, log=lambda m: None)
    mtp(out, source=pair / "int4", log=lambda m: None)
    assert verify(out)[0] == []


# ---- bad input: a clear error and nothing lost ---------------------------------------------------

def test_bad_directories(pair, tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        hybrid(tmp_path / "nope", str(pair / "fp8"), tmp_path / "o", log=lambda m: None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty directory"):
        hybrid(tmp_path / "empty", str(pair / "fp8"), tmp_path / "o", log=lambda m: None)
    with pytest.raises(UserError, match="empty directory"):
        verify(tmp_path / "empty")
    with pytest.raises(UserError, match="inside --int4"):
        hybrid(pair / "int4", str(pair / "fp8"), pair / "int4" / "out", log=lambda m: None)
    with pytest.raises(UserError, match="not auto-round"):
        hybrid(pair / "fp8", str(pair / "fp8"), tmp_path / "o2", log=lambda m: None)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "precious.txt").write_text("keep me")
    with pytest.raises(UserError, match="not empty"):
        hybrid(pair / "int4", str(pair / "fp8"), tmp_path / "busy", log=lambda m: None)
    assert (tmp_path / "busy" / "precious.txt").read_text() == "keep me"


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_missing_truncated_and_corrupt_shards(pair, tmp_path):
    shard = "model-00002-of-00003.safetensors"
    d = _copy(pair / "int4", tmp_path / "missing")
    (d / shard).unlink()
    with pytest.raises(UserError, match=f"{shard}: missing"):
        hybrid(d, str(pair / "fp8"), tmp_path / "o", log=lambda m: None)
    d = _copy(pair / "int4", tmp_path / "trunc")
    data = (d / shard).read_bytes()
    (d / shard).write_bytes(data[: len(data) - 1000])
    with pytest.raises(UserError, match="truncated"):
        hybrid(d, str(pair / "fp8"), tmp_path / "o", log=lambda m: None)
    with pytest.raises(UserError, match="truncated"):
        verify(d)
    d = _copy(pair / "int4", tmp_path / "json")
    data = bytearray((d / shard).read_bytes())
    data[8:12] = b"{{{{"  # header bytes that are not JSON
    (d / shard).write_bytes(bytes(data))
    with pytest.raises(UserError, match="not valid JSON"):
        hybrid(d, str(pair / "fp8"), tmp_path / "o", log=lambda m: None)
    assert not (tmp_path / "o").exists()


def test_fp8_source_with_wrong_shapes(pair, tmp_path):
    d = _copy(pair / "fp8", tmp_path / "fp8bad")
    name = "model.language_model.layers.1.mlp.shared_expert.gate_proj.weight"
    fname = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    h = read_header(pair / "fp8" / fname)
    items = [(t.name, t.dtype, t.shape[::-1] if t.name == name else t.shape, Range(h.path, t.begin, t.nbytes))
             for t in h.tensors.values()]  # same bytes, transposed shape
    write_safetensors(d / fname, items, h.metadata)
    with pytest.raises(UserError, match="FP8 source shapes do not match.*gate_proj"):
        hybrid(pair / "int4", str(d), tmp_path / "o", log=lambda m: None)
    other = tmp_path / "fp8other"
    synth(other, "fp8", seed=7, dims=dict(TINY_TEXT, shared_expert_intermediate_size=256))
    with pytest.raises(UserError, match="different models"):  # --model custom: the step's own dims check
        hybrid(pair / "int4", str(other), tmp_path / "o", spec=specs.custom("int4", "fp8"), log=lambda m: None)
    with pytest.raises(UserError, match="fp8other: these files match no spec"):  # a named spec refuses first
        hybrid(pair / "int4", str(other), tmp_path / "o", log=lambda m: None)


def test_not_enough_disk_is_checked_before_writing(pair, tmp_path, monkeypatch):
    import shutil as sh
    real = sh.disk_usage
    monkeypatch.setattr("onespark.checkpoint.hybrid.shutil.disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(UserError, match="not enough free disk"):
        hybrid(pair / "int4", str(pair / "fp8"), tmp_path / "o", log=lambda m: None)
    assert not list((tmp_path / "o").glob("*.safetensors"))


def test_verify_finds_tampering(pair, tmp_path):
    out = tmp_path / "hyb"
    hybrid(pair / "int4", str(pair / "fp8"), out, log=lambda m: None)
    mtp(out, log=lambda m: None)
    shard = out / "model-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    problems, _ = verify(out)
    assert any("sha256 differs" in p for p in problems)
    assert verify(out, fast=True)[0] == []
    # an index entry pointing at the wrong shard, and a tensor listed twice
    idx_path = out / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    name = "model.language_model.norm.weight"
    right = idx["weight_map"][name]
    idx["weight_map"][name] = "model-00001-of-00003.safetensors" if right != "model-00001-of-00003.safetensors" \
        else "model-00002-of-00003.safetensors"
    idx_path.write_text(json.dumps(idx))
    problems, _ = verify(out, fast=True)
    assert any(f"index puts {name}" in p for p in problems)


@pytest.mark.parametrize("block", [[128, {}], [128], ["128", 128], [0, 128]])
def test_a_hybrid_configs_bad_fp8_block_is_one_line(pair, tmp_path, block):
    """quantization_config.onespark_fp8.weight_block_size (step 1's record, which the layout divides by) is
    checked where config.json is read: verify and step 2 name the field, never a TypeError."""
    out = tmp_path / "hyb"
    hybrid(pair / "int4", str(pair / "fp8"), out, log=lambda m: None)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["onespark_fp8"]["weight_block_size"] = block
    (out / "config.json").write_text(json.dumps(config))
    for call in (lambda: verify(out, fast=True), lambda: mtp(out, log=lambda m: None)):
        with pytest.raises(UserError, match=r"onespark_fp8\.weight_block_size.* expected (a list of two|an integer in 1\.)"):
            call()


def test_cli_exit_status_and_one_line_error(pair, tmp_path):
    r = subprocess.run([sys.executable, "-m", "onespark", "verify", str(pair / "int4")], capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("onespark verify: error: 1 problem(s); first: ")
    r = subprocess.run([sys.executable, "-m", "onespark", "verify", str(pair / "fp8")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok")


SLOW_CHILD = """
import sys, time
import onespark.checkpoint.safetensors_io as io
real = io.copy_range
def slow(*a):  # the test's brake: makes the kill land mid-splice, deterministically
    time.sleep(0.01)
    real(*a)
io.copy_range = slow
from onespark.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_mid_splice_then_rerun_resumes_and_verifies(pair, tmp_path):
    out = tmp_path / "hyb"
    args = ["hybrid", "--int4", str(pair / "int4"), "--fp8", str(pair / "fp8"), "--out", str(out)]
    child = subprocess.Popen([sys.executable, "-c", SLOW_CHILD, *args], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    progress = out / ".onespark-hybrid-progress.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if progress.exists() and json.loads(progress.read_text() or "{}").get("done") and list(out.glob(".*.tmp-*")):
            break
        time.sleep(0.002)
    else:
        child.kill()
        pytest.fail("the splice never reached its second file")
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert not (out / MANIFEST_FILE).exists()
    logs = []
    hybrid(pair / "int4", str(pair / "fp8"), out, log=logs.append)
    assert any(m.startswith("resuming:") for m in logs), logs
    assert not list(out.glob(".*.tmp-*")) and not progress.exists()
    mtp(out, log=lambda m: None)
    assert verify(out)[0] == []
    clean = tmp_path / "clean"
    hybrid(pair / "int4", str(pair / "fp8"), clean, log=lambda m: None)
    mtp(clean, log=lambda m: None)
    for f in sorted(p.name for p in clean.glob("*.safetensors")) + ["model.safetensors.index.json"]:
        assert (out / f).read_bytes() == (clean / f).read_bytes(), f


def test_writer_resumes_the_same_inputs_starts_over_on_others_and_records_completion_last(tmp_path):
    """checkpoint.Writer on its own: what steps 0 and 1 rely on when a run is killed and run again."""
    out, logs = tmp_path / "out", []

    def output(name: str, data: bytes) -> Output:
        src = tmp_path / f"src-{name}"
        src.write_bytes(data)
        return Output(name, len(data), lambda dst: copy_file_tmp(src, dst))

    first = [output("a.bin", b"aaa"), output("b.bin", b"bb")]
    with Writer(out, ".progress.json", "record.json", log=logs.append) as w:  # a run killed after its first file
        w.resume("inputs-1", {o.name: o.size for o in first})
        w.write(first[0])
    assert (out / "a.bin").read_bytes() == b"aaa" and (out / ".progress.json").is_file()
    (out / ".b.bin.tmp-99").write_bytes(b"b")  # a temp file a killed run left: never trusted
    with Writer(out, ".progress.json", "record.json", log=logs.append) as w:
        w.resume("inputs-1", {o.name: o.size for o in first})
        assert set(w.done) == {"a.bin"} and logs[-1] == "resuming: 1 of 2 files already written"
        assert not (out / ".b.bin.tmp-99").exists()
        w.write(first[1])
        w.write_json("index.json", {"n": 2})
        assert not (out / "record.json").exists()
        w.finish({"files": w.files()})
    assert json.loads((out / "record.json").read_text())["files"] == {
        "a.bin": {"size": 3, "sha256": None}, "b.bin": {"size": 2, "sha256": None},
        "index.json": {"size": (out / "index.json").stat().st_size, "sha256": None}}
    assert not (out / ".progress.json").exists()  # the record says complete; no progress is left to resume
    with Writer(out, ".progress.json", "record.json", log=logs.append) as w:  # killed again, then inputs changed
        w.resume("inputs-1", {})
        w.write(output("c.bin", b"c"))
    (out / LOCK_FILE).write_text("")
    with Writer(out, ".progress.json", "record.json", log=logs.append) as w:
        w.resume("inputs-2", {"c.bin": 1})
        assert w.done == {} and logs[-1] == "inputs changed since the interrupted run: starting over"
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(UserError, match="not empty and was not written by"):
        Writer(out, ".progress.json", "record.json").refuse_foreign("the writer", "--out")
