"""--drafter dflash (issue 13 item 3): the plan install.sh prints, serve's docker command, the drafter check of
`onespark verify`, and step 0's drafter fetch against a local nginx standing in for the Hub.

The drafter stand-in is written with the `safetensors` library (the real format, not our writer) and a
config.json with the fields vLLM 0.32.0 reads of z-lab/Qwen3.5-122B-A10B-DFlash (architectures
DFlashDraftModel, dflash_config target_layer_ids / mask_token_id), at the 122B spec's tiny dims.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from onespark import __version__
from onespark.model import specs
from tests._hub import NEEDS_NGINX, NGINX, hub_env, publish, serve

ROOT = Path(__file__).resolve().parent.parent
SHA = "d" * 40
TINY = specs.SPECS[specs.DEFAULT].tiny
DRAFTER_REPO = specs.SPECS[specs.DEFAULT].dflash.repo


def make_drafter(d: Path, one_file: bool = False, **config) -> Path:
    """A two-shard DFlash drafter for the 122B spec's tiny dims, with its index; or one model.safetensors and no
    index (one_file), a layout verify --drafter takes as well."""
    d.mkdir(parents=True)
    h, g = torch.Generator().manual_seed(5), TINY["hidden_size"]
    shards = {
        "model-00001-of-00002.safetensors": {"fc.weight": torch.randn(g, 2 * g, generator=h).bfloat16(),
                                            "layers.0.self_attn.q_proj.weight": torch.randn(g, g, generator=h)
                                            .bfloat16()},
        "model-00002-of-00002.safetensors": {"norm.weight": torch.ones(g).bfloat16()},
    }
    if one_file:
        shards = {"model.safetensors": {n: t for tensors in shards.values() for n, t in tensors.items()}}
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(d / fname))
        weight_map.update({n: fname for n in tensors})
    if not one_file:
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": g, "num_hidden_layers": 1,
           "vocab_size": TINY["vocab_size"],
           "dflash_config": {"block_size": 16, "mask_token_id": 7, "target_layer_ids": [0, 2]}}
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def onespark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onespark", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def lines(r: subprocess.CompletedProcess) -> list[str]:
    return [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]


def docker_argv(out: str) -> list[str]:
    line = next(x for x in out.splitlines() if "+ docker run" in x)
    return shlex.split(line.split("+ ", 1)[1])


def spec_config(argv: list[str]) -> list[dict]:
    return [json.loads(argv[i + 1]) for i, a in enumerate(argv) if a == "--speculative-config"]


# ---- install.sh -----------------------------------------------------------------------------------

def test_install_dry_run_dflash_on_032_fetches_the_drafter_and_serves_it(tmp_path):
    r = subprocess.run(["bash", "install.sh", "--dry-run", "--vllm", "0.32.0", "--drafter", "dflash",
                        "--drafter-revision", SHA, "--launch", "--work", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    fetch = [x for x in r.stdout.splitlines() if "+ onespark download" in x]
    assert len(fetch) == 1 and f"--drafter dflash --drafter-revision {SHA}" in fetch[0], r.stdout
    argv = docker_argv(r.stdout)
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert f"{tmp_path}/dflash:/drafter:ro" in mounts, mounts
    assert spec_config(argv) == [{"method": "dflash", "model": "/drafter", "num_speculative_tokens": 12}]
    assert argv[argv.index("--host") - 1] == f"onespark/v2:{__version__}"  # 0.32.0 is the default track: plain names


def test_install_dflash_on_019_is_one_line_naming_the_032_track(tmp_path):
    r = subprocess.run(["bash", "install.sh", "--dry-run", "--vllm", "0.19.1", "--drafter", "dflash", "--work", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    out = lines(r)
    assert len(out) == 1 and "--vllm 0.32.0" in out[0] and "--drafter dflash" in out[0], out


def test_install_dry_run_without_drafter_revision_says_it_is_needed(tmp_path):
    r = subprocess.run(["bash", "install.sh", "--dry-run", "--vllm", "0.32.0", "--drafter", "dflash",
                        "--work", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "a real run needs --drafter-revision SHA" in r.stdout and "issue #152" in r.stdout


# ---- onespark serve --------------------------------------------------------------------------------

SERVE = ("serve", "--dry-run", "--checkpoint", "/tmp/onespark-no-model", "--model", specs.DEFAULT,
         "--image", "onespark/v2:x-vllm0.32.0", "--drafter", "dflash", "--drafter-dir", "/tmp/onespark-drafter")


def test_serve_dry_run_shows_the_dflash_config_and_the_read_only_mount():
    r = onespark(*SERVE)
    assert r.returncode == 0, r.stderr
    argv = docker_argv(r.stdout)
    assert "/tmp/onespark-drafter:/drafter:ro" in argv and "/tmp/onespark-no-model:/model:ro" in argv
    assert spec_config(argv) == [{"method": "dflash", "model": "/drafter", "num_speculative_tokens": 12}]


def test_serve_num_draft_tokens_and_a_user_speculative_config_win():
    argv = docker_argv(onespark(*SERVE, "--num-draft-tokens", "10").stdout)
    assert spec_config(argv) == [{"method": "dflash", "model": "/drafter", "num_speculative_tokens": 10}]
    own = '{"method":"dflash","model":"/drafter","num_speculative_tokens":8}'
    argv = docker_argv(onespark(*SERVE, "--", "--speculative-config", own).stdout)
    assert spec_config(argv) == [json.loads(own)]


def _serve_with(flag: str, value: str | None) -> list[str]:
    """SERVE with flag's value replaced (None: the flag left out), or the flag added."""
    args = list(SERVE)
    if flag in args:
        i = args.index(flag)
        del args[i:i + 2]
    return args + ([flag, value] if value is not None else [])


