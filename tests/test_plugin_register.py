"""register(): entry point, switches, version guard, idempotence; each scenario in a fresh process.

Like vLLM's own plugin tests (tests/plugins_tests/test_oot_registration_offline.py), every scenario starts a
new interpreter, because the plugin registers into process-global vLLM tables. The scenario runs this file
as a script (bottom), which goes through vLLM's real `load_general_plugins()` (entry point discovery,
VLLM_PLUGINS filtering) and reports what vLLM then holds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from onespark.patches import SUPPORTED_VLLM, TQ_CHOICES, choice, switch, version_supported
from onespark.patches._compat import track

pytestmark = pytest.mark.vllm032  # both tracks: each venv checks the plugin against its own vLLM

HERE = Path(__file__).resolve()


def _track() -> str:
    """"0.19.1" in .venv, "0.32.0" in .venv-032 (imported lazily: this file also runs as a script)."""
    from tests.conftest import vllm_track

    return vllm_track()
ALL = ["hybrid-fp8", "int8-lm-head", "turboquant-backend", "draft-vocab"]


@pytest.mark.parametrize("version,ok", [
    ("0.19.1", True), ("0.19.1+cu130", True), ("0.19.1.dev0+g1234abc", True), ("0.19.1+cpu", True),
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.32.0+cu130", True), ("0.32.0.dev0+gabc", True),
    ("0.19.10", False), ("0.19.2", False), ("0.19.0", False), ("0.19", False), ("1.0.19.1", False), ("", False),
    ("0.32.1", False), ("0.32", False), ("0.31.0", False), ("0.32.00", False), ("0.23.0", False),
])
def test_version_match(version, ok):
    assert version_supported(version) is ok


def test_track_names_the_release_and_refuses_a_third():
    assert SUPPORTED_VLLM == ("0.19.1", "0.32.0")
    assert track("0.32.0+cpu") == "0.32.0" and track("0.19.1+cu130") == "0.19.1"
    with pytest.raises(ValueError, match=r"vLLM 0\.23\.0 is none of the supported 0\.19\.1, 0\.32\.0"):
        track("0.23.0")


def test_switch_values(monkeypatch):
    for raw, want in [("1", True), ("on", True), ("TRUE", True), (" yes ", True), ("0", False), ("off", False),
                      ("No", False)]:
        monkeypatch.setenv("ONESPARK_X", raw)
        assert switch("ONESPARK_X", not want) is want
    monkeypatch.delenv("ONESPARK_X")
    assert switch("ONESPARK_X", True) is True
    # An empty value (`-e ONESPARK_X=`, a shell variable that was never set) is no answer: refused, never taken as
    # off; the line names the variable and every accepted value.
    for raw in ["maybe", "yes-please", "", " ", "2", "-1"]:
        monkeypatch.setenv("ONESPARK_X", raw)
        with pytest.raises(ValueError, match=rf"^ONESPARK_X={re.escape(repr(raw))} is not a switch value: use 1 or 0 "
                                             r"\(also true/false, on/off, yes/no\)"):
            switch("ONESPARK_X", True)


def test_tq_choices(monkeypatch):
    """The TurboQuant backend's three choices: the default when unset, each listed value as it is, anything else (an
    empty value, another case) refused in one line that names the variable and every value."""
    for name, values in TQ_CHOICES.items():
        monkeypatch.delenv(name, raising=False)
        assert choice(name) == values[0]
        for value in values:
            monkeypatch.setenv(name, value)
            assert choice(name) == value
        for raw in ["", values[-1].upper(), f" {values[0]}", "1"]:
            monkeypatch.setenv(name, raw)
            with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(raw))} is not one of its values: use "
                                                 rf"{values[0]} \(the default\), {values[1]} or {values[2]}$"):
                choice(name)


# Every 1/0 switch the plugin reads, the draft head's INT4 choice (read only when the draft is built, after the
# weights loaded), the version escape hatch (read only for an unsupported vLLM) and the TurboQuant backend's choices
# (read when the backend starts, after the weights loaded) included.
@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,raw", [("ONESPARK_INT8_LM_HEAD", "yes-please"), ("ONESPARK_HYBRID_FP8", ""),
                                      ("ONESPARK_TURBOQUANT_BACKEND", "2"), ("ONESPARK_DRAFT_VOCAB", "of"),
                                      ("ONESPARK_DRAFT_INT4", "int4"), ("ONESPARK_ALLOW_ANY_VLLM", "please"),
                                      ("ONESPARK_TQ_KERNEL", "CUDA")])
def test_a_malformed_switch_stops_start_up_in_one_line_before_anything_is_registered(name, raw):
    """What vLLM does first in every process (load_general_plugins), with a typo in one switch: one error line that
    names the variable and the accepted values, no traceback inside vLLM, a non-zero exit, nothing installed."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ONESPARK_", "VLLM_PLUGINS"))}
    code = ("from vllm.plugins import load_general_plugins\n"
            "from vllm.model_executor.custom_op import op_registry_oot\n"
            "try:\n    load_general_plugins()\n"
            "finally:\n    print('REGISTERED', sorted(op_registry_oot), flush=True)\n"
            "print('STARTED')")
    r = subprocess.run([sys.executable, "-c", code], env={**base, name: raw, "TORCHDYNAMO_DISABLE": "1"},
                       cwd=HERE.parents[1], capture_output=True, text=True, timeout=280)
    out = r.stdout + r.stderr  # vLLM's log handler writes to stdout
    assert r.returncode != 0 and "STARTED" not in r.stdout, out
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if name in ln]
    assert len(lines) == 1, out
    values = ("is not one of its values: use auto (the default), triton or cuda" if name == "ONESPARK_TQ_KERNEL"
              else "is not a switch value: use 1 or 0 (also true/false, on/off, yes/no)")
    assert f"{name}={raw!r} {values}" in lines[0], lines[0]
    assert "REGISTERED []" in r.stdout, "a malformed switch, yet something was registered"


