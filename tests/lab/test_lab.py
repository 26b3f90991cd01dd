"""The lab scripts in lab/ (no part of the distribution; their GPU runs are tests/gpu.sh's) on CPU: each
one starts as the GPU lane starts it (`python lab/X.py`: onespark from the installed package, the harness
as a sibling module) and prints its usage; the harness's result file and relative error."""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

LAB = Path(__file__).resolve().parents[2] / "lab"
sys.path.insert(0, str(LAB))  # the harness is a lab module, imported here as the lab scripts import it
import harness

MODULES = {"harness.py", "turboquant_swap.py", "turboquant_upstream.py"}  # imported by the scripts, not run
SCRIPTS = sorted(p.name for p in LAB.glob("*.py") if p.name not in MODULES)


def test_the_lab_holds_the_benchmarks():
    assert SCRIPTS == ["checkpoint.py", "compile_resources.py", "compressor.py", "draft_head.py", "lm_head.py", "lm_head_glue.py", "turboquant.py",
                       "turboquant_codebooks.py", "turboquant_cta_placement.py", "turboquant_cuda.py", "turboquant_cuda_sass.py",
                       "turboquant_grid_profile.py", "turboquant_quality.py", "turboquant_sass.py", "turboquant_tiles.py",
                       "vllm_step.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_lab_script_starts(script):
    r = subprocess.run([sys.executable, str(LAB / script), "--help"], cwd=LAB.parent, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, f"{script} --help failed:\n{r.stdout}{r.stderr[-3000:]}"


def test_a_timing_run_needs_a_result_file_and_says_so_in_one_line():
    """turboquant_cuda.py writes a result file unless --one (the profiler's single case) is given."""
    r = subprocess.run([sys.executable, str(LAB / "turboquant_cuda.py")], cwd=LAB.parent, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith("--out is required (only --one writes nothing)")


def test_compile_resources_reads_the_lines_the_compile_test_prints():
    """What `pytest -q -s tests/test_kernels_compile.py` prints, progress dots included (a dot leads the first
    line a test prints; missing it once dropped 30 of 79 launches), both line shapes; other lines ignored."""
    import compile_resources

    out = (".sm_121 turboquant_k4v4 _tq_decode_kernel: 127 registers, 0 B spilled, 17664 B shared\n"
           "sm_121 turboquant_k4v4 with the H200 verify tile _tq_decode_kernel: 255 registers, 1072 B spilled, 49664 B shared\n"
           ".sm_90 int8 M<=16 ('swap', 64, 16, 128, 1, 2, 4): _int8_mm_kernel 96 registers, 0 B spilled, 36864 B shared\n"
           "31 passed in 5.07s\n")
    rows = compile_resources.parse(out)
    assert [(r["arch"], r["launch"], r["kernel"], r["registers"], r["spill_bytes_per_thread"]) for r in rows] == [
        ("sm_121", "turboquant_k4v4", "_tq_decode_kernel", 127, 0),
        ("sm_121", "turboquant_k4v4 with the H200 verify tile", "_tq_decode_kernel", 255, 1072),
        ("sm_90", "int8 M<=16 ('swap', 64, 16, 128, 1, 2, 4)", "_int8_mm_kernel", 96, 0)]


def test_result_file_is_written_whole_with_its_header(tmp_path):
    path = tmp_path / "sub" / "r.json"
    res = harness.header("abc123", gpu=False, argv=["--out", "a b"]) | {"rows": [1]}
    assert harness.write_result(path, res) == path
    got = json.loads(path.read_text())
    assert got["git_sha"] == "abc123" and got["schema_version"] == harness.SCHEMA_VERSION and got["rows"] == [1]
    assert got["command"].endswith("--out 'a b'") and got["date"].endswith("Z")
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary file left behind
    assert path.stat().st_mode & 0o777 == 0o644  # not the temporary file's 0600


def test_rel_err_is_frobenius_and_never_a_silent_nan():
    assert harness.rel_err(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0])) == 4 / 3
    assert harness.rel_err(torch.tensor([float("nan"), 1.0]), torch.ones(2)) == float("inf")


def test_upstream_comparisons_exact_reference_is_causal_gqa_attention():
    """turboquant_upstream.exact_attention (what ours and upstream's TurboQuant are both scored against) equals
    torch's SDPA in float64 with GQA and the last T positions' lower-right causal mask."""
    import turboquant_upstream as up
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(0)
    T, L, hq, hkv, d = 3, 37, 8, 2, 16
    q, k, v = (torch.randn(n, h, d, generator=g, dtype=torch.float64) for n, h in ((T, hq), (L, hkv), (L, hkv)))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(4, 1).transpose(0, 1)[None],
        v.repeat_interleave(4, 1).transpose(0, 1)[None], attn_mask=causal_lower_right(T, L), scale=0.25)[0]
    got = up.exact_attention(q, k, v, 0.25)
    assert got.dtype == torch.float64 and torch.allclose(got, ref.transpose(0, 1), atol=1e-12)
    assert not torch.allclose(up.exact_attention(q, k, v, 0.5), got)  # the scale is used


