"""Layouts from vLLM's own model code: every architecture and tensor x pipeline x expert layout the CPU build loads.

``gdsload shard`` runs here as a user with vLLM installed runs it (the engine environment's ``gdsload``),
so each rank's tensors come from tracing vLLM's own weight loaders. Tensor-parallel layouts must make
vLLM generate exactly what its own loader makes from the Hugging Face directory (tokens and logprobs,
bit for bit), and vLLM's own ``sharded_state`` loader must take the files. Pipeline- and expert-parallel
layouts, which the CPU build loads but cannot run, must hold, rank by rank and tensor by tensor, exactly
the state vLLM's own loader puts there — and vLLM's ``sharded_state`` loader must put the same state
from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine_env import Engine
from gdsload.loader.format.manifest import Manifest
from test_vllm import assert_logged, assert_same

ARCHITECTURES = ("mixtral", "qwen3-moe", "deepseek-v2", "qwen3")


@pytest.fixture(scope="session")
def traced(engine: Engine, tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """``traced(kind, *flags)``: ``(directory, shard result)`` of ``gdsload shard`` with vLLM, once per flag set."""
    root = tmp_path_factory.mktemp("traced")
    cache: dict[tuple[str, ...], tuple[Path, dict[str, Any]]] = {}

    def make(kind: str, *flags: str) -> tuple[Path, dict[str, Any]]:
        key = (kind, *flags)
        if key not in cache:
            out = root / "-".join([kind, *(f.strip("-").replace(":", "") for f in flags)])
            cache[key] = out, engine.shard(tiny[kind], out, *flags)
        return cache[key]

    return make


def rank_state(out: Path, rank: int) -> dict[str, torch.Tensor]:
    """Global rank ``rank`` of a gdsload output, read by the reference reader (safetensors)."""
    manifest = Manifest.read(out)
    state: dict[str, torch.Tensor] = {}
    for f in manifest.ranks[rank]:
        state.update(load_file(str(out / f.path)))
    return state


def assert_same_state(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    assert set(ours) == set(theirs), (
        f"{what}: names differ: only ours {sorted(set(ours) - set(theirs))[:6]}, "
        f"only vLLM's {sorted(set(theirs) - set(ours))[:6]}"
    )
    for name, t in ours.items():
        v = theirs[name]
        assert (t.dtype, t.shape) == (v.dtype, v.shape), (
            f"{what}: {name} is {t.dtype} {list(t.shape)}, vLLM's {v.dtype} {list(v.shape)}"
        )
        assert torch.equal(t.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), (
            f"{what}: {name} differs from vLLM's bytes"
        )


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_traced_layout_generates_as_vllms_own_loader(engine: Engine, tiny, traced, kind: str, tp: int):
    """Strict mode (the default): every state-dict entry from the files, names and shapes checked first."""
    out, result = traced(kind, "--tp", str(tp))
    manifest = Manifest.read(out)
    assert result["layout_from"].startswith("vLLM ") and manifest.extra["shard"]["layout_from"] == result["layout_from"]
    assert manifest.tp_size == tp and manifest.world_size == tp
    want = engine.reference(tiny[kind], tp)
    got, log = engine.generate(out, "gdsload", tp)
    assert_same(got, want, f"{kind} shard --tp {tp} (vLLM's layout), strict")
    assert_logged(log, tp)
    if tp == 1:
        theirs, _ = engine.generate(out, "sharded_state", tp)
        assert_same(theirs, want, f"vLLM's sharded_state on {kind} shard --tp {tp}")


LAYOUTS = [
    ("mixtral", 1, 2, 1),
    ("mixtral", 2, 1, 2),
    ("qwen3-moe", 2, 1, 2),
    ("deepseek-v2", 2, 1, 2),
    ("deepseek-v2", 1, 2, 1),
    ("qwen3", 1, 2, 1),
]


@pytest.mark.parametrize(("kind", "tp", "pp", "ep"), LAYOUTS, ids=[f"{k}-tp{t}-pp{p}-ep{e}" for k, t, p, e in LAYOUTS])
def test_parallel_layout_holds_what_vllms_own_loader_puts_on_each_rank(
    engine: Engine, tiny, traced, tmp_path, kind: str, tp: int, pp: int, ep: int
):
    out, _ = traced(kind, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep))
    manifest = Manifest.read(out)
    assert (manifest.tp_size, manifest.pp_size, manifest.ep_size) == (tp, pp, ep)
    names = sorted(f.path for files in manifest.ranks.values() for f in files)
    if pp > 1:  # vLLM's sharded_state names, which its loader globs for
        assert all(n.startswith("model-pp-") and "-tp-" in n for n in names), names
    theirs = engine.state_values(tiny[kind], tmp_path / "vllm", tp=tp, pp=pp, ep=ep)
    assert sorted(theirs) == list(range(tp * pp))
    for rank, path in theirs.items():
        assert_same_state(rank_state(out, rank), load_file(str(path)), f"{kind} tp={tp} pp={pp} ep={ep} rank {rank}")
    if ep > 1:  # an expert-parallel rank holds (so reads) only its own experts: experts / ep of each stacked tensor
        experts = json.loads((tiny[kind] / "config.json").read_text())
        experts = experts.get("num_local_experts") or experts.get("num_experts") or experts["n_routed_experts"]
        for rank in range(tp * pp):
            stacked = [t for n, t in rank_state(out, rank).items() if ".experts." in n and t.dim() == 3]
            assert stacked and all(t.shape[0] == experts // ep for t in stacked), (rank, [t.shape for t in stacked])
    if (kind, tp, pp, ep) in (("mixtral", 1, 2, 1), ("mixtral", 2, 1, 2)):
        # The files through vLLM's own sharded_state loader, and through gdsload's load format, each rank its own.
        for load_format in ("sharded_state", "gdsload"):
            from_files = engine.state_values(out, tmp_path / load_format, tp=tp, pp=pp, ep=ep, load_format=load_format)
            assert sorted(from_files) == list(range(tp * pp))
            for rank, path in from_files.items():
                assert_same_state(
                    load_file(str(path)),
                    load_file(str(theirs[rank])),
                    f"load format {load_format} on {kind} tp={tp} pp={pp} ep={ep}, rank {rank}",
                )


def test_llamas_traced_layout_equals_the_builtin_rules(traced, made):
    """With vLLM the Llama layout comes from vLLM's code, without it from gdsload's rules: the same tensors."""
    for flags in (("--tp", "2"), ("--tp", "2", "--quantize", "fp8:per-channel")):
        from_vllm, _ = traced("llama-kv1", *flags)
        from_rules = made("llama-kv1", *flags)
        assert Manifest.read(from_rules).extra["shard"]["layout_from"] == "builtin rules"
        for rank in range(2):
            assert_same_state(
                rank_state(from_vllm, rank), rank_state(from_rules, rank), f"llama-kv1 {flags} rank {rank}"
            )


FP8_CASES = [
    ("mixtral", "fp8", 2, 1, 1),
    ("qwen3-moe", "fp8:per-channel", 2, 1, 1),
    ("deepseek-v2", "fp8", 1, 1, 1),
    ("mixtral", "fp8", 1, 2, 1),
    ("mixtral", "fp8", 2, 1, 2),
]


@pytest.mark.parametrize(
    ("kind", "quant", "tp", "pp", "ep"), FP8_CASES, ids=[f"{k}-{q}-tp{t}-pp{p}-ep{e}" for k, q, t, p, e in FP8_CASES]
)
def test_fp8_moe_files_hold_exactly_vllms_fp8_state_dict(
    engine: Engine, traced, kind: str, quant: str, tp: int, pp: int, ep: int
):
    """Experts included: names, shapes and dtypes of every rank against the state dict vLLM builds for the
    quantized config, pipeline- and expert-parallel layouts too (the CPU build cannot run FP8 MoE kernels)."""
    out, result = traced(kind, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--quantize", quant)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] in ("fp8", "compressed-tensors")
    theirs = engine.state_dict(out, tp, pp, ep)
    assert sorted(theirs) == list(range(tp * pp))
    for rank in range(tp * pp):
        ours = {
            n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for n, t in rank_state(out, rank).items()
        }
        assert ours == theirs[rank], f"rank {rank}: {sorted(set(ours) ^ set(theirs[rank]))[:6]}"
        experts = [n for n, v in ours.items() if "experts" in n and v["dtype"] == "float8_e4m3fn"]
        assert experts, "the experts must be quantized too"


def test_moe_layout_compressed_with_zstd_loads_bit_exact(traced):
    """--compress on an expert-parallel layout: every rank decodes to the uncompressed layout's bytes."""
    from gdsload.loader import load_rank

    plain, _ = traced("mixtral", "--tp", "2", "--ep", "2")
    packed, result = traced("mixtral", "--tp", "2", "--ep", "2", "--compress", "zstd")
    assert result["compression"]["codec"] == "zstd" and Manifest.read(packed).ep_size == 2
    for rank in range(2):
        loaded = load_rank(packed, rank)
        assert_same_state(dict(loaded.tensors), rank_state(plain, rank), f"zstd rank {rank}")
        loaded.close()