@pytest.mark.parametrize("flag, value, needle", [
    ("--image", f"onespark/v2:{__version__}-vllm0.19.1", "the vLLM 0.32.0 track's image"),  # 0.19.1's image
    ("--image", f"onespark/v2-tq:{__version__}-vllm0.19.1", "the vLLM 0.32.0 track's image"),
    ("--drafter-dir", None, "--drafter-dir DIR"),
    ("--num-draft-tokens", "0", "argument --num-draft-tokens: expected a whole number of at least 1, got '0'"),
])
def test_serve_dflash_bad_input_is_one_line(flag, value, needle):
    r = onespark(*_serve_with(flag, value))
    assert r.returncode != 0 and len(lines(r)) == 1 and needle in r.stderr, (r.stdout, r.stderr)


def test_serve_dflash_on_the_default_image():
    """The default track is 0.32.0: its plain-named image takes --drafter dflash with no --image."""
    r = onespark(*_serve_with("--image", None))
    assert r.returncode == 0, r.stderr
    argv = docker_argv(r.stdout)
    assert argv[argv.index("--host") - 1] == f"onespark/v2:{__version__}" and spec_config(argv)[0]["method"] == "dflash"


def test_serve_without_drafter_keeps_mtp():
    r = onespark("serve", "--dry-run", "--checkpoint", "/tmp/m", "--model", specs.DEFAULT)
    argv = docker_argv(r.stdout)
    assert spec_config(argv) == [specs.MTP2] and not any(a.endswith(":/drafter:ro") for a in argv)


# ---- onespark verify --drafter ----------------------------------------------------------------------

def test_verify_accepts_a_good_drafter(tmp_path):
    d = make_drafter(tmp_path / "dflash")
    r = onespark("verify", "--drafter", str(d))
    assert r.returncode == 0, r.stderr
    assert "3 tensors in 2 files" in r.stdout and r.stdout.rstrip().endswith("ok")