def test_step_bytes_count_the_kv_cache_each_config_reads(tmp_path):
    """vllm_step.py's KV-cache bytes per step, by --kv-cache-dtype, against the 122B's shape done by hand: 12
    attention layers x 2 KV heads x context; 1024 B per token and head for BF16, 264 for onespark's K4V4, 262 for
    upstream's 4-bit preset (no BF16 boundary layers on a hybrid model in vLLM 0.26.0)."""
    import vllm_step

    config = vllm_step.write_config(tmp_path, "122b", fp8_shared=True)
    per_layer_token = {"auto": [1024] * 12, "turboquant_k4v4": [264] * 12, "turboquant_4bit_nc": [262] * 12}
    for dtype, layers in per_layer_token.items():
        for ctx, batch in ((32768, 1), (1024, 4)):
            b = vllm_step.step_bytes(config, True, True, ctx, batch, 1, dtype)
            assert b["kv_cache"] == sum(layers) * 2 * ctx * batch, dtype
    assert vllm_step.step_bytes(config, True, True, 32768, 1, 1)["kv_cache"] == 805306368  # bench/results: BF16
    for name, (_, _, _, extra) in vllm_step.CONFIGS.items():
        assert extra.get("kv_cache_dtype", "auto") in vllm_step.KV_BYTES, name
        if name in vllm_step.PATCHED:
            assert (harness.ROOT / "patches" / vllm_step.PATCHED[name]).is_file(), name


def test_engine_kwargs_build_for_every_config():
    """Every config's LLM(...) arguments build, and a config's own settings win over the lane's defaults: the `tq`
    and `upstream-tq` configs once raised a TypeError (attention_backend given twice) before their engine started,
    found on the H200 (577dce7)."""
    import vllm_step

    for name, (_, _, mtp2, extra) in vllm_step.CONFIGS.items():
        kw = vllm_step.engine_kwargs(name, [1024, 32768], [1, 4])
        assert kw["attention_backend"] == extra.get("attention_backend", "TRITON_ATTN"), name
        assert kw.get("kv_cache_dtype", "auto") == extra.get("kv_cache_dtype", "auto"), name
        assert ("speculative_config" in kw) == mtp2, name
        assert kw["max_model_len"] == 32768 + vllm_step.DECODE_STEPS + 16 and kw["max_num_seqs"] == 4, name
    assert vllm_step.engine_kwargs("tq", [1024], [1])["attention_backend"] == "CUSTOM"


