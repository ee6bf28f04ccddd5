"""FP8 quantization: the e4m3 error bound, vLLM's config blocks, and FP8 shards end to end.

Error bound checked per element (e4m3: 3 mantissa bits, min normal 2**-6, subnormal step 2**-9):
``|q * scale - w| <= max(2**-4 * |w|, 2**-10 * scale)``.

Logit tolerance (FP8 weights dequantized and run in fp32 vs the bf16 weights run in fp32):
relative RMS error <= 10 % and cosine similarity >= 0.99. Why 10 %: round-to-nearest with 3
mantissa bits leaves a relative RMS error of about 2**-3 / (sqrt(12) * 1.5) ~= 2.4 % on each
weight, hence on each quantized matmul's output; these models push activations through 14
quantized matmuls (2 layers x q, k, v, o, gate, up, down) whose errors add roughly in quadrature
on the residual stream: 2.4 % * sqrt(14) ~= 9 %. Measured: 2.8-5.7 %.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gdsload.loader import ConfigError, Manifest
from gdsload.loader.prepare.quantize import (
    FP8_MAX,
    QuantScheme,
    compute_scale,
    dequantize,
    quantization_config,
    quantize,
    quantize_into,
)
from gdsload.loader.prepare.shard import shard_checkpoint
from test_shard import TOKENS, build_model, model_from, read_rank, reassemble, source_tensors

transformers = pytest.importorskip("transformers")


def within_e4m3_bound(w: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Element-wise: is the dequantized value within e4m3 rounding of the source?"""
    w = w.double()
    s = scale.double().expand_as(w) if scale.dim() else scale.double()
    bound = torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10)
    return (deq.double() - w).abs() <= bound * (1 + 1e-6) + 1e-30


