"""The Spark model (bench/spark_model.py, `onespark bench spark-model`): its bytes against the bytes the GPU step
benchmark recorded when it measured, the fit against parameters it must recover, leave-one-out that really leaves
the point out, the result file's schema (and that the committed one is what the model computes), the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from onespark.bench import spark_model as sm

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "spark_model.json"


@pytest.mark.parametrize("setup,gb", [
    # bytes_by_part["total"] of the committed vLLM 0.26.0 step results, as recorded at measurement time
    # (vllm_step_h200_222ae6e.json stock 1K x 1 and 1K x 4, vllm_step_h200.json product 1K x 1 and x 4,
    # vllm_step_h200_35b.json stock and product 1K x 1; 32K: product): an independent count of the same shapes
    pytest.param(sm.Setup(fp8_shared=False, int8_head=False), 6.853, id="122B-stock"),
    pytest.param(sm.Setup(fp8_shared=False, int8_head=False, requests=4), 13.097, id="122B-stock-b4"),
    pytest.param(sm.Setup(), 5.638, id="122B-product"),
    pytest.param(sm.Setup(requests=4), 11.882, id="122B-product-b4"),
    pytest.param(sm.Setup(ctx=32768), 6.418, id="122B-product-32K"),
    pytest.param(sm.Setup("qwen3.5-35b-a3b", fp8_shared=False, int8_head=False), 2.644, id="35B-stock"),
    pytest.param(sm.Setup("qwen3.5-35b-a3b"), 2.011, id="35B-product"),
])
def test_target_bytes_equal_what_the_step_benchmark_recorded(setup, gb):
    assert sm.step_bytes(setup, 1.0)["total"] / 1e9 == pytest.approx(gb, abs=0.0006)


def test_drafter_bytes_follow_its_parts():
    """MTP-2's drafter: two passes of the 16-bit MTP layer and the head; the 32K subset saves exactly two passes
    of (full head - subset head); DFlash reads its published 1.6 GB and the head once."""
    mtp, sub = sm.Setup(drafter="mtp", draft_tokens=2), sm.Setup(drafter="mtp", draft_tokens=2, draft_subset=True)
    h, v = 3072, 248320
    full_head, subset_head = v * h + 4 * v, sm.DRAFT_VOCAB_ROWS * (h + 4) + 4 * sm.DRAFT_VOCAB_ROWS
    assert sm.drafter_bytes(mtp, 1.0) - sm.drafter_bytes(sub, 1.0) == pytest.approx(2 * (full_head - subset_head))
    assert sm.drafter_bytes(sm.Setup(drafter="dflash", draft_tokens=12), 1.0) == pytest.approx(1.6e9 + full_head)
    int4 = sm.Setup(drafter="mtp", draft_tokens=2, mtp_expert_bits=4)
    assert sm.drafter_bytes(int4, 1.0) < sm.drafter_bytes(mtp, 1.0)


def test_distinct_experts_independent_and_shared():
    e, k = 256, 8
    assert sm.distinct_experts(e, k, 1, 13, 1.0) == pytest.approx(e * (1 - (1 - k / e) ** 13))
    assert sm.distinct_experts(e, k, 1, 13, 0.0) == pytest.approx(e * (1 - (1 - k / e)))  # one token's worth
    assert sm.distinct_experts(e, k, 4, 1, 0.3) == pytest.approx(sm.distinct_experts(e, k, 4, 1, 1.0))


def test_dflash_tokens_reproduce_the_published_length_and_grow_with_n():
    assert sm.dflash_tokens(12) == pytest.approx(6.4, abs=1e-6)
    lengths = [sm.dflash_tokens(n) for n in (2, 4, 6, 8, 10, 12)]
    assert lengths == sorted(lengths) and all(1 < t <= n + 1 for t, n in zip(lengths, (2, 4, 6, 8, 10, 12)))


@pytest.mark.parametrize("truth", [sm.Fit(190e9, 0.8, 0.4), sm.Fit(240e9, 0.2, 0.9), sm.Fit(150e9, 1.5, 0.15)],
                         ids=["bw190-k0.8-rho0.4", "bw240-k0.2-rho0.9", "bw150-k1.5-rho0.15"])
def test_fit_recovers_the_parameters_that_generated_the_points(truth):
    """Points made by the model itself from known parameters (the published setups, their GPU times beyond
    bytes): the fit must give those parameters back (rho to the refinement grid's 0.0005)."""
    obs = []
    for p in sm.POINTS:
        x = sm.beyond_ms(sm.STEPS, p.setup)[0]
        obs.append((p.setup, x, sm.spark_ms(truth, p.setup, x)))
    got = sm.fit_points(obs)
    assert got.rho == pytest.approx(truth.rho, abs=0.0006)
    assert got.bw == pytest.approx(truth.bw, rel=0.005)
    assert got.k == pytest.approx(truth.k, rel=0.01)


def test_leave_one_out_does_not_see_the_point_it_estimates(monkeypatch):
    """Changing one published figure moves its in-sample estimate, never its leave-one-out estimate, and it
    moves the other points' leave-one-out estimates (they are fitted with it)."""
    base = sm.calibrate(sm.STEPS)["rows"]
    i = next(n for n, p in enumerate(sm.POINTS) if p.in_fit and p.config.startswith("v2:"))
    changed = list(sm.POINTS)
    changed[i] = dataclasses.replace(changed[i], tok_s=changed[i].tok_s * 1.5)
    monkeypatch.setattr(sm, "POINTS", tuple(changed))
    after = sm.calibrate(sm.STEPS)["rows"]
    assert after[i][2] == pytest.approx(base[i][2], rel=1e-12)
    assert after[i][1] != pytest.approx(base[i][1], rel=1e-4)
    others = [n for n, p in enumerate(sm.POINTS) if p.in_fit and n != i]
    assert any(after[n][2] != pytest.approx(base[n][2], rel=1e-4) for n in others)


CALIBRATION_KEYS = {"source", "config", "context", "published_tok_s", "estimate_tok_s", "loo_estimate_tok_s"}
CONFIG_KEYS = {"config", "context", "gpu", "step_ms_gpu", "gb_per_step", "spark_ms_estimate", "tokens_per_step",
               "tokens_per_step_source", "estimate_tok_s", "band_tok_s"}


def check_schema(r: dict) -> None:
    assert {"calibration", "configurations", "default", "commit", "command", "date"} <= set(r)
    assert r["calibration"] and all(CALIBRATION_KEYS <= set(c) for c in r["calibration"])
    assert r["configurations"] and all(CONFIG_KEYS <= set(c) for c in r["configurations"])
    assert {"config", "estimate_tok_s", "band_tok_s"} <= set(r["default"])
    for c in r["configurations"]:
        assert c["tokens_per_step_source"] and c["band_tok_s"] > 0 and c["spark_ms_estimate"] > 0


def test_the_written_result_has_the_issues_schema(tmp_path, capsys):
    out = tmp_path / "spark_model.json"
    assert sm.cli(str(out), None, "onespark bench spark-model --write X", "abc1234") == 0
    check_schema(json.loads(out.read_text()))
    assert "Calibration" in capsys.readouterr().out


def test_the_committed_result_is_what_the_model_computes():
    """bench/results/spark_model.json: the schema, every published point, and the numbers this code gives
    (a change to the model or its inputs without a fresh result fails here)."""
    committed = json.loads(RESULT.read_text())
    check_schema(committed)
    assert committed["command"].startswith("onespark bench spark-model")
    steps = sm.STEPS + (sm.load_steps(str(ROOT / committed["steps_file"])) if committed.get("steps_file") else ())
    start = sm.load_start(str(ROOT / committed["start_file"])) if committed.get("start_file") else None
    fresh = sm.model(steps, start)
    assert [c["published_tok_s"] for c in committed["calibration"]] == [p.tok_s for p in sm.POINTS]
    for key in ("calibration", "configurations", "default", "fit", "starts", "starts_assume"):
        assert committed[key] == fresh[key], key


def test_cli_prints_both_tables_and_the_default():
    r = subprocess.run([sys.executable, "-m", "onespark", "bench", "spark-model"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    result = sm.model()
    for c in result["calibration"]:
        assert f"{c['published_tok_s']}" in r.stdout and c["config"] in r.stdout
    for c in result["configurations"]:
        assert c["config"] in r.stdout and f"{c['estimate_tok_s']}" in r.stdout
    assert f"Default: {result['default']['config']}: {result['default']['estimate_tok_s']}" in r.stdout


def _start(cold: dict, restart: dict) -> dict:
    return {"gpu": "h100", "device": "NVIDIA H100 80GB HBM3", "git_sha": "abc1234",
            "engines": [{"name": "cold", **cold}, {"name": "restart", **restart}]}


@pytest.mark.parametrize("flag,content,says", [
    ("--steps", None, "cannot read --steps"),
    ("--steps", "{not json", "is not JSON"),
    ("--steps", '{"gpu": "a100", "engines": []}', "not a spark_steps result"),
    ("--steps", '{"gpu": "h100", "engines": [{"name": "cold", "points": []}]}', "measured no point"),
    ("--start", None, "cannot read --start"),
    ("--start", "[1", "is not JSON"),
    ("--start", '{"gpu": "h100"}', "not a spark_steps start result"),
    ("--start", json.dumps(_start({"startup_s": 1.0, "phases": {}}, {"error": "not started: 20 s left"})),
     "restart engine has no start-up time (not started: 20 s left)"),
])
def test_a_bad_input_file_is_one_line_naming_it(tmp_path, flag, content, says):
    path = tmp_path / "input.json"
    if content is not None:
        path.write_text(content)
    r = subprocess.run([sys.executable, "-m", "onespark", "bench", "spark-model", flag, str(path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert says in r.stderr and str(path) in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_verify_sweep_replaces_the_interpolation(tmp_path):
    """A spark_steps result with batch 13 measured: DFlash n=12's target time beyond bytes is that batch's."""
    pts = [{"ctx": 1024, "batch": b, "step_ms": 5.0 + 0.3 * b} for b in range(1, 14)]
    path = tmp_path / "spark_steps_h100.json"
    path.write_text(json.dumps({"gpu": "h100", "git_sha": "abc1234", "engines": [{"name": "cold", "points": pts}]}))
    steps = sm.STEPS + sm.load_steps(str(path))
    x, src = sm.target_beyond_ms(steps, "qwen3.5-122b-a10b", 13, (True, True))
    b13 = sm.step_bytes(sm.Setup(requests=13), 1.0)["total"]
    assert x == pytest.approx(max(5.0 + 0.3 * 13 - 1e3 * b13 / sm.GPU_BW["h100"], 0.0))
    assert "batch 13" in src


def test_start_estimates_read_the_checkpoint_and_scale_the_rest(tmp_path):
    """The Spark's start = 71 GB from the SSD at 3-7 GB/s + the GPU start less its (dummy) weight loading at 0.8-1.5x,
    the high end from the process's wall time (imports included) where the result has it: computed here by hand."""
    path = tmp_path / "spark_start_h100.json"
    path.write_text(json.dumps(_start(
        {"startup_s": 300.0, "phases": {"model_load_s": 10.0, "compile_s": 50.0}},
        {"startup_s": 60.0, "wall_s": 90.0, "phases": {"model_load_s": 10.0, "compile_cache_load_s": 5}})))
    rows = sm.starts(sm.load_start(str(path)))
    assert [r["engine"] for r in rows] == ["cold", "restart"]
    assert rows[0]["spark_estimate_s"] == [round(71 / 7 + 290 * 0.8), round(71 / 3 + 290 * 1.5)]
    assert rows[1]["spark_estimate_s"] == [round(71 / 7 + 50 * 0.8), round(71 / 3 + 80 * 1.5)]
    assert [r["process_wall_s_gpu"] for r in rows] == [300.0, 90.0]
    assert rows[1]["phases_gpu"] == {"model_load_s": 10.0, "compile_cache_load_s": 5.0}
    out = tmp_path / "m.json"
    assert sm.cli(str(out), None, "x", "abc1234", str(path)) == 0
    assert json.loads(out.read_text())["starts"] == rows


def _elf_with_fatbin(entries: list[tuple[int, int, bytes]]) -> bytes:
    """A minimal ELF64: sections null, .nv_fatbin (one fatbin of `entries`: kind, sm, payload), .shstrtab."""
    import struct

    body = b"".join(struct.pack("<HHIQ", kind, 0, 64, len(p)) + bytes(12) + struct.pack("<I", sm) + bytes(32) + p
                    for kind, sm, p in entries)
    fatbin = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fat_off, str_off = 64, 64 + len(fatbin)
    shoff = str_off + len(names)
    head = b"\x7fELF" + bytes(36) + struct.pack("<Q", shoff) + bytes(10) + struct.pack("<HHH", 64, 3, 2)
    head = head.ljust(64, b"\0")
    sh = bytes(64) + struct.pack("<IIQQQQ", 1, 1, 0, 0, fat_off, len(fatbin)).ljust(64, b"\0") \
        + struct.pack("<IIQQQQ", 12, 3, 0, 0, str_off, len(names)).ljust(64, b"\0")
    return head + fatbin + names + sh


def test_pack_zeroes_only_foreign_sass():
    """tests/gpu_vllm/spark_steps.py's pack: SASS for other architectures becomes zeros of the same length;
    sm_90 SASS and every PTX stay byte for byte, so the loader finds what it found before."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu_vllm"))
    import spark_steps

    payloads = [(2, 80, b"\x11" * 40), (2, 90, b"\x22" * 24), (1, 80, b"\x33" * 16), (2, 120, b"\x44" * 8)]
    so = _elf_with_fatbin(payloads)
    out, zeroed = spark_steps.zero_foreign_sass(so)
    assert len(out) == len(so) and zeroed == 48
    seen = [(kind, sm, out[start:start + size]) for kind, sm, start, size in spark_steps.fatbin_entries(out)]
    assert seen == [(2, 80, bytes(40)), (2, 90, b"\x22" * 24), (1, 80, b"\x33" * 16), (2, 120, bytes(8))]