def test_codebook_study_grids_and_roundtrip():
    """lab/turboquant_codebooks.py: its fp8-grid codebooks lie on their grid up to the one scale s (so a
    decoder would read level / s as an e5m2 byte, whose fp16 is that byte shifted left by 8), none beats Lloyd-Max
    (the MSE optimum), and its roundtrip with the Lloyd-Max levels is the shipped codec's (tq.quantize then
    tq.dequantize)."""
    import torch
    import turboquant_codebooks as cb

    from onespark.kernels import turboquant as tq

    lloyd = tq.codebook(4).mse
    for fmt, mbits in ((torch.float8_e5m2, 2), (torch.float8_e4m3fn, 3)):
        levels, mse, s = cb.grid_codebook(4, mbits, steps=8)
        assert len(levels) == 16 and bool((levels.diff() > 0).all()) and torch.equal(levels, -levels.flip(0))
        on_grid = levels / s
        assert torch.equal(on_grid.to(fmt).double(), on_grid), fmt
        assert lloyd <= mse < 1.1 * lloyd, (fmt, mse, lloyd)
    e5m2 = (cb.grid_codebook(4, 2, steps=8)[0] / cb.grid_codebook(4, 2, steps=8)[2]).to(torch.float16)
    assert bool(((e5m2.view(torch.int16) & 0xFF) == 0).all())  # the fp16 of an e5m2 value: its byte << 8
    r = tq.rotation(tq.rotation_seed(3), dtype=torch.float64)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    codes, scale = tq.quantize(x, r, 4)
    shipped = tq.dequantize(codes, scale, r, 4)
    assert torch.allclose(cb.roundtrip(x, r, tq.codebook(4).levels), shipped, rtol=0, atol=1e-6)


def test_step_deadline_names_what_it_did_not_run(tmp_path, monkeypatch, capsys):
    """A --deadline-s too short for any engine (on the H200 a 60 s deadline once started none, silently, and wrote no
    file) writes the result with every (model, config) under not_run and says so on stdout."""
    pytest.importorskip("vllm")
    import vllm_step

    monkeypatch.setattr(vllm_step.harness, "header", lambda *a, **k: {"schema_version": harness.SCHEMA_VERSION})
    out = tmp_path / "step.json"
    assert vllm_step.main(["--out", str(out), "--models", "35b,122b", "--configs", "stock", "--deadline-s", "30"]) == 0
    got = json.loads(out.read_text())
    assert got["runs"] == [] and got["not_run"] == ["35b:stock (deadline)", "122b:stock (deadline)"]
    assert "== 35b stock: not run" in capsys.readouterr().out


def test_patched_vllm_refuses_a_diff_that_does_not_apply(tmp_path):
    """The lab's patched copy of vLLM (vllm_step.py's `tq` config) stops with the diff's name when the diff is not
    for the installed vLLM (here: the GPU lane's 0.26.0 diff against a test venv's vLLM), and leaves the
    installed vLLM as it was."""
    pytest.importorskip("vllm")
    import importlib.util

    installed = Path(next(iter(importlib.util.find_spec("vllm").submodule_search_locations))) / "config" / "cache.py"
    before = installed.read_bytes()
    with pytest.raises(RuntimeError, match=r"turboquant-0\.26\.0\.diff does not apply to the installed vLLM"):
        harness.patched_vllm([harness.ROOT / "patches" / "turboquant-0.26.0.diff"], tmp_path / "tree")
    assert installed.read_bytes() == before
    assert (tmp_path / "tree" / "vllm" / "config" / "cache.py").is_file()  # a copy was patched, not the original


def test_log_facts_read_the_graph_mode_and_the_root_cause_from_real_engine_logs():
    """vllm_step.py's log reader on the H200 engine logs committed at c207b19: our TurboQuant backend's run fell
    back to piecewise graphs; upstream's failed start is named by its ValueError, not vLLM's closing RuntimeError;
    the BF16-KV run kept the requested mode. At e81c79e (full-graph support) the TurboQuant run kept it too."""
    import tarfile

    import vllm_step

    def logs_of(name: str) -> dict[str, str]:
        with tarfile.open(harness.ROOT / "lab" / "results" / name) as tar:
            return {Path(m.name).name: tar.extractfile(m).read().decode(errors="replace")
                    for m in tar.getmembers() if m.isfile()}

    logs = logs_of("vllm_step_h200_35b_tq_c207b19_engine_logs.tar.xz")
    tq = vllm_step.log_facts(logs["vllm_step_h200_35b_tq.log"])
    assert tq == {"cudagraph_mode": "PIECEWISE"}
    up = vllm_step.log_facts(logs["vllm_step_h200_35b_upstream-tq.log"])
    assert up["error_cause"].startswith("ValueError: Unknown TurboQuant cache dtype: 'auto'")
    assert vllm_step.log_facts(logs["vllm_step_h200_35b_product.log"]) == {}
    now = logs_of("vllm_step_h200_35b_tq_engine_logs.tar.xz")
    assert vllm_step.log_facts(now["vllm_step_h200_35b_tq.log"]) == {}
    assert "Capturing CUDA graphs (decode, FULL)" in now["vllm_step_h200_35b_tq.log"]


