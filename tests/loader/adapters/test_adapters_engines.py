"""vLLM, SGLang and TensorRT-LLM adapters.

The engines cannot be installed in CI (no CPU builds in budget), so the engine-agnostic core is
tested against plain torch modules that follow each engine's documented naming/shape contract
(vLLM/SGLang: fused ``qkv_proj``/``gate_up_proj``, vocab padded to 64 and split by rank,
``load_weights`` returning the filled names, ``direct`` updates by exact parameter name;
TensorRT-LLM: full HF tensors for every rank, legacy ``rank{N}.safetensors`` + ``config.json``).
Tests against the real packages run where they are installed (``pytest.importorskip``).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gdsload.loader import ConfigError, save_file, write_manifest
from gdsload.loader.adapters import AdapterOptions, EngineNotInstalledError, InjectError, LayoutError
from gdsload.loader.adapters import sglang as gsglang
from gdsload.loader.adapters import trtllm as gtrtllm
from gdsload.loader.adapters import vllm as gvllm

VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 250, 64, 128, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
PAD_VOCAB = math.ceil(VOCAB / 64) * 64  # vLLM pads the vocabulary to a multiple of 64
LORA_EXTRA = 16  # extra lm_head rows a LoRA-enabled vLLM model allocates


def hf_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    w = {
        "model.embed_tokens.weight": rnd(VOCAB, HIDDEN),
        "model.norm.weight": rnd(HIDDEN),
        "lm_head.weight": rnd(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rnd(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rnd(INTER, HIDDEN),
            p + "mlp.up_proj.weight": rnd(INTER, HIDDEN),
            p + "mlp.down_proj.weight": rnd(HIDDEN, INTER),
            p + "input_layernorm.weight": rnd(HIDDEN),
            p + "post_attention_layernorm.weight": rnd(HIDDEN),
        }
    return w


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, 0)[rank]


def _cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, 1)[rank]


def _vocab_rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    padded = torch.zeros(PAD_VOCAB, t.shape[1], dtype=t.dtype)
    padded[:VOCAB] = t
    return _rows(padded, rank, tp)


def vllm_rank(hf: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """vLLM's LlamaForCausalLM state dict for one tensor-parallel rank, derived from HF weights."""
    out = {
        "model.embed_tokens.weight": _vocab_rows(hf["model.embed_tokens.weight"], rank, tp),
        "lm_head.weight": _vocab_rows(hf["lm_head.weight"], rank, tp),
        "model.norm.weight": hf["model.norm.weight"],
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [_rows(hf[p + f"self_attn.{x}_proj.weight"], rank, tp) for x in "qkv"]
        )
        out[p + "self_attn.o_proj.weight"] = _cols(hf[p + "self_attn.o_proj.weight"], rank, tp)
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [_rows(hf[p + f"mlp.{x}_proj.weight"], rank, tp) for x in ("gate", "up")]
        )
        out[p + "mlp.down_proj.weight"] = _cols(hf[p + "mlp.down_proj.weight"], rank, tp)
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = hf[p + n]
    return {k: v.contiguous() for k, v in out.items()}