def test_parse_schemes():
    assert QuantScheme.parse("fp8") == QuantScheme("fp8", "per-tensor")
    assert QuantScheme.parse("FP8:per-channel").per_channel
    assert str(QuantScheme.parse("fp8:per-tensor")) == "fp8:per-tensor"
    with pytest.raises(ConfigError, match="'int8' is not supported; use fp8, fp8:per-tensor or fp8:per-channel"):
        QuantScheme.parse("int8")
    with pytest.raises(
        ConfigError, match="granularity 'per-block' is not known; choose one of per-tensor, per-channel"
    ):
        QuantScheme.parse("fp8:per-block")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 24),
    cols=st.integers(1, 40),
    magnitude=st.floats(1e-4, 1e4),
    outlier=st.floats(1.0, 1000.0),
    per_channel=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_within_e4m3_bound(rows, cols, magnitude, outlier, per_channel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * magnitude
    w[rows // 2, cols // 2] *= outlier  # one large value: the rest sits deep in the range, some subnormal
    if rows > 2:
        w[0] = 0  # an all-zero row
    w = w.to(dtype)
    if not torch.isfinite(w).all():
        return  # fp16 overflow: not a weight anyone ships
    scheme = QuantScheme("fp8", "per-channel" if per_channel else "per-tensor")
    amax = w.float().abs().amax(dim=1) if per_channel else w.float().abs().max()
    scale = compute_scale(amax, scheme)
    assert scale.dtype == torch.float32 and scale.shape == ((rows, 1) if per_channel else ())
    q = quantize(w, scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    deq = dequantize(q, scale)
    assert torch.isfinite(deq).all()
    assert within_e4m3_bound(w.float(), deq, scale).all()
    # the largest magnitude maps onto the top of the e4m3 range
    assert q.float().abs().max() == FP8_MAX or w.abs().max() == 0


@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_into_matches_quantize_on_strided_destinations(per_channel):
    w = (torch.randn(64, 48) * 3).to(torch.bfloat16)
    scale = compute_scale(
        w.float().abs().amax(dim=1) if per_channel else w.float().abs().max(),
        QuantScheme("fp8", "per-channel" if per_channel else "per-tensor"),
    )
    out = torch.zeros(64, 96, dtype=torch.float8_e4m3fn)
    work = torch.empty(64 * 48 + 7)
    quantize_into(out.narrow(1, 48, 48), w, scale, work)  # a column block: a strided destination
    assert torch.equal(out[:, 48:].view(torch.uint8), quantize(w, scale).view(torch.uint8))
    assert not out[:, :48].float().any()
    with pytest.raises(ValueError, match="work buffer must be fp32"):
        quantize_into(out[:, :48], w, scale, torch.empty(10))


def test_zeros_and_saturation():
    zero = torch.zeros(3, 5, dtype=torch.bfloat16)
    for scheme in (QuantScheme("fp8", "per-tensor"), QuantScheme("fp8", "per-channel")):
        amax = zero.float().abs().amax(dim=1) if scheme.per_channel else zero.float().abs().max()
        scale = compute_scale(amax, scheme)
        assert (scale > 0).all()
        assert not dequantize(quantize(zero, scale), scale).any()
    # values past the scale's range saturate at +-448, never NaN
    q = quantize(torch.tensor([1e6, -1e6, 3.0]), torch.tensor(1.0))
    assert q.float().tolist() == [448.0, -448.0, 3.0]
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert quantize(w, torch.tensor(0.5)).float().tolist() == [[2.0, 4.0], [6.0, 8.0]]
    assert w.tolist() == [[1.0, 2.0], [3.0, 4.0]], "quantize must not modify its input"
    # tiny but nonzero weights (or rows) keep their values: the scale follows them down to float32's normals
    for scheme, tiny in (
        (QuantScheme("fp8", "per-tensor"), torch.tensor([[1e-20, -1e-20], [3e-20, 2e-20]])),
        (QuantScheme("fp8", "per-channel"), torch.tensor([[1e-20, -1e-20], [3e-30, 1e-30]])),
    ):
        amax = tiny.abs().amax(dim=1) if scheme.per_channel else tiny.abs().max()
        scale = compute_scale(amax, scheme)
        back = dequantize(quantize(tiny, scale), scale)
        assert torch.allclose(back, tiny, rtol=0.07, atol=0), (scheme, back)


def test_quantization_config_as_vllm_reads_it():
    per_tensor = quantization_config(QuantScheme("fp8", "per-tensor"), ignored=["lm_head"])
    # vllm Fp8Config.from_config: quant_method contains "fp8" -> serialized; activation_scheme required
    assert per_tensor["quant_method"] == "fp8" and per_tensor["activation_scheme"] == "dynamic"
    assert "weight_block_size" not in per_tensor and per_tensor["ignored_layers"] == ["lm_head"]
    per_channel = quantization_config(QuantScheme("fp8", "per-channel"), ignored=["lm_head"])
    assert per_channel["quant_method"] == "compressed-tensors" and per_channel["format"] == "float-quantized"
    group = per_channel["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and per_channel["ignore"] == ["lm_head"]
    w, a = group["weights"], group["input_activations"]
    assert (w["type"], w["num_bits"], w["strategy"], w["symmetric"], w["dynamic"]) == (
        "float",
        8,
        "channel",
        True,
        False,
    )
    assert (a["type"], a["num_bits"], a["strategy"], a["dynamic"]) == ("float", 8, "token", True)


@pytest.fixture(scope="module")
def fp8_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8src")
    out = {}
    for kind in ("llama-gqa-tied", "qwen2-tied", "llama-bias-untied"):
        model = build_model(kind)
        model.save_pretrained(root / kind)
        with torch.no_grad():
            ref = model_from(kind, source_tensors(root / kind), torch.float32)(TOKENS).logits
        out[kind] = (root / kind, ref)
    return out


def _quantized_names(t: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in t if n.endswith("_proj.weight")]


@pytest.mark.parametrize("granularity", ["per-tensor", "per-channel"])
@pytest.mark.parametrize("layout", ["hf", "vllm"])
@pytest.mark.parametrize("kind", ["llama-gqa-tied", "qwen2-tied", "llama-bias-untied"])
def test_fp8_shards_dequantize_within_bounds_and_logits_close(fp8_sources, tmp_path, kind, layout, granularity):
    src, ref_logits = fp8_sources[kind]
    out = tmp_path / "out"
    tp = 4 if kind == "llama-gqa-tied" else 2  # tp=4 > 2 KV heads: replicated heads carry scales too
    shard_checkpoint(src, out, tp=tp, layout=layout, quantize=f"fp8:{granularity}")
    original = source_tensors(src)
    scheme = QuantScheme("fp8", granularity)

    # files: FP8 weights, fp32 scales, everything else untouched in the source dtype
    ranks = [read_rank(out, r) for r in range(tp)]
    # vLLM 0.32's attention state for this quantization (what its model registers; the engine tier checks it)
    if granularity == "per-tensor":
        attn = {s: ((), torch.bfloat16, -1.0) for s in ("q_scale", "k_scale", "v_scale", "prob_scale")}
    else:
        attn = {s: ((1,), torch.float32, 1.0) for s in ("q_scale", "k_scale", "v_scale")}
        attn |= {s: ((1,), torch.bfloat16, 0.0) for s in ("q_zero_point", "k_zero_point", "v_zero_point")}
    attn |= {s: ((), torch.float32, 1.0) for s in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale")}
    for tensors in ranks:
        for name, t in tensors.items():
            if ".attn." in name:
                assert layout == "vllm", name
                shape, dtype, value = attn[name.rsplit(".", 1)[1]]
                assert (tuple(t.shape), t.dtype) == (shape, dtype) and (t == value).all(), (name, t)
            elif name.endswith("_proj.weight"):
                assert t.dtype == torch.float8_e4m3fn, name
            elif name.endswith("weight_scale"):
                assert t.dtype == torch.float32, name
            else:
                assert t.dtype == torch.bfloat16, name
        if layout == "vllm":
            for i in range(2):
                assert {
                    n.rsplit(".", 1)[1] for n in tensors if n.startswith(f"model.layers.{i}.self_attn.attn.")
                } == set(attn)
            if granularity == "per-tensor":
                assert tensors["model.layers.0.self_attn.qkv_proj.weight_scale"].shape == (3,)
                assert tensors["model.layers.0.mlp.gate_up_proj.weight_scale"].shape == (2,)
                assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (1,)

    # scales: computed over the whole source tensor (or row), identical on every rank holding it
    rebuilt = reassemble(out, {k: tuple(v.shape) for k, v in original.items()})
    for name in _quantized_names(original):
        w = original[name].float()
        amax = w.abs().amax(dim=1, keepdim=True) if scheme.per_channel else w.abs().max()
        scale = amax / FP8_MAX
        ok = within_e4m3_bound(w, rebuilt[name], scale)
        assert ok.all(), f"{name}: {int((~ok).sum())} elements outside the e4m3 bound"
        err = (rebuilt[name] - w).norm() / w.norm()
        assert 0 < err < 0.05, f"{name}: relative error {err:.4f}"
    if layout == "hf":
        for name in _quantized_names(original):
            for r, tensors in enumerate(ranks):
                s = tensors[name + "_scale"]
                w = original[name].float()
                if not scheme.per_channel:
                    assert s.shape == () and s.item() == (w.abs().max() / FP8_MAX).item(), (name, r)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: whole rows' scales
                    assert torch.equal(s, w.abs().amax(dim=1, keepdim=True) / FP8_MAX), (name, r)
    for name, t in original.items():
        if name not in _quantized_names(original):
            assert rebuilt[name].dtype == t.dtype and torch.equal(rebuilt[name], t), name

    # config and manifest say what vLLM needs
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == quantization_config(scheme, ignored=["lm_head"])
    assert Manifest.read(out).extra["shard"]["quantize"] == f"fp8:{granularity}"

    # logits of the dequantized model (fp32) against the bf16 weights (fp32); tolerance: module docstring
    with torch.no_grad():
        got = model_from(kind, rebuilt, torch.float32)(TOKENS).logits
    rel = ((got - ref_logits).norm() / ref_logits.norm()).item()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref_logits.flatten(), dim=0).item()
    assert 0 < rel <= 0.10 and cos >= 0.99, (rel, cos)
    assert math.isfinite(rel)