def test_jit_in_points_names_the_compiles_inside_timed_points():
    """A Triton kernel compiled while a point is timed inflates every step of it (the 122B's first 1K x 4 MTP-2
    point: 18.50 ms against 10.38 beside it, fused_moe_kernel compiled cold). On the committed H200 logs, and on a
    log with the warm-up marker, whose window before it is the warm-up and not judged."""
    import tarfile

    import vllm_step

    with tarfile.open(harness.ROOT / "lab" / "results" / "vllm_step_h200_122b_tq_mtp2_engine_logs.tar.xz") as tar:
        log = tar.extractfile("vllm_step_h200_122b_mtp2.log").read().decode()
    assert vllm_step.log_facts(log)["jit_in_points"] == {
        "ctx 1024 batch 4": ["fused_moe_kernel"], "ctx 32768 batch 1": ["_zero_kv_blocks_kernel"]}
    jit = "(EngineCore pid=1) WARNING [jit_monitor.py:135] Triton kernel JIT compilation during inference: {}. This"
    log = "\n".join([jit.format("warm_kernel"), vllm_step.WARMED, "  35b mtp2 ctx 1024 batch 1: 4.10 ms/step",
                     jit.format("late_a"), jit.format("late_b"), "  35b mtp2 ctx 1024 batch 4: 5.00 ms/step",
                     "  35b mtp2 ctx 32768 batch 1: 6.00 ms/step"])
    assert vllm_step.jit_in_points(log) == {"ctx 1024 batch 4": ["late_a", "late_b"]}
    assert vllm_step.jit_in_points(log.replace(vllm_step.WARMED, "")) == {"ctx 1024 batch 4": ["late_a", "late_b"]}


def test_warm_up_covers_every_batch_size_measured():
    """The child warms up at each batch size a context point will run (a batch's kernels compile outside the
    timed points), and skips the same ones the points skip."""
    import vllm_step

    assert vllm_step.fits(1024, [1, 4]) == [1, 4]
    assert vllm_step.fits(32768, [1, 4]) == [1]
    assert vllm_step.fits(4096, [1, 4, 8]) == [1, 4]


def test_sass_loop_body_is_the_largest_backward_branch():
    """turboquant_sass.py counts the body of the largest loop: from a backward branch's target to the branch,
    predicated opcodes included, forward branches ignored."""
    import turboquant_sass

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   PRMT R2, R3, 0x5140, R4 ;
        /*0020*/              @P0  HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0030*/                   BRA 0x10 ;
        /*0040*/                   LDG.E R5, [R6.64] ;
        /*0050*/                   BRA 0x70 ;
        /*0060*/                   STS [R1], R5 ;
        /*0070*/                   EXIT ;
    """
    assert turboquant_sass.loop_body(sass) == ["PRMT", "HMMA", "BRA"]
    assert turboquant_sass.loop_body(sass.replace("BRA 0x10", "BRA 0x40")) == []  # no backward branch: no loop


def test_ptx_loop_body_is_the_largest_backward_branch():
    """The PTX count takes the same loop: from a backward bra's label to the bra, labels, directives and comments
    left out, predicates stripped from the opcode."""
    import turboquant_sass

    ptx = """
    mov.u32 %r1, 0;
