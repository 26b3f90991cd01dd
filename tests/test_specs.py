"""Model specs (onespark.model.specs): synth -> hybrid -> mtp -> verify per spec, --model plumbing, bad input.

References: files are read back with the `safetensors` library and torch, INT8/INT4 words decoded with torch
bit operations written here; the real-shape MTP counts are the public figures (785 for the 122B's INT4 release,
2329 for the 35B's: adrianpuiu/DGX_Spark_Qwen3.5-35B-A3B-Optimized install.sh), not our own derivation.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from onespark.checkpoint.hybrid import hybrid
from onespark.checkpoint.mtp import mtp
from onespark.checkpoint.synth import master_weight, synth_spec
from onespark.checkpoint.verify import verify
from onespark.errors import UserError
from onespark.model import qwen35, specs
from tests._checkpoints import load_all
from tests._plan import in_order

ROOT = Path(__file__).resolve().parents[1]
NAMED = list(specs.SPECS)
QUIET = dict(log=lambda m: None)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onespark", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("name", NAMED)
def test_pipeline_per_spec_synth_hybrid_mtp_verify(tmp_path, name):
    """Each spec's tiny release pair through the steps as install.sh runs them, with its own MTP variant."""
    spec = specs.get(name)
    synth_spec(tmp_path / "int4", "int4", spec, seed=4)
    synth_spec(tmp_path / "fp8", "fp8", spec, seed=4)
    int4_cfg = json.loads((tmp_path / "int4" / "config.json").read_text())
    idx = json.loads((tmp_path / "int4" / "model.safetensors.index.json").read_text())
    # The spec's MTP variant as written: in the index or not, 16-bit or INT4, in model_extra_tensors.
    with safe_open(str(tmp_path / "int4" / "model_extra_tensors.safetensors"), framework="pt") as g:
        head = set(g.keys())
    assert head and all(n.startswith("mtp.") for n in head)
    assert any(n.startswith("mtp.") for n in idx["weight_map"]) == spec.mtp_in_index
    assert any(n.endswith(".qweight") for n in head) == (spec.mtp_dtype == "int4")
    assert any(n.endswith(".g_idx") for n in load_all(tmp_path / "int4")) == spec.g_idx
    if spec.splice:
        served = tmp_path / "hybrid"
        man = hybrid(tmp_path / "int4", str(tmp_path / "fp8"), served, spec=spec, **QUIET)
        src, fp8, res = load_all(tmp_path / "int4"), load_all(tmp_path / "fp8"), load_all(served)
        targets = [n for n in src if ".mlp.shared_expert." in n and n.startswith("model.language_model.layers.")]
        assert len(targets) == spec.tiny["num_hidden_layers"] * 3 == len(man["steps"]["hybrid"]["replaced"])
        for n in targets:
            assert res[n].dtype == torch.float8_e4m3fn
            assert torch.equal(res[n].view(torch.uint8), fp8[n].view(torch.uint8)), n
        assert (served / "model_extra_tensors.safetensors").read_bytes() == \
            (tmp_path / "int4" / "model_extra_tensors.safetensors").read_bytes()
    else:
        r = cli("hybrid", "--model", name, "--int4", str(tmp_path / "int4"), "--out", str(tmp_path / "hybrid"))
        assert r.returncode == 0 and f"step 1 skipped for {name}" in r.stdout, r.stdout + r.stderr
        assert not (tmp_path / "hybrid").exists()
        served = tmp_path / "int4"  # served as downloaded
    r = mtp(served, spec=spec, **QUIET)
    assert r["added"] == (0 if spec.mtp_in_index else len(head))
    problems, summary = verify(served, spec=spec)
    assert problems == [], problems
    wm = json.loads((served / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n for n in wm if n.startswith("mtp.")} == head  # every head tensor listed, at its file
    assert summary["mtp_tensors"] == len(head) and summary["spec"] == name
    assert qwen35.text_config(int4_cfg)["hidden_size"] == spec.tiny["hidden_size"]


@pytest.mark.parametrize("name", NAMED)
def test_real_preset_has_the_spec_dims_and_its_published_mtp_count(tmp_path, name):
    spec = specs.get(name)
    r = cli("synth", "--model", name, "--format", "int4", "--preset", "real", "--out", str(tmp_path / "real"))
    assert r.returncode == 0, r.stderr
    assert not list((tmp_path / "real").glob("*.safetensors"))  # no weights
    cfg = json.loads((tmp_path / "real" / "config.json").read_text())
    tc = cfg["text_config"]
    assert {k: tc[k] for k in spec.text} == spec.text
    expected = qwen35.expected_tensors(cfg)
    mtp_required = [n for n in expected if n.startswith("mtp.") and not qwen35.is_optional(n)]
    if spec.mtp_tensors is not None:
        assert len(mtp_required) == spec.mtp_tensors  # 785 (122B, 16-bit) / 2329 (35B, INT4 but mtp.fc)
    assert len(qwen35.shared_expert_weights(cfg)) == 3 * tc["num_hidden_layers"]
    assert specs.looks_like(tc)[0] in (name, "qwen3.5-35b-a3b")  # the two 35B releases share one architecture


def _unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """auto_gptq v1: int32 [in * bits / 32, out], input row (32/bits)j+k in bits k*bits -> [out, in]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (qweight.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return vals.reshape(-1, qweight.shape[1]).T


def test_mixed_release_stores_shared_experts_8bit_and_experts_4bit(tmp_path):
    spec = specs.get("qwen3.6-35b-a3b")
    synth_spec(tmp_path / "q", "int4", spec, seed=2)
    t = load_all(tmp_path / "q")
    p = "model.language_model.layers.0.mlp.shared_expert.up_proj"
    q, s, z = t[p + ".qweight"], t[p + ".scales"], t[p + ".qzeros"]
    h, i = spec.tiny["hidden_size"], spec.tiny["shared_expert_intermediate_size"]
    assert tuple(q.shape) == (h // 4, i) and tuple(z.shape) == (h // 128, i // 4)  # 4 int8 values a word
    assert bool((z == 0x7F7F7F7F).all())  # zero-1 = 127 in every byte (symmetric int8, GPTQ v1)
    w = (_unpack(q, 8).double() - 128) * s.double().T.repeat_interleave(128, dim=1)
    ref = torch.from_numpy(master_weight(2, p, tuple(w.shape))).double()
    step = s.double().T.repeat_interleave(128, dim=1)
    assert bool(((w - ref).abs() <= 0.5 * step * (1 + 1e-3) + 1e-7).all())
    e = "model.language_model.layers.0.mlp.experts.0.up_proj.qweight"
    assert tuple(t[e].shape) == (h // 8, spec.tiny["moe_intermediate_size"])  # routed experts stay 4-bit
    assert p + ".weight" not in t  # nothing 16-bit to splice: why the spec has no FP8 source
    problems, _ = verify(tmp_path / "q", spec=spec)
    assert problems == []


def test_other_models_files_are_refused_naming_the_spec_they_look_like(tmp_path):
    small = specs.get("qwen3.5-35b-a3b")
    synth_spec(tmp_path / "int4", "int4", small, seed=1)
    synth_spec(tmp_path / "fp8", "fp8", small, seed=1)
    with pytest.raises(UserError, match=r"look like qwen3.5-35b-a3b / qwen3.6-35b-a3b .*not qwen3.5-122b-a10b"):
        hybrid(tmp_path / "int4", str(tmp_path / "fp8"), tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()
    for cmd in (["verify", str(tmp_path / "int4")],
                ["hybrid", "--int4", str(tmp_path / "int4"), "--fp8", str(tmp_path / "fp8"), "--out",
                 str(tmp_path / "out")],
                ["mtp", str(tmp_path / "int4")]):
        r = cli(*cmd)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert "look like qwen3.5-35b-a3b" in lines[0] and "pass --model qwen3.5-35b-a3b" in lines[0]
    # the 122B's files with the 35B spec: refused the other way round
    synth_spec(tmp_path / "big", "int4", specs.get(specs.DEFAULT), seed=1)
    with pytest.raises(UserError, match=r"look like qwen3.5-122b-a10b .*not qwen3.5-35b-a3b"):
        verify(tmp_path / "big", spec=small)
    # the right spec accepts them
    assert verify(tmp_path / "int4", spec=small)[0] == []


def test_unknown_model_is_one_line_listing_the_specs(tmp_path):
    for cmd in (["synth", "--format", "int4", "--out", str(tmp_path / "x")], ["verify", str(tmp_path)],
                ["download", "--dest", str(tmp_path / "d")], ["specs"]):
        r = cli(*cmd, "--model", "qwen9-1t")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, (cmd, r.stderr)
        assert "--model qwen9-1t: unknown; the specs are: " + ", ".join(specs.names()) in lines[0]
    assert not (tmp_path / "x").exists() and not (tmp_path / "d").exists()
    r = cli("synth", "--model", "custom", "--format", "int4", "--out", str(tmp_path / "x"))
    assert r.returncode == 1 and "synth needs a named --model" in r.stderr and not (tmp_path / "x").exists()


def test_download_needs_a_revision_where_no_pin_is_public_and_skips_a_missing_fp8_source(tmp_path):
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}  # any network use would fail loudly
    r = cli("download", "--model", "qwen3.5-35b-a3b", "--dest", str(tmp_path), env=env)
    assert r.returncode == 1 and "Intel/Qwen3.5-35B-A3B-int4-AutoRound: no pinned revision" in r.stderr
    assert "pass --revision SHA" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("download", "--model", "custom", "--dest", str(tmp_path), env=env)
    assert r.returncode == 1 and "--model custom needs --int4-repo" in r.stderr
    r = cli("download", "--model", "qwen3.6-35b-a3b", "--skip-int4", "--dest", str(tmp_path / "d"), env=env)
    assert r.returncode == 0 and "no FP8 source for qwen3.6-35b-a3b" in r.stdout and "FP8 fetch skipped" in r.stdout
    assert not (tmp_path / "d" / "fp8").exists()


def test_custom_checks_against_the_checkpoints_own_config_and_refuses_what_it_cannot(tmp_path):
    synth_spec(tmp_path / "c", "int4", specs.get("qwen3.5-35b-a3b"), seed=1)
    r = cli("verify", str(tmp_path / "c"), "--model", "custom")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok") and "(custom)" in r.stdout, r.stderr
    cfg_path = tmp_path / "c" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["text_config"]["linear_num_value_heads"]
    cfg_path.write_text(json.dumps(cfg))
    r = cli("verify", str(tmp_path / "c"), "--model", "custom")
    assert r.returncode == 1 and "text_config lacks linear_num_value_heads" in r.stderr
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    r = cli("verify", str(tmp_path / "c"), "--model", "custom")
    assert r.returncode == 1 and "not a Qwen3.5/3.6 MoE checkpoint" in r.stderr


def test_specs_are_consistent_data():
    for s in specs.SPECS.values():
        assert s.int4.revision is None or len(s.int4.revision) == 40
        assert s.int4.pin_source and (s.fp8 is None) == bool(s.no_splice)
        assert set(s.tiny) == set(s.text) == set(specs.TEXT_35B)
        assert specs.looks_like(s.tiny) and specs.looks_like(s.text)
        assert 0 < s.serving["gpu_memory_utilization"] < 1 and s.serving["max_model_len"] > 0
        assert s.vllm_args()[:2] == ["--served-model-name", s.name]
        assert s.served_dir == ("hybrid" if s.splice else "int4")
    # the architectures' tiny dims differ, so a mismatch is detectable at test sizes too
    assert specs.facts(specs.TINY_122B) != specs.facts(specs.TINY_35B)
    assert specs.get(None).name == specs.DEFAULT == "qwen3.5-122b-a10b"
    assert specs.get("qwen3.5-35b-a3b").work_subdir == "qwen3.5-35b-a3b" and specs.get(None).work_subdir == ""
    r = cli("specs", "--model", "qwen3.5-35b-a3b", "--get", "fp8.revision")
    assert r.returncode == 0 and r.stdout.strip() == specs.get("qwen3.5-35b-a3b").fp8.revision


def test_serve_spec_puts_its_serving_defaults_before_the_users_flags(tmp_path):
    r = cli("serve", "--checkpoint", str(tmp_path), "--model", "qwen3.5-35b-a3b", "--dry-run", "--no-memory-guard",
            "--", "--max-model-len", "65536")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("onespark serve: + docker run"))
    argv = line.split()
    spec = specs.get("qwen3.5-35b-a3b")
    assert argv[argv.index("--served-model-name") + 1] == "qwen3.5-35b-a3b"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == str(spec.serving["gpu_memory_utilization"])
    assert argv.count("--max-model-len") == 1 and argv[argv.index("--max-model-len") + 1] == "65536"  # the user's
    assert "--speculative-config" in argv
    r = cli("serve", "--checkpoint", str(tmp_path), "--model", "nope", "--dry-run")
    assert r.returncode == 1 and "--model nope: unknown; the specs are:" in r.stderr


@pytest.mark.parametrize("command", ["serve", "doctor"])
def test_a_directory_given_to_model_is_refused_with_the_new_flag(tmp_path, command):
    """--model names a spec in every command; serve's and doctor's checkpoint directory is --checkpoint. The old
    spelling is one line naming the new flag, exit 2 (argparse's), no traceback."""
    r = cli(command, "--model", str(tmp_path), "--dry-run" if command == "serve" else "--skip-hf")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"onespark {command}: error: argument --model: {tmp_path} is a directory: give the checkpoint as "
        f"--checkpoint {tmp_path} (--model names a model spec, as in every command: onespark specs) "
        f"(see onespark {command} --help)"], r.stderr


def test_steps_after_step_1_and_serve_read_the_spec_the_manifest_records(tmp_path):
    """Step 1 records its spec; mtp, verify and serve given no --model take it (a 35B checkpoint would be refused
    as not the default 122B otherwise)."""
    name = "qwen3.5-35b-a3b"
    spec = specs.get(name)
    synth_spec(tmp_path / "int4", "int4", spec, seed=4)
    synth_spec(tmp_path / "fp8", "fp8", spec, seed=4)
    served = tmp_path / "hybrid"
    assert hybrid(tmp_path / "int4", str(tmp_path / "fp8"), served, spec=spec, **QUIET)["spec"] == name
    r = cli("mtp", str(served), "--source", str(tmp_path / "int4"))
    assert r.returncode == 0, r.stderr
    r = cli("verify", str(served), "--fast")
    assert r.returncode == 0 and f"{served} ({name}):" in r.stdout, r.stdout + r.stderr
    r = cli("serve", "--checkpoint", str(served), "--dry-run", "--no-memory-guard")
    assert r.returncode == 0, r.stderr
    argv = next(x for x in r.stdout.splitlines() if x.startswith("onespark serve: + docker run")).split()
    assert argv[argv.index("--served-model-name") + 1] == name


@pytest.mark.parametrize("name", NAMED)
def test_doctor_checks_disk_and_memory_for_the_chosen_spec(tmp_path, name):
    spec = specs.get(name)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       67108864 kB\nMemAvailable:   60000000 kB\n")  # 64 GiB
    r = cli("doctor", "--model", name, "--work", str(tmp_path / "w"), "--skip-hf", "--meminfo", str(meminfo))
    out = r.stdout
    assert f"steps 0-2 need {math.ceil(spec.disk_gb)} GB more" in out, out
    assert f"needs {spec.min_memory_gib} GiB" in out and f"{name} needs a 128 GB DGX Spark" in out, out
    assert r.returncode == 1


def _install(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ONESPARK_VENV": str(tmp_path / "venv")}
    return subprocess.run(["bash", "install.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)


def test_install_dry_run_prints_the_full_spark_plan_for_the_35b(tmp_path):
    work = tmp_path / "w"
    r = _install("--dry-run", "-y", "--model", "qwen3.5-35b-a3b", "--work", str(work), tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    w = f"{work}/qwen3.5-35b-a3b"  # beside the 122B's work/{int4,fp8,hybrid}, never inside them
    in_order(r.stdout, [
        "model qwen3.5-35b-a3b; work directory " + w,
        "a real run needs --revision SHA",  # no public pin for the 35B's INT4 repo
        f"onespark doctor --work {w} --model qwen3.5-35b-a3b",
        f"+ onespark download --dest {w} --model qwen3.5-35b-a3b",
        f"+ onespark hybrid --int4 {w}/int4 --fp8 {w}/fp8 --out {w}/hybrid --model qwen3.5-35b-a3b",
        f"+ onespark mtp {w}/hybrid --source {w}/int4 --model qwen3.5-35b-a3b",
        f"+ onespark verify {w}/hybrid --fast --model qwen3.5-35b-a3b",
        "-f Dockerfile.base", "-f Dockerfile.v2",
        f"serve --host 127.0.0.1 --port 8000 --replace --checkpoint {w}/hybrid --model qwen3.5-35b-a3b",
        "the server answers on http://127.0.0.1:8000/v1 (model qwen3.5-35b-a3b)",  # its served name
    ])
    assert not work.exists() and not (tmp_path / "venv").exists()  # nothing ran
    r = _install("--dry-run", "-y", "--model", "qwen3.5-35b-a3b", "--revision", "a" * 40, "--launch",
                 "--work", str(work), tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "a real run needs --revision" not in r.stdout
    in_order(r.stdout, [f"--model qwen3.5-35b-a3b --int4-revision {'a' * 40}",
                         f"-v {w}/hybrid:/model:ro", "--served-model-name qwen3.5-35b-a3b",
                         "--gpu-memory-utilization 0.5"])


def test_install_without_a_pin_stops_before_anything_and_qwen36_skips_the_splice(tmp_path):
    r = _install("-y", "--model", "qwen3.5-35b-a3b", "--work", str(tmp_path / "w"), tmp_path=tmp_path)
    assert r.returncode == 1 and "pass --revision SHA" in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "w").exists() and not (tmp_path / "venv").exists()
    r = _install("--dry-run", "-y", "--model", "qwen3.6-35b-a3b", "--launch", "--work", str(tmp_path / "w"),
                 tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    w = f"{tmp_path}/w/qwen3.6-35b-a3b"
    in_order(r.stdout, ["step 1 skipped for qwen3.6-35b-a3b: its shared experts are already 8-bit",
                         f"+ onespark mtp {w}/int4 --model qwen3.6-35b-a3b",
                         f"+ onespark verify {w}/int4 --fast --model qwen3.6-35b-a3b",
                         "onespark serve", f"--checkpoint {w}/int4 --model qwen3.6-35b-a3b",
                         f"-v {w}/int4:/model:ro", "--served-model-name qwen3.6-35b-a3b"])
    assert "onespark hybrid" not in r.stdout
    r = _install("--dry-run", "--model", "qwen9", tmp_path=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "onespark specs: error: --model qwen9: unknown; the specs are: " + ", ".join(specs.names())]