# -- fresh-process scenarios --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_ckpt(synth_hybrid_root):
    return synth_hybrid_root / "hy"


SCENARIOS = {  # name -> (environment, fake vLLM version)
    "default": ({}, None),
    "plugins-empty": ({"VLLM_PLUGINS": ""}, None),
    "head-off": ({"ONESPARK_INT8_LM_HEAD": "0"}, None),
    "fp8-off": ({"ONESPARK_HYBRID_FP8": "0"}, None),
    "tq-off": ({"ONESPARK_TURBOQUANT_BACKEND": "0"}, None),
    "wrong-version": ({}, "0.20.0"),
    "wrong-version-allowed": ({"ONESPARK_ALLOW_ANY_VLLM": "1"}, "0.20.0"),
}


@pytest.fixture(scope="module")
def scenarios(hybrid_ckpt):
    """Run every scenario at once (each is a fresh interpreter importing vLLM: ~20 s, mostly waiting)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ONESPARK_", "VLLM_PLUGINS"))}
    base.update({"HF_HUB_OFFLINE": "1", "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    procs = {
        name: subprocess.Popen([sys.executable, str(HERE), str(hybrid_ckpt), version or ""], env={**base, **env},
                               cwd=HERE.parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, (env, version) in SCENARIOS.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=800)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"scenario {name} printed no result (exit {proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}"
        results[name] = json.loads(lines[-1][len("RESULT "):]) | {"log": err + out}
    return results


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_default_activates_both_through_the_entry_point(scenarios):
    r = scenarios["default"]
    assert r["error"] is None, r["log"][-3000:]
    assert r["lm_head_oot"] == "onespark.patches.lm_head.OnesparkParallelLMHead"
    assert r["hybrid_registered"] and r["quantization"] == "onespark_hybrid"
    assert r["register_again"] == ALL  # idempotent: vLLM calls it per process
    assert r["custom_backend"] == "onespark.patches.turboquant_backend.TurboQuantBackend"
    assert r["draft_head_wrapped"] is True
    assert f"onespark plugin active on vLLM {_track()}: hybrid-fp8, int8-lm-head, turboquant-backend, draft-vocab" \
        in r["log"]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_plugins_empty_means_nothing_of_ours(scenarios, hybrid_ckpt):
    r = scenarios["plugins-empty"]
    assert r["error"] is None, r["log"][-3000:]
    assert r["lm_head_oot"] is None and not r["hybrid_registered"] and r["custom_backend"] is None
    assert r["draft_head_wrapped"] is False
    assert r["quantization"] == "inc", "without the plugin the hybrid checkpoint must load as stock INC"
    assert "onespark" not in r["log"].replace(str(hybrid_ckpt), "")


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,off,gone", [("head-off", "ONESPARK_INT8_LM_HEAD", "int8-lm-head"),
                                           ("fp8-off", "ONESPARK_HYBRID_FP8", "hybrid-fp8"),
                                           ("tq-off", "ONESPARK_TURBOQUANT_BACKEND", "turboquant-backend")])
def test_each_technique_switches_off_alone(scenarios, name, off, gone):
    r = scenarios[name]
    assert r["error"] is None, r["log"][-3000:]
    assert r["register_again"] == [t for t in ALL if t != gone]
    assert (r["lm_head_oot"] is not None) is (gone != "int8-lm-head")
    assert r["hybrid_registered"] is (gone != "hybrid-fp8")
    assert (r["custom_backend"] is not None) is (gone != "turboquant-backend")
    assert r["quantization"] == ("onespark_hybrid" if gone != "hybrid-fp8" else "inc")
    assert f"off: {gone} ({off}=0)" in r["log"]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_wrong_vllm_version_is_refused_by_name_unless_overridden(scenarios):
    r = scenarios["wrong-version"]
    assert r["error"] is not None, "a vLLM 0.20.0 was accepted"
    assert "installed vLLM is 0.20.0" in r["error"] and "tested for vLLM 0.19.1 or 0.32.0" in r["error"]
    assert "vllm==0.32.0 (the default track) or vllm==0.19.1" in r["error"]
    assert "ONESPARK_ALLOW_ANY_VLLM=1" in r["error"]
    assert r["lm_head_oot"] is None and not r["hybrid_registered"] and r["custom_backend"] is None, \
        "refused, yet something was registered"
    r = scenarios["wrong-version-allowed"]
    assert r["error"] is None and r["lm_head_oot"] is not None
    assert "vLLM 0.20.0 is NOT one of the tested 0.19.1 or 0.32.0" in r["log"]


def _scenario_main(ckpt: str, fake_version: str) -> None:
    import vllm

    if fake_version:
        vllm.__version__ = fake_version  # what register() reads; the rest of vLLM is untouched
    import vllm.logger

    if hasattr(vllm.logger, "configure_logging"):  # 0.32.0 configures its loggers when a CLI/engine starts
        from vllm.config.logging import LoggingConfig

        vllm.logger.configure_logging(LoggingConfig())  # what `vllm serve` does first; 0.19.1: at import
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum
    from vllm.v1.spec_decode.eagle import EagleProposer

    error = None
    try:
        load_general_plugins()  # exceptions from register() propagate: vLLM would not start
    except RuntimeError as e:
        error = str(e)
    oot = op_registry_oot.get("ParallelLMHead")
    result = {
        "error": error,
        "lm_head_oot": f"{oot.__module__}.{oot.__qualname__}" if oot else None,
        "hybrid_registered": "onespark_hybrid" in QUANTIZATION_METHODS,
        "custom_backend": _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM),
        "draft_head_wrapped": getattr(EagleProposer._maybe_share_lm_head, "_onespark_draft_head", False),
        "quantization": None,
        "register_again": None,
    }
    if error is None and os.environ.get("VLLM_PLUGINS") != "":
        from onespark.patches import register

        result["register_again"] = register()
    if ckpt and error is None and not fake_version:
        from vllm.config import ModelConfig

        result["quantization"] = ModelConfig(model=ckpt, skip_tokenizer_init=True, max_model_len=512).quantization
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _scenario_main(sys.argv[1], sys.argv[2])