$L__BB0_2:                              // %.lr.ph
    .loc 1 2 3
    prmt.b32 %r2, %r3, %r4, %r5;
    @%p1 mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f1};
    @!%p2 bra $L__BB0_2;
    bra.uni $L__BB0_4;
$L__BB0_4:
    ret;
"""
    body = turboquant_sass.ptx_loop_body(ptx)
    assert [turboquant_sass.ptx_opcode(x) for x in body] == ["prmt.b32", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                                                             "bra"]
    assert turboquant_sass.ptx_loop_body(ptx.replace("bra $L__BB0_2", "bra $L__BB0_4")) == []


def test_sass_counts_the_decoders_against_the_ones_they_replace():
    """Compiled as the host code launches them (no GPU). K4V3 on sm_90: its shipped loop (3-bit PRMT, decoded once,
    128 keys x 4 warps) has no gathers left (global loads: the code rows only) and far fewer instructions per key
    than the gathers at the tile they had, without spilling. Decoded once: on the Spark's sm_121 verify tile each key
    is decoded once (PRMT at the 1,280 per 64 keys 4-bit K and V need: 32,768 values x 10 PRMT per 8 / 32 lanes;
    shipped there since the Spark's code was timed on an H200) where the pure decoders decode it in every warp; on
    sm_90's K4V4 q_len-1 tile, fewer instructions (yet not faster: decode_once). sm_121 rows carry PTX counts and no
    machine-code ones."""
    import turboquant_sass

    from onespark.kernels import turboquant_triton as tt

    real = tt._capability
    try:
        tt._capability = lambda device: (9, 0)
        gathers = turboquant_sass.row("gather", "turboquant_k4v3", 1, 32, 4)
        k4v3 = turboquant_sass.row("shipped", "turboquant_k4v3", 1, None, None)
        h200 = {impl: turboquant_sass.row(impl, "turboquant_k4v4", 1, None, None) for impl in ("pure", "once")}
        tt._capability = lambda device: (12, 1)
        spark = {impl: turboquant_sass.row(impl, "turboquant_k4v4", 3, None, None, arch=121)
                 for impl in ("shipped", "pure", "once")}
    finally:
        tt._capability = real
    assert (k4v3["block_n"], k4v3["num_warps"], k4v3["spill_bytes_per_thread"]) == (128, 4, 0)
    assert k4v3["per_64_keys"]["all"] < 0.7 * gathers["per_64_keys"]["all"]
    assert k4v3["per_64_keys"]["global_load"] < gathers["per_64_keys"]["global_load"] / 4
    assert h200["once"]["per_64_keys"]["all"] < 0.9 * h200["pure"]["per_64_keys"]["all"]
    assert h200["once"]["per_64_keys"]["prmt"] == 1280 < h200["pure"]["per_64_keys"]["prmt"]
    assert all(r["per_64_keys"] is None and r["spill_bytes_per_thread"] == 0 for r in spark.values())
    assert spark["once"]["ptx_per_64_keys"]["prmt"] == 1280 and spark["pure"]["ptx_per_64_keys"]["prmt"] >= 4 * 1280
    assert spark["shipped"]["ptx_per_64_keys"] == spark["once"]["ptx_per_64_keys"]


def test_cuda_sass_counts_the_shipped_loop(tmp_path):
    """lab/turboquant_cuda_sass.py on the shipped header (nvcc of the test venv, no GPU): the loop it finds is
    the 64-key step's, so per warp it holds the step's mma (16 slices x 2 key blocks for Q K^T and 4 x 8 for P V,
    per row tile) and its 32 code words' decode. The shipped kernel masks keys only in a split's last steps and
    rescales the accumulators only when a row's maximum grew, so a step in the middle of a split (`common`, those
    branches compiled out) issues fewer instructions than the whole loop, with the same mma."""
    out = tmp_path / "sass.json"
    r = subprocess.run([sys.executable, str(LAB / "turboquant_cuda_sass.py"), "--out", str(out), "base"],
                       cwd=LAB.parent, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert sorted(row["loop"]) == ["1,2", "1,3", "3,2", "3,3"] and sorted(row["common"]) == sorted(row["loop"])
    for cfg, c in row["loop"].items():
        assert c["mma"] == 64 * int(cfg.split(",")[0]) and c["prmt"] >= 320 and c["all"] > c["mma"] + c["prmt"], (cfg, c)
        mid = row["common"][cfg]
        assert mid["mma"] == c["mma"] and mid["prmt"] >= 320 and mid["all"] < c["all"], (cfg, mid, c)


# each script's own line that names its files by the GPU, and the variable it sets (bench.sh appends to `name`)
NAMING = {"tests/gpu.sh": ("gpu=$(", "gpu", ""), "tests/gpu_vllm/lane.sh": ("gpu=$(", "gpu", ""),
          "tests/gpu_vllm/bench.sh": ("name=${name}_$(", "name", "turboquant_")}


@pytest.mark.parametrize("script", sorted(NAMING))
@pytest.mark.parametrize("device, short", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                           ("NVIDIA GB10", "gb10"), ("NVIDIA L40S", "nvidia_l40s")])
def test_gpu_scripts_name_their_files_as_the_lab_names_the_gpu(tmp_path, script, device, short):
    """The GPU scripts' lines that name their result files (gpu_lane_<gpu>.json, vllm_gpu_lane_<gpu>.json,
    turboquant_<gpu>.json), run against a torch that reports `device`: the lab's short name, so the files and the
    bench files' `gpu` field agree (an H100 once gave `hbm3`; bench.sh once wrote `_h200` on any card)."""
    prefix, var, before = NAMING[script]
    line = next(s for s in (LAB.parent / script).read_text().splitlines() if s.startswith(prefix))
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(f"class cuda:\n    get_device_name = staticmethod(lambda: {device!r})\n")
    body = f'py={sys.executable}\nname=turboquant\n{line}\nprintf %s "${var}"\n'
    r = subprocess.run(["bash", "-c", body], cwd=LAB.parent, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout == before + short


@pytest.mark.parametrize("diff", sorted((LAB / "turboquant_merge_candidates").glob("*.diff")), ids=lambda p: p.stem)
def test_the_merge_candidates_still_apply_to_the_tree(diff, tmp_path):
    """lab/turboquant_merge_candidates/*.diff are decode changes timed (or to time) against the shipped tree
    with turboquant_merge_ab.sh; they must keep applying as the kernels move (refresh or drop one when it does not).
    Checked in a copy of the files each touches, so the checkout is never patched."""
    root = LAB.parent
    touched = sorted({line[6:] for line in diff.read_text().splitlines() if line.startswith("+++ b/")})
    assert any(rel.startswith("kernels/") for rel in touched), touched
    for rel in touched:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((root / rel).read_bytes())
    r = subprocess.run(["git", "apply", "--check", str(diff)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, f"{diff.name} no longer applies: {r.stderr}"


def test_the_merge_ab_script_refuses_bad_input_in_one_line(tmp_path):
    """lab/turboquant_merge_ab.sh (one device call: the shipped merge, then a candidate) says what is wrong
    before anything is installed or a GPU is asked for: no diff, no wheel, a diff name that cannot name a file."""
    script = LAB / "turboquant_merge_ab.sh"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "WORK": str(tmp_path / "work")}

    def run(*args, **extra):
        r = subprocess.run([str(script), *args], capture_output=True, text=True, env={**env, **extra}, timeout=60)
        return r.returncode, r.stderr.strip().splitlines()

    rc, err = run()
    assert rc == 2 and not err
    rc, err = run(str(tmp_path / "none.diff"), ONESPARK_WHEEL="x.whl")
    assert rc == 2 and err == [f"turboquant_merge_ab.sh: no diff file '{tmp_path / 'none.diff'}' (a candidate "
                               "under lab/turboquant_merge_candidates/)"], err
    diff = tmp_path / "cand.diff"
    diff.write_text("--- a/kernels/turboquant_triton.py\n+++ b/kernels/turboquant_triton.py\n")
    rc, err = run(str(diff))
    assert rc != 0 and len(err) == 1 and "set ONESPARK_WHEEL" in err[0], err
    rc, err = run(str(diff), ONESPARK_WHEEL=str(tmp_path / "none.whl"))
    assert rc == 2 and err == [f"turboquant_merge_ab.sh: ONESPARK_WHEEL: no file '{tmp_path / 'none.whl'}' (build it: "
                               "python3 -m pip wheel --no-deps -w DIR .)"], err
    bad, wheel = tmp_path / "a b.diff", tmp_path / "x.whl"
    bad.write_text(diff.read_text())
    wheel.write_bytes(b"")
    rc, err = run(str(bad), ONESPARK_WHEEL=str(wheel))
    assert rc == 2 and err == ["turboquant_merge_ab.sh: name the diff [A-Za-z0-9_-].diff, got 'a b'"], err
    assert not (tmp_path / "work").exists()  # nothing prepared


def test_the_session_script_refuses_bad_input_in_one_line(tmp_path):
    """tests/gpu_vllm/session.sh (one device call of a GPU session) says what is wrong before it asks the GPU
    anything or stashes a piece: a mode it has not, a SHA that is not one, no OUT, no wheel."""
    script = Path(__file__).resolve().parents[1] / "gpu_vllm" / "session.sh"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}

    def run(*args, **extra):
        r = subprocess.run([str(script), *args], capture_output=True, text=True, env={**env, **extra}, timeout=60)
        return r.returncode, r.stderr.strip().splitlines(), r.stdout

    rc, err, out = run()
    assert rc == 2 and not err and "lane SHA" in out
    rc, err, _ = run("profile", "abc1234")
    assert rc == 2 and err == ["tests/gpu_vllm/session.sh: mode must be lane, stash, bench, ab or cuda, got 'profile'"]
    rc, err, _ = run("lane", "--rm")
    assert rc == 2 and err == ["tests/gpu_vllm/session.sh: SHA must be 7-40 hex digits, got '--rm'"], err
    rc, err, _ = run("lane", "abc1234", OUT="")
    assert rc != 0 and len(err) == 1 and "set OUT" in err[0], err
    rc, err, _ = run("cuda", "abc1234", WHEEL=str(tmp_path / "none.whl"))
    assert rc == 2 and err == [f"tests/gpu_vllm/session.sh: no wheel at {tmp_path / 'none.whl'} (python3 -m pip wheel "
                               "--no-deps -w .gpu-vllm .)"], err
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_merge_ab_script_times_a_candidate_that_touches_only_kernels(tmp_path):
    """The A/B script's prepare half on a candidate that leaves lab/ alone (as splits8.diff did: kernels/
    only): the candidate tree gets the lab's modules, the candidate's wheel copy its patched kernel, the shipped
    copy none of it, and one table comes out. python3 is a stand-in (pip, the GPU's name, each bench's JSON) that
    hands the table to the real interpreter; the 2026-12-05 device call stopped at the lab copy here."""
    script, diff = LAB / "turboquant_merge_ab.sh", tmp_path / "kernelonly.diff"
    shipped = (LAB.parent / "kernels" / "turboquant_cuda.py").read_text().splitlines(keepends=True)
    marker = "# kernel-only candidate\n"
    diff.write_text("".join(difflib.unified_diff(shipped, [marker] + shipped, "a/kernels/turboquant_cuda.py",
                                                 "b/kernels/turboquant_cuda.py")))
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(f"""#!/bin/bash
if [[ $1 == -m ]]; then for a; do [[ $prev == --target ]] && mkdir -p "$a/onespark/kernels"; prev=$a; done; exit 0; fi
if [[ $1 == -c ]]; then echo fake; exit 0; fi
if [[ $1 == - ]]; then exec {sys.executable} "$@"; fi
echo '{{"rows": [{{"depth": 32768, "batch": 1, "q_len": 3, "fa_bf16_folded_ms": 0.06, "triton_ms": 0.05, "cuda_ms": 0.057,
  "triton_served_grid_ms": 0.054, "cuda_served_grid_ms": 0.06}}]}}' >"$3"
echo "errors: []"
""")
    fake.chmod(0o755)
    work = tmp_path / "work"
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "OUT": str(tmp_path), "WORK": str(work),
           "ONESPARK_WHEEL": str(script), "ONESPARK_CUDA_BUILD": str(tmp_path / "build")}
    r = subprocess.run([str(script), str(diff)], capture_output=True, text=True, env=env, timeout=60,
                       cwd=LAB.parent)
    assert r.returncode == 0, r.stderr
    assert (work / "tree_kernelonly" / "lab" / "harness.py").is_file()
    cand = (work / "site_kernelonly" / "onespark" / "kernels" / "turboquant_cuda.py").read_text()
    assert cand == marker + "".join(shipped)
    assert not (work / "site_shipped" / "onespark" / "kernels" / "turboquant_cuda.py").exists()
    assert r.stdout.splitlines()[-1].split() == ["32768", "1", "3", "60.0", "0.833", "0.833", "0.950", "0.950",
                                                 "grid:", "0.900", "0.900", "1.000", "1.000"]


