"""Which quant method vLLM (0.19.1 and 0.32.0) gives each layer of a generated hybrid checkpoint, plugin active.

Generated with the real tools (`onespark synth` int4 + fp8, `onespark hybrid`), built by vLLM's own code
(EngineArgs -> VllmConfig -> initialize_model, the MTP draft too, as the EAGLE/MTP proposer builds it) in a
fresh process (this file run as a script: the probe at the bottom). The expected format of every layer
comes independently from the checkpoint's safetensors headers: `weight` F8_E4M3 + `weight_scale_inv` =
FP8, `qweight` = INT4, a 16-bit `weight` = unquantized.

No forward pass through the model: vLLM 0.19.1 has no CPU path for INC INT4 layers. Two test-only
adjustments make *construction* possible on CPU, and are confined to the probe process: INCConfig's
platform check is told "not CPU" (its CPU branch refuses every INT4 layer), and the Marlin MoE workspace
(a CUDA buffer sized by SM count) is an empty tensor. Everything our plugin decides runs unmodified.
On vLLM 0.32.0 (the probe's own seam picks the modules) the platform check sits in INC's WNA16 scheme (its
CPU branch makes every INT4 MoE layer unquantized), and vLLM picks GEMM kernels while it constructs a layer:
none exists on this CPU for block FP8 (they need AMX tiles) or INT4 MoE, so the probe gives those layers no
kernel; the method each layer gets, what this test checks, is still vLLM's and the plugin's choice.

The probe then checks the MTP draft's logits: target head and draft head are loaded with the same weight
and processed in vLLM's order, vLLM's real EagleProposer._maybe_share_lm_head shares them, and the draft's
compute_logits must return the INT8 head's logits (vs a float64 reference) from the target's module.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.vllm032, pytest.mark.timeout(1200)]  # both tracks

HERE = Path(__file__).resolve()
# vLLM's INT4 (AutoRound/GPTQ) methods per track: 0.19.1 GPTQ-Marlin; 0.32.0 INC's own linear method (its
# WNA16 scheme) and AutoGPTQ's MoE method (Marlin underneath).
INT4_METHODS = {"0.19.1": {"GPTQMarlinLinearMethod", "GPTQMarlinMoEMethod"},
                "0.32.0": {"INCLinearMethod", "AutoGPTQMoEMethod"}}
UNQUANTIZED = {"UnquantizedLinearMethod", "UnquantizedFusedMoEMethod"}


def int4_family() -> set[str]:
    from tests.conftest import vllm_track  # lazily: this file also runs as the probe script

    return INT4_METHODS[vllm_track()]


def _cli(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "onespark", *args], capture_output=True, text=True)
    assert r.returncode == 0, f"onespark {' '.join(args)} failed:\n{r.stderr}"


@pytest.fixture(scope="module")
def hybrid_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    _cli("synth", "--format", "fp8", "--out", str(root / "fp8"))
    out = {}
    for mtp in ("bf16", "int4"):
        _cli("synth", "--format", "int4", "--mtp-dtype", mtp, "--out", str(root / f"int4-mtp-{mtp}"))
        _cli("hybrid", "--int4", str(root / f"int4-mtp-{mtp}"), "--fp8", str(root / "fp8"),
             "--out", str(root / f"hybrid-mtp-{mtp}"))
        out[mtp] = root / f"hybrid-mtp-{mtp}"
    return out


@pytest.fixture(scope="module")
def probe(hybrid_checkpoints, tmp_path_factory):
    result = tmp_path_factory.mktemp("probe") / "probe.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_PLUGINS", None)  # the plugin loads through its entry point, as in production
    args = [str(result)] + [f"{k}={v}" for k, v in hybrid_checkpoints.items()]
    r = subprocess.run([sys.executable, str(HERE), *args], capture_output=True, text=True, env=env,
                       cwd=HERE.parents[1], timeout=1100)
    assert r.returncode == 0, f"probe failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(result.read_text()), r.stdout + r.stderr


# -- the independent reference: what the files hold -------------------------------------------------


def tensor_dtypes(ckpt: Path) -> dict[str, str]:
    out = {}
    for f in ckpt.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    return out


def stored_format(dtypes: dict[str, str], names: list[str]) -> str | None:
    """fp8 / int4 / 16bit for HF module names (all must agree), None if the checkpoint has none of them."""
    kinds = set()
    for n in names:
        if dtypes.get(f"{n}.weight") == "F8_E4M3" and f"{n}.weight_scale_inv" in dtypes:
            kinds.add("fp8")
        elif f"{n}.qweight" in dtypes or f"{n}.0.gate_proj.qweight" in dtypes:  # linear / fused experts
            kinds.add("int4")
        elif dtypes.get(f"{n}.weight") in ("BF16", "F16", "F32") or dtypes.get(f"{n}.0.gate_proj.weight") == "BF16":
            kinds.add("16bit")
        else:
            return None
    assert len(kinds) == 1, f"{names} are stored in mixed formats {kinds}"
    return kinds.pop()


def hf_names(prefix: str, packed: dict[str, list[str]]) -> list[str]:
    hf = "model.language_model." + prefix[len("language_model.model."):] if prefix.startswith("language_model.model.") else prefix
    head, _, last = hf.rpartition(".")
    return [f"{head}.{s}" for s in packed[last]] if last in packed else [hf]




@pytest.mark.parametrize("mtp", ["bf16", "int4"])
def test_each_layer_gets_the_method_its_stored_format_needs(probe, hybrid_checkpoints, mtp):
    got, log = probe
    run = got[mtp]
    assert run["quantization"] == "onespark_hybrid", f"hybrid checkpoint not selected:\n{log[-3000:]}"
    dtypes = tensor_dtypes(hybrid_checkpoints[mtp])
    packed = run["packed_modules_mapping"]
    checked = {"fp8": 0, "int4": 0, "16bit": 0}
    expected = {"fp8": {"Fp8LinearMethod"}, "int4": int4_family(), "16bit": UNQUANTIZED}
    wrong = []
    for part in ("target", "draft"):
        for prefix, method in run[part].items():
            fmt = stored_format(dtypes, hf_names(prefix, packed))
            if fmt is None:
                continue  # a layer with no tensors in this checkpoint (vision tower of a text-only synth)
            checked[fmt] += 1
            if method not in expected[fmt]:
                wrong.append(f"{part} {prefix}: stored {fmt}, vLLM got {method}")
    assert not wrong, "\n".join(wrong)
    layers = json.loads((hybrid_checkpoints[mtp] / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert checked["fp8"] == 2 * layers  # gate_up_proj (merged) + down_proj of every shared expert
    assert checked["int4"] > 0 and checked["16bit"] > 0
    mtp_methods = {m for p, m in run["draft"].items() if p.startswith("mtp.layers.")}
    if mtp == "int4":  # the checkpoint marks the MTP layer INT4 (its routers and gates stay 16-bit)
        assert mtp_methods & int4_family(), mtp_methods
    else:  # the 122B release: the whole MTP head is 16-bit, whatever INC's defaults would say
        assert mtp_methods <= UNQUANTIZED, mtp_methods
    assert any(p.startswith("mtp.") for p in run["draft"]), "the MTP draft was not built"


def test_lm_heads_are_int8_and_the_draft_shares_the_targets(probe):
    got, _ = probe
    run = got["bf16"]
    assert run["heads"] == {"target": "Int8LMHeadMethod", "draft": "Int8LMHeadMethod"}
    s = run["share"]
    assert s["draft_head_is_target_head"] and s["mtp_shared_head_ok"]
    assert s["target_weight_numel"] == 0, "the BF16 weight was not freed"
    assert s["bytes_freed"] == s["vocab_padded"] * s["hidden"] * 2
    # The draft's logits are the INT8 head's: equal to the float64 INT8 reference up to bf16 output
    # rounding (2^-8 relative), and close to, but not identical with, the BF16 head's.
    assert s["max_rel_err_vs_int8_ref"] <= 2**-8
    assert 0 < s["max_abs_diff_vs_bf16_head"] <= 0.05 * s["max_abs_logit"]
    assert s["top1_agree_vs_bf16_head"] == 1.0


# -- the probe: runs in its own process ---------------------------------------------------------------


def _probe_main(out_path: str, ckpts: dict[str, str]) -> None:
    import types

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.utils import initialize_model

    from onespark.patches._compat import track

    # The probe's own version seam (test-only; the plugin's are in patches/_compat.py): the MoE layer class,
    # the module whose platform check refuses INT4 on CPU, and the Marlin workspace maker.
    if track() == "0.19.1":
        from vllm.model_executor.layers.fused_moe import FusedMoE as MoELayer
        from vllm.model_executor.layers.quantization import gptq_marlin as marlin_home
        from vllm.model_executor.layers.quantization import inc as inc_module
    else:  # 0.32.0: INC is a package; its INT4 scheme decides CPU vs GPU (CPU: unquantized MoE only)
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts as MoELayer
        from vllm.model_executor.layers.quantization.inc.schemes import inc_wna16_scheme as inc_module
        from vllm.model_executor.layers.quantization.utils import marlin_utils as marlin_home
    from vllm.plugins import load_general_plugins
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.spec_decode.eagle import EagleProposer

    from onespark.kernels.lm_head import int8_gemv_ref

    load_general_plugins()  # what vLLM does in each process: finds onespark through its entry point

    class NotCpu:  # see the module docstring
        def __init__(self, platform):
            self._platform = platform

        def is_cpu(self):
            return False

        def is_xpu(self):
            return False

        def __getattr__(self, name):
            return getattr(self._platform, name)

    inc_module.current_platform = NotCpu(inc_module.current_platform)
    marlin_home.marlin_make_workspace_new = lambda device, max_blocks_per_sm=1: torch.zeros(0, dtype=torch.int)
    if track() == "0.32.0":
        # 0.32.0 picks the FP8 GEMM kernel while constructing the layer, and on a CPU without AMX tiles it has
        # none ("CPUFp8BlockScaledMMKernel requires AMX tile support"): construction only, so no kernel.
        from vllm.model_executor.layers.quantization import fp8 as fp8_module

        fp8_module.init_fp8_linear_kernel = lambda **kwargs: None
        # ... and the INT4 MoE kernel too ("No WNA16 MoE backend supports the deployment configuration")
        from vllm.model_executor.layers.quantization import auto_gptq

        auto_gptq.select_wna16_moe_backend = lambda *args, **kwargs: (None, None)

    def methods(model):
        table = {}
        for _, m in model.named_modules():
            qm = getattr(m, "quant_method", None)
            if isinstance(m, LinearBase):
                table[m.prefix] = type(qm).__name__
            elif isinstance(m, MoELayer):
                table[m.layer_name] = type(getattr(m, "base_quant_method", qm)).__name__
        return table

    result, dist_ready = {}, False
    for label, ckpt in ckpts.items():
        vc = EngineArgs(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                        max_model_len=512, load_format="dummy",
                        speculative_config={"method": "mtp", "num_speculative_tokens": 2}).create_engine_config()
        with set_current_vllm_config(vc):
            if not dist_ready:
                import socket

                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{port}")
                initialize_model_parallel(1, 1)
                dist_ready = True
            with set_default_torch_dtype(vc.model_config.dtype):  # as BaseModelLoader.load_model does
                target = initialize_model(vc)
                draft = initialize_model(vc, model_config=vc.speculative_config.draft_model_config)
        lm = target.get_language_model()
        run = {
            "quantization": vc.model_config.quantization,
            "packed_modules_mapping": dict(type(target).packed_modules_mapping),
            "target": methods(target),
            "draft": methods(draft),
            "heads": {"target": type(lm.lm_head.quant_method).__name__,
                      "draft": type(draft.lm_head.quant_method).__name__},
        }
        if label == "bf16":
            # vLLM's order: target loaded + processed, draft loaded + processed, then the proposer shares.
            torch.manual_seed(0)
            head = lm.lm_head
            vocab, hidden = head.org_vocab_size, head.embedding_dim
            w = torch.zeros_like(head.weight)
            w[:vocab] = (torch.randn(vocab, hidden) * 0.05).to(w.dtype)
            for h in (head, draft.lm_head):
                h.weight.data.copy_(w)
                h.quant_method.process_weights_after_loading(h)
            proposer = types.SimpleNamespace(model=draft, use_local_argmax_reduction=False, vllm_config=vc)
            EagleProposer._maybe_share_lm_head(proposer, lm)
            x = torch.randn(7, hidden).to(torch.bfloat16)
            with set_current_vllm_config(vc):
                logits = draft.compute_logits(x).float()
            ref = int8_gemv_ref(x, head.onespark_w_int8, head.onespark_w_scale,
                                acc_dtype=torch.float64, out_dtype=torch.float64)[:, :vocab]
            bf16 = torch.nn.functional.linear(x.double(), w[:vocab].double())
            layers = draft.model.layers.values() if hasattr(draft.model.layers, "values") else draft.model.layers
            run["share"] = {
                "draft_head_is_target_head": draft.lm_head is head,
                "mtp_shared_head_ok": all(getattr(getattr(layer, "shared_head", None), "head", head) is head
                                          for layer in layers),
                "target_weight_numel": head.weight.numel(),
                "bytes_freed": head.onespark_bytes_freed,
                "vocab_padded": head.num_embeddings_padded,
                "hidden": hidden,
                "max_rel_err_vs_int8_ref": float(((logits - ref).abs() / ref.abs().clamp_min(1e-3)).max()),
                "max_abs_diff_vs_bf16_head": float((logits - bf16).abs().max()),
                "max_abs_logit": float(bf16.abs().max()),
                "top1_agree_vs_bf16_head": float((logits.argmax(-1) == bf16.argmax(-1)).double().mean()),
            }
        result[label] = run
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    _probe_main(sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:]))