def _break_index(d: Path) -> None:
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def _drop_from_index(d: Path) -> None:
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["norm.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


@pytest.mark.parametrize("config, damage, needle", [
    ({"architectures": ["Qwen3ForCausalLM"]}, None, "not a DFlash drafter"),
    ({"dflash_config": {"mask_token_id": 7, "target_layer_ids": [0, 9]}}, None, "past qwen3.5-122b-a10b's 4"),
    ({"dflash_config": {"target_layer_ids": [0]}}, None, "mask_token_id"),
    ({"hidden_size": 3000}, None, "hidden_size 3000"),
    ({}, _break_index, "lm_head.weight"),
    ({}, _drop_from_index, "does not list 1 tensor"),
])
def test_verify_refuses_a_bad_drafter_in_one_line(tmp_path, config, damage, needle):
    d = make_drafter(tmp_path / "dflash", **config)
    if damage:
        damage(d)
    r = onespark("verify", "--drafter", str(d))
    assert r.returncode != 0
    err = [x for x in r.stderr.splitlines() if x.startswith("onespark")]
    assert len(err) == 1 and needle in err[0], r.stderr


def test_verify_drafter_with_a_missing_shard_names_it(tmp_path):
    d = make_drafter(tmp_path / "dflash")
    (d / "model-00002-of-00002.safetensors").unlink()
    r = onespark("verify", "--drafter", str(d))
    assert r.returncode != 0 and "model-00002-of-00002.safetensors: missing" in r.stderr


# ---- onespark download --drafter dflash ------------------------------------------------------------

def test_download_dflash_without_revision_is_one_line_and_creates_nothing(tmp_path):
    r = onespark("download", "--dest", str(tmp_path / "w"), "--skip-int4", "--skip-fp8", "--drafter", "dflash")
    assert r.returncode != 0 and len(lines(r)) == 1 and "--drafter-revision" in r.stderr and "#152" in r.stderr
    assert not (tmp_path / "w").exists()


@pytest.fixture(scope="module")
def drafter_hub(tmp_path_factory):
    if NGINX is None:
        pytest.skip(NEEDS_NGINX)
    d = tmp_path_factory.mktemp("dflash-hub")
    # Two revisions of one repo: publish makes the listing folder once per call, so the bad revision is
    # published under a scratch root and its two folders moved in.
    publish(d / "www", DRAFTER_REPO, SHA, make_drafter(d / "src-good"))
    publish(d / "www-bad", DRAFTER_REPO, "e" * 40, make_drafter(d / "src-bad", architectures=["Qwen3ForCausalLM"]))
    publish(d / "www-one", DRAFTER_REPO, "f" * 40, make_drafter(d / "src-one", one_file=True))
    for www, rev in (("www-bad", "e" * 40), ("www-one", "f" * 40)):
        for sub in (Path(DRAFTER_REPO, "resolve", rev), Path("api", "models", DRAFTER_REPO, "tree", rev)):
            (d / www / sub).rename(d / "www" / sub)
    with serve(d) as endpoint:
        yield d, endpoint


def _fetch(endpoint: str, dest: Path, revision: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onespark", "download", "--dest", str(dest), "--skip-int4",
                           "--skip-fp8", "--drafter", "dflash", "--drafter-revision", revision],
                          cwd=ROOT, env=hub_env(endpoint, dest.parent), capture_output=True, text=True, timeout=300)


def test_download_fetches_the_drafter_to_dest_dflash_and_resumes(drafter_hub, tmp_path):
    d, endpoint = drafter_hub
    r = _fetch(endpoint, tmp_path / "w", SHA)
    assert r.returncode == 0, r.stderr
    got, src = tmp_path / "w" / "dflash", d / "src-good"
    for p in src.iterdir():
        assert (got / p.name).read_bytes() == p.read_bytes(), p.name
    rec = json.loads((got / "onespark-download.json").read_text())
    assert rec["repo"] == DRAFTER_REPO and rec["revision"] == SHA and rec["complete"] and rec["files"] == 2
    again = _fetch(endpoint, tmp_path / "w", SHA)
    assert again.returncode == 0 and "already downloaded" in again.stdout


def test_a_one_file_drafter_is_downloaded_once(drafter_hub, tmp_path):
    """A drafter as one model.safetensors without an index passes the drafter check, so a finished download of it
    is finished: the re-run says so (it took the missing index for damage and fetched again, every time)."""
    _, endpoint = drafter_hub
    assert _fetch(endpoint, tmp_path / "w", "f" * 40).returncode == 0
    again = _fetch(endpoint, tmp_path / "w", "f" * 40)
    assert again.returncode == 0 and "already downloaded" in again.stdout, again.stdout + again.stderr
    assert "damaged" not in again.stdout + again.stderr


def test_download_of_a_bad_drafter_is_not_recorded_complete(drafter_hub, tmp_path):
    d, endpoint = drafter_hub
    r = _fetch(endpoint, tmp_path / "w", "e" * 40)
    assert r.returncode != 0 and "not a DFlash drafter" in r.stderr
    assert not (tmp_path / "w" / "dflash" / "onespark-download.json").exists()


# ---- the flags against vLLM 0.32.0's own config -------------------------------------------------------

@pytest.mark.vllm032
def test_dflash_config_fields_are_vllm_032s():
    """serve's --speculative-config names fields and a method that vLLM 0.32.0's SpeculativeConfig has, and the
    drafter architecture verify requires is the one 0.32.0's registry maps to its DFlash model."""
    import dataclasses
    import typing

    vllm = pytest.importorskip("vllm")
    if vllm.__version__.split("+")[0] != "0.32.0":
        pytest.skip(f"vLLM {vllm.__version__}: this checks the 0.32.0 track")
    from vllm.config import speculative
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS

    cfg = specs.dflash_config(specs.SPECS[specs.DEFAULT])
    fields = {f.name for f in dataclasses.fields(speculative.SpeculativeConfig)}
    assert set(cfg) <= fields
    assert cfg["method"] in typing.get_args(speculative.DFlashModelTypes)
    assert _SPECULATIVE_DECODING_MODELS[specs.DFLASH_ARCH] == ("qwen3_dflash", "DFlashQwen3ForCausalLM")