def test_targets_read_24s_cases_off_the_decode_rows(capsys):
    """The decode table's verdict for #24: K4V4 at depth >= 32K by the kernel that serves on the GPU
    (ONESPARK_TQ_KERNEL=auto: CUDA at verify steps on mma.sync-only GPUs and at every step on sm_90, Triton
    elsewhere), and every other preset's GB/s against K4V4's at the same case. 8K rows are not targets; one slow case fails the whole."""
    import turboquant

    def row(preset, depth, T, tq_ms, cuda_ms=None, gbps=100.0):
        r = dict(preset=preset, depth=depth, q_len=T, batch=1, tq_ms=tq_ms, fa_bf16_folded_ms=0.1, tq_gbps=gbps)
        return r | ({"cuda_ms": cuda_ms} if cuda_ms else {})

    rows = [row("turboquant_k4v4", 8192, 1, 0.5), row("turboquant_k4v4", 32768, 1, 0.05, 0.07),
            row("turboquant_k4v4", 32768, 3, 0.08, 0.055) | {"served_grid_ms": 0.066}, row("turboquant_k4v3", 32768, 1, 0.05, gbps=101.0),
            row("turboquant_k4v3", 32768, 3, 0.05, gbps=99.0), row("turboquant_k8v4", 8192, 1, 0.05, gbps=1.0)]
    other, hopper, spark = (turboquant.targets(rows, cap) for cap in ((10, 0), (9, 0), (12, 1)))
    assert [(c["depth"], c["q_len"]) for c in other["decode"]] == [(32768, 1), (32768, 3)]
    assert [(c["served"], round(c["served_over_fold"], 2), c["best"], c["met"]) for c in other["decode"]] == [
        ("triton", 0.5, "triton", True), ("triton", 0.8, "cuda", False)]
    assert [(c["served"], round(c["served_over_fold"], 2), c["best"], c["met"]) for c in hopper["decode"]] == [
        ("cuda", 0.7, "triton", False), ("cuda", 0.55, "cuda", True)]
    assert [(c["served"], round(c["served_over_fold"], 2), c["met"]) for c in spark["decode"]] == [
        ("triton", 0.5, True), ("cuda", 0.55, True)]
    # a server's grid beside it, out of the verdict: the row's own time where none was taken
    assert [round(c["served_grid_over_fold"], 2) for c in spark["decode"]] == [0.5, 0.66]
    assert [(c["preset"], c["q_len"], c["met"]) for c in spark["per_byte"]] == [("turboquant_k4v3", 1, True),
                                                                                 ("turboquant_k4v3", 3, False)]
    assert not spark["met"]  # the K4V3 verify case is slower per byte
    assert turboquant.targets(rows[:3], (12, 1))["met"] and not turboquant.targets([], (9, 0))["met"]
    turboquant.print_targets(spark)
    out = capsys.readouterr().out
    assert "not met" in out and "turboquant_k4v3 32768 T=3 B=1 99 < 100 GB/s" in out
