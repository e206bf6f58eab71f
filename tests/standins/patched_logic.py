"""Inside the cpu image: the logic our series patches change, as vLLM runs it there, each with its variables unset
(vLLM as released) and set. Prints one JSON object of facts for the test to judge:

    python patched_logic.py
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import types
from pathlib import Path

import torch


@contextlib.contextmanager
def replaced(owner, **attributes):
    """Each named attribute of owner replaced while the block runs, then put back."""
    saved = {name: getattr(owner, name) for name in attributes}
    for name, value in attributes.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def variables(name: str, value: str | None):
    """The process's environment variable `name` set to `value` (None: unset) while the block runs, then as it was."""
    saved = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


def card_patch() -> dict:
    """The emulated-card patch as vLLM runs it: the memory snapshot and the platform's device total read the card's
    VLLM_DEVICE_TOTAL_MEMORY, VLLM_FLASH_ATTN_VERSION picks the FlashAttention version, VLLM_GDN_PREFILL_BACKEND the
    GDN prefill kernels on a Hopper GPU (where the additional config names none) and VLLM_FLASHINFER_AUTOTUNE=0 turns
    the Hopper-only autotune off, and VLLM_FLASHINFER_Q_QUANTIZATION=0 keeps FlashInfer's prefill query in the model's
    dtype beside an FP8 KV cache, each only when set."""
    import os

    import vllm.envs as envs
    from vllm.utils import mem_utils
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))  # CUDA-only ops
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    from vllm.platforms import cuda as cuda_platform
    from vllm.v1.attention.backends import fa_utils
    gib = 2**30
    hopper = types.SimpleNamespace(is_cuda=lambda: True, is_device_capability=lambda capability: capability == 90,
                                   is_device_capability_family=lambda family: False, get_cuda_runtime_major=lambda: 13)
    text_config = types.SimpleNamespace(linear_key_head_dim=128)  # the 27B's GDN heads

    def gdn_prefill(additional_config: dict) -> str:
        config = types.SimpleNamespace(additional_config=additional_config,
                                       model_config=types.SimpleNamespace(hf_text_config=text_config))
        with replaced(gdn, current_platform=hopper):
            return gdn._resolve_gdn_prefill_backend(config)[1]
    def flashinfer_prefill_query() -> str:
        """The dtype of FlashInfer's prefill query beside an FP8 KV cache on a Hopper GPU (FP8 feeds its FA3 kernel
        only; a card before Hopper keeps the model's dtype and runs FA2)."""
        builder = flashinfer_backend.FlashInferMetadataBuilder
        config = types.SimpleNamespace(attention_config=types.SimpleNamespace(disable_flashinfer_q_quantization=False))
        state = types.SimpleNamespace(vllm_config=config, cache_dtype="fp8_e4m3",
                                      model_config=types.SimpleNamespace(dtype=torch.bfloat16))
        with replaced(flashinfer_backend, current_platform=hopper):
            return str(builder.get_q_data_type(state, is_prefill=True)).removeprefix("torch.")
    flashinfer_backend = flashinfer_on_cpu()
    mem_utils.current_platform.is_integrated_gpu = lambda index=None: False
    torch.cuda.get_device_properties = lambda device=0: types.SimpleNamespace(total_memory=139 * gib)
    sys.modules["vllm.vllm_flash_attn"] = types.ModuleType("vllm.vllm_flash_attn")
    interface = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    # setattr: a module made here has no attributes mypy knows of, so an assignment would not type-check
    setattr(interface, "is_fa_version_supported", lambda version: True)  # noqa: B010
    setattr(interface, "fa_version_unsupported_reason", lambda version: None)  # noqa: B010
    sys.modules["vllm.vllm_flash_attn.flash_attn_interface"] = interface
    fa_utils.current_platform = types.SimpleNamespace(is_xpu=lambda: False, is_rocm=lambda: False,
                                                      get_device_capability=lambda: types.SimpleNamespace(major=9, minor=0))
    out = {}
    card = {"VLLM_DEVICE_TOTAL_MEMORY": str(round(23.56 * gib)), "VLLM_FLASH_ATTN_VERSION": "2",
            "VLLM_GDN_PREFILL_BACKEND": "triton", "VLLM_FLASHINFER_AUTOTUNE": "0", "VLLM_FLASHINFER_Q_QUANTIZATION": "0"}
    with replaced(torch.accelerator, memory_stats=lambda device=None: {}, memory_reserved=lambda device=None: 0,
                  get_memory_info=lambda device=None: (23 * gib + gib // 2, 139 * gib + gib * 4 // 5)):  # MPS: free capped
        for name, env in (("unset", {}), ("card", card)):
            for key in card:  # each case starts from none of the card's variables
                os.environ.pop(key, None)
            os.environ.update(env)
            if hasattr(envs, "disable_envs_cache"):
                envs.disable_envs_cache()
            snap = mem_utils.MemorySnapshot(device=torch.device("cpu"), auto_measure=False)
            snap.measure()
            out[name] = {"total": snap.total_memory, "free": snap.free_memory, "cuda_memory": snap.cuda_memory,
                         "platform_total": cuda_platform.NonNvmlCudaPlatform.get_device_total_memory(),
                         "fa_version": fa_utils.get_flash_attn_version(), "autotune": envs.VLLM_FLASHINFER_AUTOTUNE,
                         "gdn_prefill": gdn_prefill({}),
                         "gdn_prefill_configured": gdn_prefill({"gdn_prefill_backend": "flashinfer"}),
                         "flashinfer_prefill_query": flashinfer_prefill_query()}
    return out


def flashinfer_on_cpu() -> types.ModuleType:
    """vLLM's FlashInfer attention backend, imported where FlashInfer is not installed (the cpu image): the names it
    imports from FlashInfer stand empty, since only its choice of the query's dtype runs here."""
    names = {"flashinfer": ("BatchAttentionWithAttentionSinkWrapper", "BatchDecodeWithPagedKVCacheWrapper",
                            "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
                            "MultiLevelCascadeAttentionWrapper", "get_seq_lens"),
             "flashinfer.decode": ("fast_decode_plan", "trtllm_batch_decode_with_kv_cache"),
             "flashinfer.prefill": ("trtllm_batch_context_with_kv_cache",), "flashinfer.utils": ("FP4Tensor",)}
    for module_name, attributes in names.items():
        module = sys.modules.setdefault(module_name, types.ModuleType(module_name))
        for attribute in attributes:
            setattr(module, attribute, type(attribute, (), {}))
    from vllm.v1.attention.backends import flashinfer as flashinfer_backend
    return flashinfer_backend


def marlin_include() -> dict:
    """marlin-int8-include.patch: Marlin's int8 activations only for the layers VLLM_MARLIN_INT8_INCLUDE_RE names,
    never the lm_head or an MTP head, and the rule among the compile cache's factors."""
    from vllm import envs
    from vllm.model_executor.layers.quantization.utils import marlin_utils
    layers = ("model.language_model.layers.0.mlp.gate_up_proj", "model.language_model.layers.3.self_attn.qkv_proj",
              "model.language_model.layers.0.linear_attn.in_proj_qkvz", "lm_head", "mtp.fc",
              "mtp.layers.0.mlp.gate_up_proj")
    out: dict = {}
    for name, env in (("unset", {"VLLM_MARLIN_INPUT_DTYPE": "int8"}),
                      ("mlp", {"VLLM_MARLIN_INPUT_DTYPE": "int8", "VLLM_MARLIN_INT8_INCLUDE_RE": "mlp"}),
                      ("single", {"VLLM_MARLIN_INPUT_DTYPE": "int8",
                                  "VLLM_MARLIN_INT8_INCLUDE_RE": "mlp|linear_attn|self_attn"})):
        os.environ.pop("VLLM_MARLIN_INT8_INCLUDE_RE", None)
        os.environ.update(env)
        out[name] = {layer: str(marlin_utils.get_marlin_input_dtype(layer)) for layer in layers}
        out.setdefault("compile_factor", {})[name] = envs.compile_factors().get("VLLM_MARLIN_INT8_INCLUDE_RE")
    return out


def profile_order() -> dict:
    """profile-warm-peak.patch and kv-bytes-release-scratch.patch: what vLLM's GPU worker does, in order, when it
    sizes the KV cache, with a model runner and a measuring window that record each step instead of running it.
    Profiled (GPU_UTIL): an unmeasured forward before the measured window, unless VLLM_PROFILE_WARMUP=0. A pinned pool
    (kv_cache_memory_bytes): the one forward, then the allocator's cache emptied before the pool."""
    from contextlib import contextmanager

    from vllm.v1.worker import gpu_worker
    steps: list[str] = []

    class Measured(Exception):
        pass

    @contextmanager
    def window(*args, **kwargs):
        steps.append("measured window")
        raise Measured
        yield

    @contextmanager
    def split_limit(max_split_size_mb):
        steps.append("split limit")
        yield

    runner = types.SimpleNamespace(profile_run=lambda **kwargs: steps.append("forward"), model_memory_usage=0)
    out = {}
    with replaced(gpu_worker, memory_profiling=window, maybe_apply_startup_plan=lambda worker: None,
                  reserve_mm_ipc_gpu_memory=lambda size, *args: size), \
            replaced(torch.accelerator, empty_cache=lambda: steps.append("cache emptied")):
        for name, warmup, pinned in (("profiled", None, None), ("profiled_warmup_off", "0", None),
                                     ("pinned", None, 5 << 30)):
            worker = types.SimpleNamespace(
                model_runner=runner, randomize_dummy_inputs=False, _scoped_allocator_max_split=split_limit,
                cache_config=types.SimpleNamespace(kv_cache_memory_bytes=pinned),
                init_snapshot=types.SimpleNamespace(free_memory=20 << 30),
                model_config=types.SimpleNamespace(multimodal_config=None), parallel_config=types.SimpleNamespace())
            steps.clear()
            with variables("VLLM_PROFILE_WARMUP", warmup), contextlib.suppress(Measured):
                gpu_worker.Worker.determine_available_memory(worker)
            out[name] = list(steps)
    return out


def kv_groups() -> dict:
    """kv-group-by-request.patch: the group size vLLM gives the hybrid KV cache of Qwen3.5 with the DFlash2 drafter
    (16 full-attention, 48 GDN, 5 sliding-window layers) and with the MTP head (17 full-attention, 48 GDN), each
    kind needing per request of 65,536 tokens what vLLM 0.31.0 sizes (152 full-attention blocks of 432 tokens, 9 GDN
    blocks with k7 and prefix caching, 15 window blocks): the specs stand in for vLLM's, answering what the grouping
    asks of them."""
    from dataclasses import dataclass

    from vllm.v1.core import kv_cache_utils

    @dataclass(frozen=True)
    class Kind:
        name: str
        blocks: int  # what one request of max_model_len needs
        page_size_bytes: int = 1

        @classmethod
        def merge(cls, specs):
            if any(spec != specs[0] for spec in specs):
                raise ValueError("another kind")
            return specs[0]

        def max_memory_usage_bytes(self, vllm_config) -> int:
            return self.blocks * self.page_size_bytes

    full, gdn, window = Kind("full", 152), Kind("gdn", 9), Kind("window", 15)
    layouts = {"dflash2": {**{f"full.{i}": full for i in range(16)}, **{f"gdn.{i}": gdn for i in range(48)},
                           **{f"drafter.{i}": window for i in range(5)}},
               "mtp": {**{f"full.{i}": full for i in range(17)}, **{f"gdn.{i}": gdn for i in range(48)}}}
    out = {}
    with replaced(kv_cache_utils, create_kv_cache_group_specs=lambda specs, grouped: grouped):
        for setting in (None, "0"):
            with variables("VLLM_KV_GROUP_BY_REQUEST", setting):
                for name, layout in layouts.items():
                    grouped = kv_cache_utils._get_kv_cache_groups_uniform_page_size(layout, types.SimpleNamespace())
                    size = max(len(group) for group in grouped)
                    pages = len(grouped) and sum(size * layout[group[0]].blocks for group in grouped)
                    out[f"{name}{'_released' if setting else ''}"] = {"group_size": size, "groups": len(grouped),
                                                                      "pages_per_request": pages}
    return out


def gdn_accepted_bounds() -> dict:
    """gdn-spec-accepted-bounds.patch: every place a GDN spec-decode kernel of the installed vLLM turns an accepted
    count into an index (`num_accepted... - 1`), and whether it is bounded below (`tl.maximum(..., 0)`). The kernels
    are Triton's, which the cpu image does not carry: their source is what can be read here."""
    import vllm
    root = Path(vllm.__file__).parent
    sites = {}
    for rel in ("third_party/flash_linear_attention/ops/fused_recurrent.py",
                "third_party/flash_linear_attention/ops/fused_sigmoid_gating.py",
                "model_executor/layers/mamba/ops/causal_conv1d.py"):
        text = (root / rel).read_text()
        loads = re.findall(r"([^\n]*\n?[^\n]*)tl\.load\(num_accepted_tokens(?:_ptr)? \+ \w+\)\.to\(tl\.int64\) - 1", text)
        sites[rel] = [("tl.maximum(" in before) for before in loads]
    return sites


def marlin_layer(packed: torch.Tensor, scales: torch.Tensor, prefix: str = "") -> torch.nn.Module:
    """A linear layer as compressed-tensors loads a W4A16 one ([out, in / 8] codes, [out, in / group] scales), for
    Marlin's weight preparation to run on."""
    from vllm.model_executor import parameter

    layer = torch.nn.Module()
    layer.prefix = prefix
    with replaced(parameter, get_tensor_model_parallel_rank=lambda: 0, get_tensor_model_parallel_world_size=lambda: 1):
        layer.register_parameter("weight_packed", parameter.PackedvLLMParameter(
            data=packed, input_dim=1, output_dim=0, packed_dim=1, packed_factor=8, weight_loader=lambda *a: None))
        layer.register_parameter("weight_scale", parameter.GroupQuantScaleParameter(
            data=scales, input_dim=1, output_dim=0, weight_loader=lambda *a: None))
    return layer


def signed_scales() -> dict:
    """marlin-int8-signed-scales.patch: Marlin's own weight preparation for int8 activations (its CUDA repack and scale
    permutation, layout shuffles the cpu image cannot run, made identities) over codes and group scales of either
    sign, as AutoRound writes them; the weights the kernel then holds are decoded the way it reads them (each int16
    scale as unsigned) and compared with the checkpoint's. Released, as the patch's header says, a negative scale
    comes out as a huge positive one."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear.mixed_precision import marlin
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    generator = torch.Generator().manual_seed(0)
    size_k, size_n, group = 512, 64, 128
    codes = torch.randint(0, 16, (size_n, size_k), generator=generator, dtype=torch.int32)
    sign = torch.where(torch.rand(size_n, size_k // group, generator=generator) < 0.5, -1.0, 1.0)
    scales = ((torch.rand(size_n, size_k // group, generator=generator) * 0.02 + 0.005) * sign).half()
    checkpoint = (codes - 8).float() * scales.float().repeat_interleave(group, dim=1)  # [out, in]
    packed = torch.zeros(size_n, size_k // 8, dtype=torch.int32)
    for nibble in range(8):
        packed |= codes[:, nibble::8] << (4 * nibble)

    layer = marlin_layer(packed, scales.clone())
    config = MPLinearLayerConfig(full_weight_shape=(size_k, size_n), partition_weight_shape=(size_k, size_n),
                                 weight_type=scalar_types.uint4b8, act_type=torch.int8, group_size=group,
                                 zero_points=False, out_type=torch.float16)
    kernel = marlin.MarlinLinearKernel(config, "weight_packed", "weight_scale")
    with replaced(ops, gptq_marlin_repack=lambda x, **kwargs: x), \
            replaced(marlin, marlin_permute_scales=lambda s, **kwargs: s):
        kernel.process_weights_after_loading(layer)
    held = layer.weight_packed.data  # [in / 8, out]
    held_codes = torch.stack([(held >> (4 * nibble)) & 0xF for nibble in range(8)], dim=1).reshape(size_k, size_n)
    as_read = (layer.weight_scale.data.view(torch.int16).int() & 0xFFFF).float() * layer.input_global_scale.float()
    kernel_weights = ((held_codes - 8).float() * as_read.repeat_interleave(group, dim=0)).t()
    error = (kernel_weights - checkpoint).abs()
    step = scales.float().abs().repeat_interleave(group, dim=1)  # one code's worth of each weight
    clamped = (codes == 0) & (sign.repeat_interleave(group, dim=1) < 0)  # -8 x a negative scale: +8, four bits hold 7
    return {"negative_scales": int((sign < 0).sum()), "groups": sign.numel(),
            "worst_error_in_steps": float((error / step).max()),
            "worst_unclamped_error_in_steps": float((error / step)[~clamped].max()),
            "clamped": int(clamped.sum()), "weights": codes.numel()}


def gdn_worst_prefill() -> dict:
    """gdn-profile-worst-prefill.patch: what a GDN layer of the installed vLLM sends its prefill kernels in a forward
    without attention metadata (the profile run's), at the profile run's size and below it, with the variable unset
    and at 0. The kernels are Triton's, which the cpu image does not carry: they are made recorders of what they are
    given, and the layer is built bare (its shapes set, no weights): the choice of the step is what runs here."""
    import math

    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

    tokens, seqs, hk, hv, dk, dv = 2048, 64, 2, 4, 8, 8  # batch's budget and batch size; small heads suffice
    layer = gdn.QwenGatedDeltaNetAttention.__new__(gdn.QwenGatedDeltaNetAttention)
    torch.nn.Module.__init__(layer)
    sent: list[dict] = []

    def kernels(**kwargs):
        sent.append({"cu_seqlens": kwargs["cu_seqlens"].tolist(), "initial_state": list(kwargs["initial_state"].shape),
                     "state_dtype": str(kwargs["initial_state"].dtype), "q": list(kwargs["q"].shape)})
        return kwargs["v"], torch.zeros(kwargs["initial_state"].shape, dtype=torch.float32)

    def post_conv(conv_output, a, b, **kwargs):
        n = conv_output.shape[0]
        return (torch.zeros(n, hk, dk), torch.zeros(n, hk, dk), torch.zeros(n, hv, dv), torch.zeros(n, hv),
                torch.zeros(n, hv))

    for name, value in {"_worst_prefill_shape": (tokens, seqs), "num_v_heads": hv, "num_k_heads": hk, "tp_size": 1,
                        "head_k_dim": dk, "head_v_dim": dv, "gdn_prefill_backend": "triton",
                        "chunk_gated_delta_rule": kernels, "A_log": torch.zeros(hv), "dt_bias": torch.zeros(hv),
                        "get_state_dtype": lambda: (torch.bfloat16, torch.float16),
                        "get_state_shape": lambda: ((2 * hk * dk + hv * dv, 3), (hv, dv, dk))}.items():
        object.__setattr__(layer, name, value)
    conv_dim = 2 * hk * dk + hv * dv
    out: dict = {}
    with replaced(gdn, fused_post_conv_prep=post_conv):
        for case, forward_tokens, setting in (("profile", tokens, None), ("smaller", tokens // 2, None),
                                              ("off", tokens, "0")):
            sent.clear()
            with variables("VLLM_GDN_PROFILE_WORST_PREFILL", setting):
                layer._profile_worst_prefill(torch.zeros(forward_tokens, conv_dim))
            out[case] = [dict(step, chunks=sum(math.ceil((end - start) / 64) for start, end in
                                               zip(step["cu_seqlens"], step["cu_seqlens"][1:], strict=False)))
                         for step in sent]
    # The most chunks any split of the budget into that many sequences can make, by brute force over where the
    # tokens go: every sequence but one as short as can be is the worst, and nothing exceeds (tokens + 63 seqs) / 64.
    out["most_chunks"] = max((seqs - 1) * math.ceil(short / 64) + math.ceil((tokens - (seqs - 1) * short) / 64)
                             for short in range(1, tokens // seqs + 1))
    out["budget"] = {"tokens": tokens, "seqs": seqs}
    return out


def int8_emulated() -> dict:
    """marlin-int8-emulated.patch: with VLLM_MARLIN_INT8_EMULATE=1 beside batch's int8 activations, the layers the
    include rule gives int8 keep the 16-bit kernel and its weights (what the W4A16 scheme asks of marlin_int8_emulated)
    and are marked as Marlin's weight preparation runs (its CUDA repack and scale permutation made identities); a
    marked layer holds the weights the int8 kernel holds (negative group scales folded into the codes) and its input
    reaches the kernel rounded as the int8 path rounds it. vLLM's per-token quantization is a Triton kernel the cpu
    image cannot run: here it is its arithmetic (scale = largest magnitude / 127, round) in torch."""
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.model_executor.kernels.linear.mixed_precision import marlin
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.model_executor.layers.quantization.utils import marlin_utils
    from vllm.scalar_type import scalar_types

    def per_token_quant_int8(x):
        largest = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-10)
        return torch.round(x.float() * (127 / largest)).to(torch.int8), largest / 127

    size_k, size_n, group = 256, 64, 128
    config = MPLinearLayerConfig(full_weight_shape=(size_k, size_n), partition_weight_shape=(size_k, size_n),
                                 weight_type=scalar_types.uint4b8, act_type=torch.bfloat16, group_size=group,
                                 zero_points=False, out_type=torch.bfloat16)
    x = torch.randn(3, size_k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, scale = per_token_quant_int8(x)
    expected = (q.float() * scale).to(torch.bfloat16)
    with replaced(marlin_utils, per_token_quant_int8=per_token_quant_int8):
        out: dict = {"rounding_changes_the_input": not torch.equal(expected, x),
                     "rounded_as_the_int8_path": torch.equal(marlin_utils.marlin_round_input_as_int8(x), expected)}
    seen: list[torch.Tensor] = []

    def handed(input: torch.Tensor, **kwargs) -> torch.Tensor:  # the kernel, made a recorder of its input
        seen.append(input)
        return input

    for case, emulate in (("int8", None), ("emulated", "1")):
        with variables("VLLM_MARLIN_INPUT_DTYPE", "int8"), variables("VLLM_MARLIN_INT8_INCLUDE_RE", "mlp"), \
                variables("VLLM_MARLIN_INT8_EMULATE", emulate):
            facts: dict = {"compile_factor": envs.compile_factors().get("VLLM_MARLIN_INT8_EMULATE"), "layers": {}}
            for prefix in ("model.language_model.layers.0.mlp.down_proj",
                           "model.language_model.layers.3.self_attn.o_proj", "lm_head"):
                signed = torch.tensor([1.0, -1.0], dtype=torch.bfloat16).repeat(size_n, size_k // group // 2)
                layer = marlin_layer(torch.zeros(size_n, size_k // 8, dtype=torch.int32), signed, prefix)
                kernel = marlin.MarlinLinearKernel(config, "weight_packed", "weight_scale")
                seen.clear()
                with replaced(ops, gptq_marlin_repack=lambda w, **kwargs: w), \
                        replaced(marlin, marlin_permute_scales=lambda s, **kwargs: s,
                                 apply_gptq_marlin_linear=handed), \
                        replaced(marlin_utils, per_token_quant_int8=per_token_quant_int8):
                    kernel.process_weights_after_loading(layer)
                    kernel.apply_weights(layer, x)
                facts["layers"][prefix] = {
                    "input_dtype": str(marlin_utils.get_marlin_input_dtype(prefix)),
                    "kept_16_bit": marlin_utils.marlin_int8_emulated(prefix),  # what the W4A16 scheme asks
                    "marked": bool(getattr(layer, "marlin_int8_emulated", False)),
                    "input_as_given": bool(torch.equal(seen[0], x)),
                    "input_as_int8_rounds_it": bool(torch.equal(seen[0], expected)),
                    "signs_folded": bool((layer.weight_scale.data.float() >= 0).all()),  # as the int8 kernel holds
                }
            out[case] = facts
    return out


def tier_ranking() -> dict:
    """offload-rank-running-tail-first.patch: two requests in flight store their chunks into a CPU tier that holds
    three quarters of both, a few chunks a step each, in turn (two long conversations prefilling side by side), then
    finish; what a second turn of each finds is the leading run of its chunks the tier still holds (a lookup can use
    no chunk after a missing one). With VLLM_KV_OFFLOAD_RANK_RUNNING=0 (as released) and unset."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    chunks, step, capacity = 40, 4, 60
    out: dict = {}
    for case, setting in (("released", "0"), ("patched", None)):
        with variables("VLLM_KV_OFFLOAD_RANK_RUNNING", setting):
            manager = CPUOffloadingManager(num_chunks=capacity, cache_policy="lru")
        requests = {name: ReqContext(req_id=name) for name in ("a", "b")}
        keys = {name: [make_offload_key(f"{name}{i:03d}".encode(), 0) for i in range(chunks)] for name in requests}
        for name, context in requests.items():
            manager.on_new_request(context)
            for i, key in enumerate(keys[name]):
                context.set_offload_key_position(key, (i + 1) * 16)
        refused = 0
        for start in range(0, chunks, step):
            for name, context in requests.items():
                offer = keys[name][start:start + step]
                prepared = manager.prepare_store(offer, context)
                if prepared is None:
                    refused += 1
                    continue
                manager.complete_store(prepared.keys_to_store, context)
        for context in requests.values():
            manager.on_request_finished(context)
        leading = {}
        for name in requests:
            run = 0
            for key in keys[name]:
                if manager.lookup(key, ReqContext(req_id=name + "-turn-2")) != LookupResult.HIT:
                    break
                run += 1
            leading[name] = run
        out[case] = {"leading_chunks": leading, "refused_stores": refused}
    out["chunks"], out["capacity"] = chunks, capacity
    return out


if __name__ == "__main__":
    print(json.dumps({"card_patch": card_patch(), "marlin_include": marlin_include(), "profile_order": profile_order(),
                      "kv_groups": kv_groups(), "gdn_accepted_bounds": gdn_accepted_bounds(),
                      "signed_scales": signed_scales(), "gdn_worst_prefill": gdn_worst_prefill(),
                      "int8_emulated": int8_emulated(), "tier_ranking": tier_ranking()}))
