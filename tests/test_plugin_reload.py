"""vLLM's in-place weight reload with the INT8 LM head on: after `collective_rpc("reload_weights")` (what RL weight
sync and sleep mode's level 2 call) the head holds the new checkpoint's weights, quantized.

vLLM's layerwise reload (0.32.0: vllm/model_executor/model_loader/reload/layerwise.py) runs the quant method's
process_weights_after_loading on a fresh copy of the layer and copies the result into the tensors the layer held
before (so CUDA graphs keep their addresses), leaving out non-persistent buffers it did not load. While the head
registered its INT8 weight and scales as non-persistent buffers, a reload kept the old head and reported success
(found 2026-12-05 with this test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests._compare import int8_rows_reference

pytestmark = [pytest.mark.vllm, pytest.mark.vllm032, pytest.mark.timeout(600)]

# Runs in the engine's worker process (apply_model pickles it by reference: it must live in an importable module).
PROBE = textwrap.dedent("""
    def head(model):
        h = model.lm_head
        return type(h.quant_method).__name__, h.onespark_w_int8.tolist(), h.onespark_w_scale.tolist()  # plain lists
""")

CHILD = textwrap.dedent("""
    import sys
    import torch
    import reload_probe
    from vllm import LLM

    def main(first, second, out):
        # what tests/vllm_server.py gives its CPU servers: a small memory share, no torch.compile
        llm = LLM(model=first, enforce_eager=True, max_model_len=128, max_num_seqs=2, dtype="bfloat16", seed=0,
                  gpu_memory_utilization=0.2)
        before = llm.apply_model(reload_probe.head)[0]
        llm.collective_rpc("reload_weights", kwargs={"weights_path": second})
        after = llm.apply_model(reload_probe.head)[0]
        torch.save({"before": before, "after": after}, out)

    if __name__ == "__main__":  # the engine's processes import this file again
        main(*sys.argv[1:])
""")


def quantized_head(model_dir):
    """The checkpoint file's lm_head.weight, quantized by the documented definition (tests/_compare.py)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return int8_rows_reference(f.get_tensor("lm_head.weight"))


def test_reload_weights_requantizes_the_int8_head(tmp_path, tiny_model_dir):
    import torch

    from onespark.checkpoint.tinymodel import write_tiny_model

    second = write_tiny_model(tmp_path / "second", seed=1)  # same shapes, other weights
    (tmp_path / "reload_probe.py").write_text(PROBE)
    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model sends a function to the worker
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "heads.pt"
    p = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tiny_model_dir), str(second), str(out)],
                       env=env, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    heads = torch.load(out)
    for when, model_dir in (("before", tiny_model_dir), ("after", second)):
        method, q, scale = heads[when][0], torch.tensor(heads[when][1], dtype=torch.int8), torch.tensor(heads[when][2])
        q_ref, scale_ref = quantized_head(model_dir)
        q, scale = q[: len(q_ref)], scale[: len(q_ref)]  # vLLM pads the vocabulary to a multiple of 64 rows
        assert method == "Int8LMHeadMethod", when
        assert torch.equal(q, q_ref), f"{when}: {int((q != q_ref).sum())} of {q.numel()} INT8 weights differ"
        torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0, msg=when)
    assert heads["before"][1] != heads["after"][1]  # the two checkpoints' heads differ