class VllmLlama(nn.Module):
    """A module with vLLM's LlamaForCausalLM parameter names and per-rank shapes, and vLLM's load_weights contract.

    ``load_weights`` maps HF names onto the fused parameters and slices full tensors for this rank, as vLLM's
    ``stacked_params_mapping`` and ``weight_loader``s do, and returns the names it filled.
    """

    stacked = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, rank: int, tp: int, *, lora_rows: int = 0, skip: tuple[str, ...] = ()):
        super().__init__()
        self.rank, self.tp, self.skip = rank, tp, skip
        vocab = PAD_VOCAB // tp
        q, kv, inter = HEADS * HEAD_DIM // tp, KV_HEADS * HEAD_DIM // tp, INTER // tp
        self.shapes = {
            "model.embed_tokens.weight": (vocab, HIDDEN),
            "lm_head.weight": (vocab + lora_rows, HIDDEN),
            "model.norm.weight": (HIDDEN,),
        }
        for i in range(LAYERS):
            p = f"model.layers.{i}."
            self.shapes |= {
                p + "self_attn.qkv_proj.weight": (q + 2 * kv, HIDDEN),
                p + "self_attn.o_proj.weight": (HIDDEN, q),
                p + "mlp.gate_up_proj.weight": (2 * inter, HIDDEN),
                p + "mlp.down_proj.weight": (HIDDEN, inter),
                p + "input_layernorm.weight": (HIDDEN,),
                p + "post_attention_layernorm.weight": (HIDDEN,),
            }
        self.params = nn.ParameterDict(
            {
                k.replace(".", "__"): nn.Parameter(torch.zeros(s, dtype=torch.bfloat16), requires_grad=False)
                for k, s in self.shapes.items()
            }
        )
        self.q, self.kv, self.inter = q, kv, inter

    def named_parameters(self, *args: Any, **kwargs: Any):  # vLLM's names, not ParameterDict's
        for k, p in self.params.items():
            yield k.replace("__", "."), p

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        return {k.replace("__", "."): p.data for k, p in self.params.items()}

    def param(self, name: str) -> torch.Tensor:
        return dict(self.named_parameters())[name].data  # KeyError for unknown names, like vLLM's params_dict

    def load_weights(self, weights) -> set[str]:
        loaded: set[str] = set()
        for name, w in weights:
            if any(s in name for s in self.skip):
                continue
            for fused, part, shard in self.stacked:
                if part in name:
                    target = name.replace(part, fused)
                    dst = self.param(target)
                    if fused == "qkv_proj":
                        size = self.q if shard == "q" else self.kv
                        offset = {"q": 0, "k": self.q, "v": self.q + self.kv}[shard]
                    else:
                        size, offset = self.inter, shard * self.inter
                    dst.narrow(0, offset, size).copy_(w.narrow(0, self.rank * size, size))
                    loaded.add(target)
                    break
            else:
                dst = self.param(name)  # KeyError for names the model does not know, as in vLLM
                if "embed_tokens" in name or "lm_head" in name:
                    start = self.rank * (PAD_VOCAB // self.tp)
                    n = max(0, min(VOCAB - start, PAD_VOCAB // self.tp))
                    dst[:n].copy_(w[start : start + n])
                elif "o_proj" in name or "down_proj" in name:
                    dst.copy_(w.narrow(1, self.rank * dst.shape[1], dst.shape[1]))
                else:
                    dst.copy_(w)
                loaded.add(name)
        return loaded


@pytest.fixture(scope="module")
def hf() -> dict[str, torch.Tensor]:
    return hf_weights()


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf-tp1")
    save_file(hf, root / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def vllm_dir(hf, tmp_path_factory) -> Path:
    """vLLM layout, tp=2, without a manifest (as vLLM's save_sharded_state writes it), two parts per rank."""
    root = tmp_path_factory.mktemp("vllm-tp2")
    for r in range(2):
        state = vllm_rank(hf, r, 2)
        names = sorted(state)
        save_file({k: state[k] for k in names[::2]}, root / f"model-rank-{r}-part-0.safetensors")
        save_file({k: state[k] for k in names[1::2]}, root / f"model-rank-{r}-part-1.safetensors")
    return root


@pytest.fixture(scope="module")
def hf_tp2_dir(hf, tmp_path_factory) -> Path:
    """A simple hf-layout 2-rank split with a manifest: HF names, per-rank slices."""
    root = tmp_path_factory.mktemp("hf-tp2")
    ranks = {}
    for r in range(2):
        part = {
            k: (v if v.ndim == 1 else _rows(v, r, 2) if "o_proj" not in k and "down" not in k else _cols(v, r, 2))
            for k, v in hf.items()
        }
        save_file({k: v.contiguous() for k, v in part.items()}, root / f"model-rank-{r}-part-0.safetensors")
        ranks[r] = [f"model-rank-{r}-part-0.safetensors"]
    write_manifest(root, ranks, tp_size=2, layout="hf")
    return root


# ------------------------------------------------------------------------------------------------------- vLLM


def test_vllm_sharded_state_copies_each_rank_with_the_narrowing_rule(hf, vllm_dir):
    for rank in range(2):
        plan = gvllm.choose_route(vllm_dir, rank=rank, tp_size=2, options=AdapterOptions())
        assert (plan.kind, plan.file_rank, plan.layout.layout, plan.layout.source) == (
            "sharded_state",
            rank,
            "vllm",
            "vllm",
        )
        model = VllmLlama(rank, 2, lora_rows=LORA_EXTRA)
        report = gvllm.load_into_model(model, vllm_dir, rank=rank, tp_size=2)
        assert report.ok and report.narrowed == ["lm_head.weight"]
        # Every tensor read straight into its parameter (the narrowed one into its leading rows): no copies.
        assert report.direct == len(report.loaded) and "direct=" in report.source
        want = vllm_rank(hf, rank, 2)
        for name, t in want.items():
            got = model.param(name)
            assert torch.equal(got[: t.shape[0]], t), name
        assert not model.param("lm_head.weight")[-LORA_EXTRA:].any()  # padding left alone


def test_vllm_sharded_state_copies_what_cannot_be_read_in_place(hf, vllm_dir):
    """A parameter of another dtype (vLLM started with another --dtype) is converted, not read in place."""
    model = VllmLlama(0, 2).to(torch.float32)
    report = gvllm.load_into_model(model, vllm_dir, rank=0, tp_size=2)
    assert report.ok and report.direct == 0
    for name, t in vllm_rank(hf, 0, 2).items():
        assert torch.equal(model.param(name), t.float()), name


def test_vllm_load_weights_path_gives_the_same_parameters(hf, hf_dir):
    plan = gvllm.choose_route(hf_dir, rank=1, tp_size=2, options=AdapterOptions())
    assert (plan.kind, plan.file_rank, plan.layout.layout) == ("load_weights", 0, "hf")
    model = VllmLlama(1, 2)
    report = gvllm.load_into_model(model, hf_dir, rank=1, tp_size=2)
    assert report.ok and len(report.loaded) == len(hf) and report.bytes == sum(t.nbytes for t in hf.values())
    for name, t in vllm_rank(hf, 1, 2).items():
        assert torch.equal(model.param(name), t), name


def test_vllm_load_weights_reports_unfilled_parameters(hf_dir):
    model = VllmLlama(0, 1, skip=("model.norm.weight",))
    with pytest.raises(InjectError, match=r"left 1 parameters unfilled: 'model.norm.weight'"):
        gvllm.load_into_model(model, hf_dir, rank=0, tp_size=1)
    report = gvllm.load_into_model(
        VllmLlama(0, 1, skip=("model.norm.weight",)), hf_dir, rank=0, tp_size=1, options=AdapterOptions(strict=False)
    )
    assert report.missing == ["model.norm.weight"]


def test_vllm_unknown_name_in_load_weights_names_the_tensor(hf, tmp_path):
    save_file({**hf, "model.layers.0.mlp.bogus.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(InjectError, match=r"at tensor 'model.layers.0.mlp.bogus.weight': KeyError"):
        gvllm.load_into_model(VllmLlama(0, 1), tmp_path, rank=0, tp_size=1)


def test_vllm_strict_sharded_state_lists_everything_before_writing(hf, tmp_path):
    state = vllm_rank(hf, 0, 2)
    del state["model.norm.weight"]
    state["model.layers.1.self_attn.rotary.weight"] = torch.zeros(4)
    state["model.layers.0.mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTER)  # larger than the rank's shard
    for r in range(2):
        save_file(state, tmp_path / f"model-rank-{r}-part-0.safetensors")
    model = VllmLlama(0, 2)
    with pytest.raises(InjectError) as e:
        gvllm.load_into_model(model, tmp_path, rank=0, tp_size=2)
    msg = str(e.value)
    assert "1 missing" in msg and "'model.norm.weight'" in msg and "'model.layers.1.self_attn.rotary.weight'" in msg
    assert "'model.layers.0.mlp.down_proj.weight' checkpoint [64, 128] vs model [64, 64]" in msg
    assert all(not p.any() for _, p in model.named_parameters())


def test_vllm_filter_shared_tensors_follows_sharded_state():
    base = torch.arange(12.0)
    state = {
        "b.fused": base,
        "a.view": base[:6],
        "c.same": base,
        "other": torch.ones(3),
        "strided": base[::2],
        "empty": torch.empty(0),
    }
    kept = gvllm.filter_shared_tensors(state)
    # The widest tensor wins; of identical spans the smallest name; views and non-contiguous tensors are covered.
    assert sorted(kept) == ["b.fused", "other"]
    # A non-contiguous tensor with storage of its own (a transposed buffer) is kept, and measured by its strides.
    grid = torch.arange(12.0).reshape(3, 4)
    kept = gvllm.filter_shared_tensors({"grid.t": grid.t(), "grid.row": grid[0]})
    assert sorted(kept) == ["grid.row", "grid.t"]  # the row is not covered: non-contiguous tensors cover nothing


def test_vllm_plans_refuse_what_the_engine_would_load_wrongly(vllm_dir, hf_tp2_dir, hf_dir, tmp_path):
    with pytest.raises(LayoutError, match=r"sharded for tensor-parallel size 2.*runs tp=4.*--tensor-parallel-size 2"):
        gvllm.choose_route(vllm_dir, rank=0, tp_size=4, options=AdapterOptions())
    with pytest.raises(LayoutError, match=r"hf-layout shards for tp=2.*unsharded \(TP=1\)"):
        gvllm.choose_route(hf_tp2_dir, rank=0, tp_size=2, options=AdapterOptions())
    with pytest.raises(LayoutError, match="sidecar.*tp=1 only"):
        gvllm.choose_route(hf_dir, rank=0, tp_size=2, options=AdapterOptions(sidecar_url="http://127.0.0.1:1"))
    with pytest.raises(LayoutError, match='"layout": "vllm" or "hf"'):
        gvllm.choose_route(tmp_path / "not-here", rank=0, tp_size=2, options=AdapterOptions(sidecar_url="http://x:1"))
    given = gvllm.choose_route(None, rank=1, tp_size=2, options=AdapterOptions(sidecar_url="http://x:1", layout="vllm"))
    assert (given.kind, given.file_rank, given.layout.source) == ("sharded_state", 1, "option")
    save_file({"transformer.vocab_embedding.weight": torch.zeros(2, 2)}, tmp_path / "rank0.safetensors")
    with pytest.raises(LayoutError, match="TensorRT-LLM checkpoint"):
        gvllm.choose_route(tmp_path, rank=0, tp_size=1, options=AdapterOptions())


def test_vllm_register_without_vllm_names_the_package():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed; the real-engine test covers registration")
    with pytest.raises(EngineNotInstalledError, match="needs 'vllm'.*install vllm") as e:
        gvllm.register()
    assert isinstance(e.value, ImportError)
    with pytest.raises(EngineNotInstalledError):
        gvllm.GdsloadModelLoader  # noqa: B018 (lazy attribute)


def test_vllm_real_package_registers_load_format(vllm_dir):
    pytest.importorskip("vllm")
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    gvllm.register()
    gvllm.register()  # plugins can be loaded twice per process
    loader = get_model_loader(LoadConfig(load_format="gdsload", model_loader_extra_config={"backend": "cpu"}))
    assert type(loader) is gvllm.loader_class() and loader.options.backend == "cpu"
    with pytest.raises(ConfigError, match="unknown key"):
        get_model_loader(LoadConfig(load_format="gdsload", model_loader_extra_config={"pattern": "x"}))


# ----------------------------------------------------------------------------------------------------- SGLang


class _Recorder:
    """Records, when SGLang's post-processing runs, whether the weights were already in."""

    def __init__(self, model: VllmLlama):
        self.model, self.calls = model, []

    def __call__(self, model: nn.Module) -> None:
        self.calls.append(bool(self.model.param("model.norm.weight").any()))


def test_sglang_post_processes_before_sharded_copy_and_after_load_weights(vllm_dir, hf_dir):
    model = VllmLlama(1, 2)
    hook = _Recorder(model)
    report = gsglang.load_model_weights(model, vllm_dir, rank=1, tp_size=2, process_weights=hook)
    assert report.engine == "sglang" and report.ok and hook.calls == [False]
    model = VllmLlama(1, 2)
    hook = _Recorder(model)
    gsglang.load_model_weights(model, hf_dir, rank=1, tp_size=2, process_weights=hook)
    assert hook.calls == [True]


def test_sglang_sharded_load_runs_the_models_post_load_step(vllm_dir, hf_dir):
    """A pre-sharded load bypasses ``model.load_weights``, so the model's ``post_load_weights`` runs after the copy
    (with the weights in place); on the HF route ``load_weights`` is SGLang's and the adapter leaves it be."""
    seen = []

    class WithPostLoad(VllmLlama):
        def post_load_weights(self):
            seen.append(bool(self.param("model.embed_tokens.weight").abs().sum() > 0))

    gsglang.load_model_weights(WithPostLoad(1, 2), vllm_dir, rank=1, tp_size=2)
    assert seen == [True]
    gsglang.load_model_weights(WithPostLoad(1, 2), hf_dir, rank=1, tp_size=2)
    assert seen == [True]
    calls = []
    gsglang.load_model_weights(WithPostLoad(1, 2), vllm_dir, rank=1, tp_size=2, post_load=calls.append)
    assert len(calls) == 1 and seen == [True]


class FakeEngine:
    """``sglang.Engine.update_weights_from_tensor`` with ``direct`` semantics on a module, as documented:
    ``params_dict = dict(model.named_parameters())``; ``default_weight_loader`` asserts equal shapes and copies."""

    def __init__(self, model: VllmLlama):
        self.model, self.calls = model, []

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(([n for n, _ in named_tensors], load_format, flush_cache))
        params = dict(self.model.named_parameters())
        for name, t in named_tensors:
            if name not in params:
                return False, f"KeyError: {name!r}"
            if params[name].shape != t.shape:
                return False, f"AssertionError: shape {tuple(t.shape)} vs {tuple(params[name].shape)}"
            params[name].data.copy_(t)
        return True, "Success"


def test_sglang_live_update_in_buckets_flushes_once(hf):
    engine = FakeEngine(VllmLlama(0, 1))
    state = vllm_rank(hf, 0, 1)
    report = gsglang.update_weights_from_tensors(engine, state, bucket_bytes=40_000, expected=engine.model)
    assert report.ok and report.bytes == sum(t.nbytes for t in state.values())
    assert len(engine.calls) > 2 and [c[2] for c in engine.calls] == [False] * (len(engine.calls) - 1) + [True]
    assert {c[1] for c in engine.calls} == {"direct"}
    assert sorted(n for c in engine.calls for n in c[0]) == sorted(state)
    for name, t in state.items():
        assert torch.equal(engine.model.param(name), t), name


def test_sglang_live_update_checks_and_reports_refusals(hf):
    engine = FakeEngine(VllmLlama(0, 1))
    with pytest.raises(InjectError, match=r"unknown names \('model.layers.0.self_attn.q_proj.weight'"):
        gsglang.update_weights_from_tensors(engine, hf, expected=engine.model)
    assert engine.calls == []  # nothing was sent
    with pytest.raises(
        gsglang.EngineUpdateError, match=r"bucket 1/1 .*AssertionError: shape \(250, 64\) vs \(256, 64\).*fused names"
    ) as e:
        gsglang.update_weights_from_tensors(engine, hf)
    assert isinstance(e.value, RuntimeError)


def test_sglang_bucketize_keeps_order_and_bounds():
    named = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([10, 10, 25, 5, 40, 1])]
    buckets = [[n for n, _ in b] for b in gsglang.bucketize(named, 30)]
    assert buckets == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5"]]
    with pytest.raises(ConfigError):
        list(gsglang.bucketize(named, 0))
    twice = [("a", torch.zeros(2)), ("b", torch.ones(2)), ("a", torch.full((2,), 7.0))]
    out = [(n, t[0].item()) for b in gsglang.bucketize(twice, 1 << 20) for n, t in b]
    assert out == [("a", 0.0), ("b", 1.0), ("a", 7.0)]  # a repeated name keeps each of its tensors


def test_sglang_per_rank_without_sglang_names_the_package(hf):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed")
    with pytest.raises(EngineNotInstalledError, match="needs 'sglang'"):
        gsglang.update_weights_per_rank(FakeEngine(VllmLlama(0, 2)), [vllm_rank(hf, r, 2) for r in range(2)])
    with pytest.raises(EngineNotInstalledError):
        gsglang.loader_class()


def test_sglang_real_package_accepts_the_loader_class():
    pytest.importorskip("sglang")
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader

    loader = get_model_loader(
        LoadConfig(load_format=gsglang.loader_class(), model_loader_extra_config={"backend": "cpu"})
    )
    assert type(loader) is gsglang.loader_class() and loader.options.backend == "cpu"


# ----------------------------------------------------------------------------------------------- TensorRT-LLM


def test_trtllm_pytorch_backend_gets_full_hf_weights_on_every_rank(hf, hf_dir):
    for tp_rank in range(2):
        with gtrtllm.load_trtllm_weights(hf_dir, tp_rank=tp_rank, tp_size=2) as w:
            assert sorted(w.tensors) == sorted(hf)
            assert all(torch.equal(w.tensors[k], v) for k, v in hf.items())


def test_trtllm_refuses_presharded_directories(vllm_dir, hf_tp2_dir):
    with pytest.raises(LayoutError, match=r"vllm-layout shards for tp=2.*load_weight_shard.*TP=1"):
        gtrtllm.load_trtllm_weights(vllm_dir, tp_rank=0, tp_size=2)
    with pytest.raises(LayoutError, match="hf-layout shards for tp=2"):
        gtrtllm.load_trtllm_weights(hf_tp2_dir, tp_rank=0, tp_size=2)


def _legacy(root: Path, mapping: dict[str, int], files: int) -> dict[int, dict[str, torch.Tensor]]:
    ranks = {}
    for r in range(files):
        g = torch.Generator().manual_seed(r)
        ranks[r] = {
            "transformer.vocab_embedding.weight": torch.randn(32, 8, generator=g).half(),
            "transformer.layers.0.attention.qkv.weight": torch.randn(24, 8, generator=g).half(),
            "lm_head.weight": torch.randn(32, 8, generator=g).half(),
        }
        save_file(ranks[r], root / f"rank{r}.safetensors")
    (root / "config.json").write_text(
        json.dumps({"architecture": "LlamaForCausalLM", "dtype": "float16", "mapping": mapping})
    )
    return ranks


def test_trtllm_legacy_rank_files_load_with_their_config(tmp_path):
    ranks = _legacy(tmp_path, {"world_size": 2, "tp_size": 2}, 2)
    ckpt = gtrtllm.load_legacy_checkpoint(tmp_path, 1)
    assert (ckpt.file_rank, ckpt.config["architecture"]) == (1, "LlamaForCausalLM")
    assert ckpt.mapping == gtrtllm.LegacyMapping(world_size=2, tp_size=2)
    assert all(torch.equal(ckpt.tensors[k], v) for k, v in ranks[1].items())
    ckpt.close()
    with pytest.raises(LayoutError, match="legacy TensorRT-LLM checkpoint.*PyTorch backend"):
        gtrtllm.load_trtllm_weights(tmp_path, tp_rank=0, tp_size=2)
    with pytest.raises(LayoutError, match="rank 2 is outside the checkpoint's world_size 2"):
        gtrtllm.load_legacy_checkpoint(tmp_path, 2)


def test_trtllm_legacy_checkpoint_compressed_by_gdsload_loads(tmp_path):
    from gdsload.loader.prepare.compress import compress_dir

    src = tmp_path / "legacy"
    src.mkdir()
    ranks = _legacy(src, {"world_size": 2, "tp_size": 2}, 2)
    compress_dir(src, tmp_path / "packed", codec="zstd", device="cpu", min_tensor_bytes=0)  # adds a manifest
    ckpt = gtrtllm.load_legacy_checkpoint(tmp_path / "packed", 1)
    assert all(torch.equal(ckpt.tensors[k], v) for k, v in ranks[1].items())
    ckpt.close()


def test_trtllm_legacy_context_parallel_ranks_share_files(tmp_path):
    _legacy(tmp_path, {"world_size": 8, "tp_size": 2, "pp_size": 2, "cp_size": 2}, 4)
    _, mapping = gtrtllm.read_legacy_config(tmp_path)
    # PretrainedModel.from_checkpoint: rank % tp + rank // (tp * cp) * tp
    assert [mapping.file_rank(r) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_trtllm_legacy_config_must_match_the_files(tmp_path):
    _legacy(tmp_path, {"world_size": 4, "tp_size": 4}, 2)
    with pytest.raises(LayoutError, match=r"tp_size=4 pp_size=1 \(4 rank files\) but the directory holds rank files"):
        gtrtllm.read_legacy_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"mapping": {"world_size": 3, "tp_size": 2}}))
    with pytest.raises(LayoutError, match=r"world_size=3 but tp_size\*pp_size\*cp_size=2"):
        gtrtllm.read_legacy_config(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(LayoutError, match="config.json' is missing"):
        gtrtllm.read_legacy_config(tmp_path)


def test_trtllm_without_the_package_names_it():
    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed")
    with pytest.raises(EngineNotInstalledError, match="needs 'tensorrt_llm'"):
        gtrtllm.register()
    with pytest.raises(EngineNotInstalledError):
        gtrtllm.GdsloadCheckpointLoader  # noqa: B018 (lazy attribute)


def test_trtllm_real_package_registers_the_checkpoint_loader(hf, hf_dir):
    pytest.importorskip("tensorrt_llm")
    from tensorrt_llm._torch.models.checkpoints.base_checkpoint_loader import BaseCheckpointLoader
    from tensorrt_llm.mapping import Mapping

    gtrtllm.register()
    loader = BaseCheckpointLoader.get("gdsload")
    assert isinstance(loader, gtrtllm.checkpoint_loader_class()) and loader.checkpoint_format == "HF"
    weights = loader.load_weights(str(hf_dir), mapping=Mapping(world_size=2, tp_size=2, rank=1))
    assert all(torch.equal(weights[k], v) for k, v in hf.items())
    loader.cleanup()
