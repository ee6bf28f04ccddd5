"""``gdsload shard``: tiny transformers models sharded at tp=1,2,4, reassembled, compared bit for bit.

The reference is transformers itself: each model is built with random weights (norms and biases
included, so a wrong split can't hide behind ones and zeros), saved with ``save_pretrained`` as
a multi-file safetensors checkpoint, and its logits are the oracle for the reassembled weights.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch

from gdsload.loader.errors import UnfinishedOutputError
from gdsload.loader import GdsloadError, Manifest, NoFilesForRankError, discover, load_rank, read_header
from gdsload.loader.format import atomic, writer as fmt
from gdsload.loader.errors import ConfigError
from gdsload.loader.prepare.shard import (
    PARTIAL_DIR,
    SourceCheckpointError,
    OutputExistsError,
    ShardConfigError,
    ShardOptions,
    ShardWriteError,
    SourceNotFoundError,
    SourceReadError,
    UnsupportedModelError,
    UnsupportedSourceError,
    execute_plan,
    plan_shard,
    shard_checkpoint,
)

transformers = pytest.importorskip("transformers")

# name -> (config class, config kwargs). Sizes make every rule fire somewhere: GQA with fewer KV
# heads than tp (replication), MQA, KV heads split evenly, tied and untied embeddings, vocabularies
# that are not multiples of 64 (padding), explicit head_dim != hidden/heads, all bias kinds.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-tied": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=1000,
            tie_word_embeddings=True,
        ),
    ),
    "llama-bias-untied": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_hidden_layers=2,
            vocab_size=1000,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    "mistral-mqa": (
        "MistralConfig",
        dict(
            hidden_size=48,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            num_hidden_layers=2,
            vocab_size=700,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2-tied": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=1000,
            tie_word_embeddings=True,
        ),
    ),
}
TOKENS = torch.tensor([[1, 5, 99, 650, 42, 3, 299, 17]])  # < every vocab_size


def build_model(kind: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A transformers model of ``kind`` with every parameter random (seeded)."""
    cls_name, kwargs = MODELS[kind]
    config = getattr(transformers, cls_name)(max_position_embeddings=64, attn_implementation="eager", **kwargs)
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    torch.manual_seed(sum(map(ord, kind)))
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p, dtype=torch.float32))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p, dtype=torch.float32))
            else:
                p.copy_(0.05 * torch.randn_like(p, dtype=torch.float32))
    return model


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def source_tensors(src: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(str(f)))
    return out


def model_from(kind: str, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> Any:
    """A fresh model of ``kind`` with exactly ``state`` as its weights (tied lm_head follows embed)."""
    model = build_model(kind, dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """kind -> (HF checkpoint directory, reference logits). Multi-file, with tokenizer files."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in MODELS:
        model = build_model(kind)
        path = root / kind
        model.save_pretrained(path, max_shard_size="60KB")
        (path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
        (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
        (path / "pytorch_model.bin.md").write_text("not copied")
        out[kind] = (path, logits(model))
    return out


def read_rank(out: Path, rank: int) -> dict[str, torch.Tensor]:
    """One rank through the reference reader (safetensors), not ours."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob(f"model-rank-{rank}-part-*.safetensors")):
        tensors.update(safetensors.torch.load_file(str(f)))
    return tensors


def reassemble(out: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Rebuild every source tensor from the rank files, following the recipes the plan wrote them from.

    The plan is made again from the source and the options the manifest records; each part's piece of
    a rank tensor goes back to its region of the source. Checks on the way: every element is covered,
    replicas agree, filled regions (vocabulary padding) hold their constant. FP8 weights come back
    dequantized to fp32, with the scales the ``*_scale`` tensors hold.
    """
    manifest = Manifest.read(out)
    rec = manifest.extra["shard"]
    options = ShardOptions(
        tp=rec["tp"],
        pp=rec.get("pp", 1),
        ep=rec.get("ep", 1),
        layout=rec["layout"],
        quantize=rec["quantize"],
        max_file_bytes=rec["max_file_bytes"],
    )
    plan = plan_shard(rec["source"], options)
    results = [load_rank(out, r) for r in range(manifest.world_size)]  # kept: the tensors are views of their arenas
    loaded = [r.tensors for r in results]
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    per_channel = options.scheme is not None and options.scheme.per_channel
    for f in plan.files:
        for recipe in f.tensors:
            t = loaded[f.rank][recipe.name]
            for part in recipe.parts:
                piece = torch.as_strided(t, part.dst.shape, part.dst.strides, t.storage_offset() + part.dst.offset)
                if part.kind == "fill":
                    assert (piece.float() == part.value).all(), f"{recipe.name} rank {f.rank}: fill not {part.value}"
                    continue
                if part.kind == "scale":
                    shape = (shapes[part.source][0], 1) if per_channel else ()
                    v = scales.setdefault(part.source, torch.full(shape, float("nan")))
                    torch.as_strided(v, part.src.shape, part.src.strides, part.src.offset).copy_(piece)
                    continue
                src = part.source
                if src not in full:
                    full[src] = torch.zeros(shapes[src], dtype=piece.dtype)
                    seen[src] = torch.zeros(shapes[src], dtype=torch.bool)
                region = torch.as_strided(full[src], part.src.shape, part.src.strides, part.src.offset)
                mask = torch.as_strided(seen[src], part.src.shape, part.src.strides, part.src.offset)
                prev = mask.clone()
                assert torch.equal(region[prev].float(), piece[prev].float()), (
                    f"replicas of {src} differ (rank {f.rank})"
                )
                region.copy_(piece)
                mask.fill_(True)
    for src, mask in seen.items():
        assert mask.all(), f"{src}: not every element was written by some rank"
    for src, scale in scales.items():
        assert not scale.isnan().any(), f"{src}: not every scale was written"
        full[src] = full[src].float() * scale
    return full


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_layout_reassembles_to_identical_logits(checkpoints, tmp_path, kind, tp):
    src, ref_logits = checkpoints[kind]
    result = shard_checkpoint(src, tmp_path / "out", tp=tp, layout="hf", max_file_bytes=40_000)
    assert result.total_bytes > 0 and not result.resumed_files
    original = source_tensors(src)
    rebuilt = reassemble(tmp_path / "out", {k: tuple(v.shape) for k, v in original.items()})
    assert rebuilt.keys() == original.keys()
    for name, t in original.items():
        assert rebuilt[name].dtype == t.dtype and torch.equal(rebuilt[name], t), name
    assert torch.equal(logits(model_from(kind, rebuilt)), ref_logits)


def vllm_expected(kind: str, tp: int, quant: bool = False) -> dict[str, tuple[int, ...]]:
    """vLLM's per-rank parameter names and shapes for these models, written out independently."""
    cfg = MODELS[kind][1]
    h, heads, kv, inter = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
    )
    d = cfg.get("head_dim", h // heads)
    vp = -(-cfg["vocab_size"] // 64) * 64
    qkv_rows = (heads // tp + 2 * max(1, kv // tp)) * d
    qkv_bias = kind.startswith("qwen2") or cfg.get("attention_bias", False)
    out: dict[str, tuple[int, ...]] = {"lm_head.weight": (vp // tp, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        out["model.embed_tokens.weight"] = (vp // tp, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.qkv_proj.weight": (qkv_rows, h),
            p + "self_attn.o_proj.weight": (h, heads // tp * d),
            p + "mlp.gate_up_proj.weight": (2 * inter // tp, h),
            p + "mlp.down_proj.weight": (h, inter // tp),
        }
        if qkv_bias:
            out[p + "self_attn.qkv_proj.bias"] = (qkv_rows,)
        if cfg.get("attention_bias", False):
            out[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.get("mlp_bias", False):
            out[p + "mlp.gate_up_proj.bias"] = (2 * inter // tp,)
            out[p + "mlp.down_proj.bias"] = (h,)
        for s in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):  # vLLM's attention buffers
            out[p + "self_attn.attn." + s] = ()
        if quant:
            for s in ("q_scale", "k_scale", "v_scale", "prob_scale"):
                out[p + "self_attn.attn." + s] = ()
            out[p + "self_attn.qkv_proj.weight_scale"] = (3,)
            out[p + "self_attn.o_proj.weight_scale"] = (1,)
            out[p + "mlp.gate_up_proj.weight_scale"] = (2,)
            out[p + "mlp.down_proj.weight_scale"] = (1,)
    return out


def unfuse_vllm(kind: str, tp: int, ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """HF tensors from vLLM-layout ranks, by vLLM's rules (not by our manifest)."""
    cfg = MODELS[kind][1]
    h, heads, kv, inter = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
    )
    d = cfg.get("head_dim", h // heads)
    q_rows, kv_rows = heads // tp * d, max(1, kv // tp) * d
    replicas = max(1, tp // kv)
    out: dict[str, torch.Tensor] = {}
    vocab = cfg["vocab_size"]
    lm = torch.cat([r["lm_head.weight"] for r in ranks])
    assert not lm[vocab:].float().any(), "vocab padding rows must be zero"
    out["lm_head.weight"] = lm[:vocab]
    if not cfg["tie_word_embeddings"]:
        out["model.embed_tokens.weight"] = torch.cat([r["model.embed_tokens.weight"] for r in ranks])[:vocab]
    else:
        out["model.embed_tokens.weight"] = out.pop("lm_head.weight")
    for name in ranks[0]:
        if "norm" in name or name.endswith(("o_proj.bias", "down_proj.bias")):
            assert all(torch.equal(r[name], ranks[0][name]) for r in ranks), f"{name} must be replicated"
            out[name] = ranks[0][name]
    for i in range(cfg["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for suffix in ("weight", "bias"):
            if a + "qkv_proj." + suffix not in ranks[0]:
                continue
            parts = [r[a + "qkv_proj." + suffix].split([q_rows, kv_rows, kv_rows]) for r in ranks]
            out[a + "q_proj." + suffix] = torch.cat([p[0] for p in parts])
            for j, x in ((1, "k"), (2, "v")):
                # rank r holds KV head group r // replicas; every replica must be identical
                groups = [parts[g * replicas][j] for g in range(tp // replicas)]
                for r in range(tp):
                    assert torch.equal(parts[r][j], groups[r // replicas]), f"{x} replica on rank {r}"
                out[a + f"{x}_proj." + suffix] = torch.cat(groups)
        out[a + "o_proj.weight"] = torch.cat([r[a + "o_proj.weight"] for r in ranks], dim=1)
        for suffix in ("weight", "bias"):
            if m + "gate_up_proj." + suffix in ranks[0]:
                parts = [r[m + "gate_up_proj." + suffix].split([inter // tp] * 2) for r in ranks]
                out[m + "gate_proj." + suffix] = torch.cat([p[0] for p in parts])
                out[m + "up_proj." + suffix] = torch.cat([p[1] for p in parts])
        out[m + "down_proj.weight"] = torch.cat([r[m + "down_proj.weight"] for r in ranks], dim=1)
    return out


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_layout_names_shapes_and_unfused_originals(checkpoints, tmp_path, kind, tp):
    src, ref_logits = checkpoints[kind]
    shard_checkpoint(src, tmp_path / "out", tp=tp, layout="vllm")
    ranks = [read_rank(tmp_path / "out", r) for r in range(tp)]
    expected = vllm_expected(kind, tp)
    for r, tensors in enumerate(ranks):
        assert {k: tuple(v.shape) for k, v in tensors.items()} == expected, f"rank {r}"
    original = source_tensors(src)
    rebuilt = unfuse_vllm(kind, tp, ranks)
    assert rebuilt.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(rebuilt[name], t), name
    assert torch.equal(logits(model_from(kind, rebuilt)), ref_logits)


def test_vllm_files_follow_the_sharded_state_pattern_and_alignment(checkpoints, tmp_path):
    src, _ = checkpoints["llama-bias-untied"]
    result = shard_checkpoint(src, tmp_path / "out", tp=2, max_file_bytes=30_000)
    assert all(len(files) > 1 for files in result.files.values()), "small max_file_bytes must split parts"
    for rank, files in result.files.items():
        assert files == [f"model-rank-{rank}-part-{p}.safetensors" for p in range(len(files))]
        for name in files:
            header = read_header(tmp_path / "out" / name)
            assert header.data_aligned and not header.misaligned()
            if len(header.tensors) > 1:
                assert header.data_len <= 30_000, name
            assert header.metadata["format"] == "pt"
    # discovery without the manifest sees what vLLM's glob sees
    (tmp_path / "out" / "gdsload.json").rename(tmp_path / "manifest.json")
    found = discover(tmp_path / "out", rank=1)
    assert found.source == "vllm" and found.tp_size == 2 and len(found.files) == len(result.files[1])


def test_manifest_records_the_layout_and_aux_files_are_copied(checkpoints, tmp_path):
    src, _ = checkpoints["llama-gqa-tied"]
    import gdsload.loader.format.digests as digests_mod

    hashed: list[str] = []
    real_digest = digests_mod.file_digest

    def once(path, *a):  # the writer hashes each finished file once (before its rename); the manifest does not
        hashed.append(os.path.basename(path))
        return real_digest(path, *a)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(digests_mod, "file_digest", once)
        shard_checkpoint(src, tmp_path / "out", tp=4, layout="hf")
    out = tmp_path / "out"
    assert all(".tmp-" in h for h in hashed) and len(hashed) == len(set(hashed)) == len(list(out.glob("*.safetensors")))
    manifest = Manifest.read(out)
    shard = manifest.extra["shard"]
    assert manifest.layout == "hf" and manifest.tp_size == 4 and manifest.pp_size == 1 and manifest.world_size == 4
    assert shard["architecture"] == "LlamaForCausalLM" and shard["layout_from"] == "builtin rules"
    assert shard["quantize"] is None and shard["source"] == str(src.resolve())
    assert shard["parallel"]["world"] == 4 and shard["parallel"]["ranks"]["3"] == {"pp_rank": 0, "tp_rank": 3}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert not (out / "pytorch_model.bin.md").exists() and not (out / PARTIAL_DIR).exists()
    assert all(f.digest == digests_mod.file_digest(out / f.path) for fs in manifest.ranks.values() for f in fs)
    load_rank(out, 3, verify=True)


def test_writer_factory_sees_every_tensor_in_writer_order(checkpoints, tmp_path):
    """The hook a compressing writer plugs into: one call per tensor, after slicing/quantizing."""
    src, _ = checkpoints["qwen2-tied"]
    seen: list[tuple[str, torch.dtype]] = []

    class Recording(fmt.AlignedWriter):
        def write(self, name: str, tensor: torch.Tensor) -> None:
            seen.append((name, tensor.dtype))
            super().write(name, tensor)

    plan = plan_shard(src, ShardOptions(tp=2, quantize="fp8"))
    execute_plan(plan, tmp_path / "out", writer_factory=Recording)
    assert len(seen) == sum(len(f.specs) for f in plan.files)
    assert ("model.layers.0.self_attn.qkv_proj.weight", torch.float8_e4m3fn) in seen
    assert ("model.layers.0.self_attn.qkv_proj.bias", torch.bfloat16) in seen


# --------------------------------------------------------------------------- bad input


def _fails(fn: Any, exc: type[BaseException], *fragments: str) -> BaseException:
    with pytest.raises(exc) as info:
        fn()
    assert isinstance(info.value, GdsloadError)
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))
    return info.value


def test_tp_not_dividing_heads_names_the_numbers(checkpoints, tmp_path):
    src, _ = checkpoints["llama-gqa-tied"]
    _fails(
        lambda: shard_checkpoint(src, tmp_path / "out", tp=3),
        ShardConfigError,
        "tp=3",
        "num_attention_heads=8 is not divisible by tp=3",
        "tp=3 is not a multiple of num_key_value_heads=2",
        "TP sizes that work for this model: 1, 2, 4, 8",
        "config.json",
    )
    src, _ = checkpoints["llama-bias-untied"]  # 8 heads, 4 KV heads: tp=8 would need 8/4=2 replicas: fine
    _fails(
        lambda: shard_checkpoint(src, tmp_path / "out", tp=16),
        ShardConfigError,
        "num_attention_heads=8 is not divisible by tp=16",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", ["vllm", "hf"])
def test_a_rank_past_the_vocabulary_holds_padding_only(tmp_path, layout):
    # vocab 130 at tp=4 pads to 192 rows, 48 per rank: rank 3 starts at row 144, past the last real row
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=1,
        vocab_size=130,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    shard_checkpoint(tmp_path / "src", tmp_path / "out", tp=4, layout=layout)
    src = source_tensors(tmp_path / "src")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        parts = [read_rank(tmp_path / "out", r)[name] for r in range(4)]
        rows = torch.cat(parts)
        if layout == "vllm":  # vLLM's padded vocabulary: 48 rows on every rank
            assert rows.shape == (192, 64) and torch.equal(rows[:130], src[name]) and not rows[130:].any()
        else:  # the real rows of each range only: rank 3's range starts past the vocabulary
            assert [p.shape[0] for p in parts] == [48, 48, 34, 0] and torch.equal(rows, src[name])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(checkpoints, tmp_path):
    bad = _copy(checkpoints["llama-gqa-tied"][0], tmp_path / "gpt2")
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (bad / "config.json").write_text(json.dumps(cfg))
    _fails(
        lambda: shard_checkpoint(bad, tmp_path / "out", tp=2),
        UnsupportedModelError,
        "'GPT2LMHeadModel'",
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
        str(bad / "config.json"),
    )
    cfg.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"},
    )
    (bad / "config.json").write_text(json.dumps(cfg))
    _fails(lambda: shard_checkpoint(bad, tmp_path / "out", tp=2), UnsupportedModelError, "already quantized")
    assert not (tmp_path / "out").exists()


def _drop_tensor(ckpt: Path, name: str) -> str:
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors = safetensors.torch.load_file(str(f))
        if name in tensors:
            del tensors[name]
            safetensors.torch.save_file(tensors, str(f), metadata={"format": "pt"})
            return f.name
    raise AssertionError(name)


def test_missing_tensor_and_missing_shard_file(checkpoints, tmp_path):
    bad = _copy(checkpoints["llama-bias-untied"][0], tmp_path / "missing")
    _drop_tensor(bad, "model.layers.1.mlp.up_proj.weight")
    _fails(
        lambda: shard_checkpoint(bad, tmp_path / "out", tp=2),
        SourceCheckpointError,
        "'model.layers.1.mlp.up_proj.weight'",
        "lacks 1 tensor",
        "incomplete",
    )
    gone = sorted(bad.glob("model-*.safetensors"))[-1]
    gone.unlink()
    err = _fails(
        lambda: shard_checkpoint(bad, tmp_path / "out", tp=2),
        SourceNotFoundError,
        repr(gone.name),
        "model.safetensors.index.json",
        "download is incomplete",
    )
    assert isinstance(err, FileNotFoundError)
    assert not (tmp_path / "out").exists()


def test_index_names_the_weight_files_and_a_bad_index_is_typed(checkpoints, tmp_path):
    src = _copy(checkpoints["mistral-mqa"][0], tmp_path / "src")
    # Mistral repositories ship consolidated.safetensors beside the shards the index names: it is not read.
    safetensors.torch.save_file({"norm.weight": torch.ones(4)}, str(src / "consolidated.safetensors"))
    assert shard_checkpoint(src, tmp_path / "out", tp=2).files
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    for weight_map in ([list(doc["weight_map"])], {"model.norm.weight": 3}, {"model.norm.weight": "../x.safetensors"}):
        index.write_text(json.dumps({**doc, "weight_map": weight_map}))
        _fails(
            lambda: shard_checkpoint(src, tmp_path / "out2", tp=2),
            SourceCheckpointError,
            "'weight_map' must map tensor names to file names",
            str(index),
        )
    assert not (tmp_path / "out2").exists()


def test_inf_weight_refuses_fp8_naming_the_tensor(checkpoints, tmp_path):
    src = _copy(checkpoints["llama-gqa-tied"][0], tmp_path / "src")
    name = "model.layers.0.mlp.down_proj.weight"
    for f in sorted(src.glob("*.safetensors")):
        tensors = safetensors.torch.load_file(str(f))
        if name in tensors:
            tensors[name][0, 0] = float("inf")
            safetensors.torch.save_file(tensors, str(f), metadata={"format": "pt"})
            break
    _fails(
        lambda: shard_checkpoint(src, tmp_path / "out", tp=2, quantize="fp8"),
        SourceCheckpointError,
        repr(name),
        "inf or NaN",
        "without --quantize",
    )
    assert not (tmp_path / "out").exists()
    assert shard_checkpoint(src, tmp_path / "plain", tp=2).files  # unquantized, the values are copied as they are


def test_zero_head_counts_in_config_are_refused(checkpoints, tmp_path):
    src = _copy(checkpoints["llama-gqa-tied"][0], tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    for key, words in (("num_key_value_heads", "num_key_value_heads=0"), ("head_dim", "head_dim must be a positive")):
        (src / "config.json").write_text(json.dumps({**cfg, key: 0}))
        _fails(lambda: shard_checkpoint(src, tmp_path / "out", tp=1), UnsupportedModelError, words)
    (src / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10**9}))  # refused at once, not counted
    _fails(
        lambda: shard_checkpoint(src, tmp_path / "out", tp=1, layout="hf"),
        UnsupportedModelError,
        "num_hidden_layers=1000000000",
        "the config is damaged",
    )
    (src / "config.json").write_text(json.dumps({**cfg, "head_dim": None}))  # as some configs write it: the default
    assert shard_checkpoint(src, tmp_path / "out", tp=1).files
    with pytest.raises(ConfigError, match="must be a string"):
        shard_checkpoint(src, tmp_path / "q", tp=1, quantize=True)  # type: ignore[arg-type]


def test_shape_mismatch_names_tensor_and_config(checkpoints, tmp_path):
    bad = _copy(checkpoints["mistral-mqa"][0], tmp_path / "wrong")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    _fails(
        lambda: shard_checkpoint(bad, tmp_path / "out", tp=2),
        SourceCheckpointError,
        "'model.layers.0.mlp.gate_proj.weight' has shape [64, 48]",
        "implies [128, 48]",
        "intermediate_size=128",
    )


def test_non_safetensors_sources(tmp_path, checkpoints):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(checkpoints["llama-gqa-tied"][0] / "config.json", pickled)
    torch.save({"w": torch.zeros(2)}, pickled / "pytorch_model.bin")
    err = _fails(
        lambda: shard_checkpoint(pickled, tmp_path / "out", tp=1),
        UnsupportedSourceError,
        "'pytorch_model.bin'",
        "reads only safetensors",
        "save_pretrained",
    )
    assert isinstance(err, ValueError)
    _fails(lambda: shard_checkpoint(tmp_path / "nope", tmp_path / "out", tp=1), SourceNotFoundError, "does not exist")
    (pickled / "config.json").unlink()
    _fails(lambda: shard_checkpoint(pickled, tmp_path / "out", tp=1), SourceNotFoundError, "has no config.json")
    assert not (tmp_path / "out").exists()


def test_source_vanishing_after_planning_is_a_typed_error(checkpoints, tmp_path):
    src = _copy(checkpoints["llama-gqa-tied"][0], tmp_path / "src")
    plan = plan_shard(src, ShardOptions(tp=2))
    victim = sorted(src.glob("model-*.safetensors"))[1]
    victim.unlink()
    err = _fails(
        lambda: execute_plan(plan, tmp_path / "out"),
        SourceReadError,
        "the source changed or became unreadable since planning",
    )
    assert isinstance(err, OSError) and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- output directory, disk, kills


class _FullDisk:
    """A file whose writes fail with ENOSPC once a byte budget shared by all files is spent."""

    budget: int = 0
    lock = threading.Lock()

    def __init__(self, f: Any):
        self._f = f

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        with _FullDisk.lock:
            if n > _FullDisk.budget:
                self._f.write(memoryview(data).cast("B")[: _FullDisk.budget])
                _FullDisk.budget = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            _FullDisk.budget -= n
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _bytes_written(src: Path, out: Path, **kw: Any) -> int:
    shard_checkpoint(src, out, **kw)
    return sum(p.stat().st_size for p in out.iterdir())


@pytest.mark.parametrize("fraction, stage", [(0.0, "state.json"), (0.3, "(tensor '"), (0.999, "gdsload.json")])
@pytest.mark.parametrize("out_exists", [False, True])
def test_full_disk_is_a_typed_error_and_leaves_nothing(checkpoints, tmp_path, monkeypatch, fraction, stage, out_exists):
    src, _ = checkpoints["llama-gqa-tied"]
    kw = dict(tp=2, layout="vllm", quantize="fp8", max_file_bytes=20_000)
    total = _bytes_written(src, tmp_path / "reference", **kw)
    enter = atomic.atomic_output.__enter__
    monkeypatch.setattr(atomic.atomic_output, "__enter__", lambda self: _FullDisk(enter(self)))
    real_pwrite = os.pwrite  # AlignedWriter writes tensors in place, from its threads

    def pwrite(fd: int, data: Any, offset: int) -> int:
        with _FullDisk.lock:
            n = min(memoryview(data).nbytes, _FullDisk.budget)
            if n == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            _FullDisk.budget -= n
        return real_pwrite(fd, memoryview(data).cast("B")[:n], offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    _FullDisk.budget = int(total * fraction)
    out = tmp_path / "out"
    if out_exists:
        out.mkdir()
    err = _fails(
        lambda: shard_checkpoint(src, out, **kw), ShardWriteError, "No space left on device", "free space", stage
    )
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and str(out) in str(err)
    if out_exists:
        assert list(out.iterdir()) == []
    else:
        assert not out.exists()


def test_non_empty_out_is_refused_and_left_alone(checkpoints, tmp_path):
    src, _ = checkpoints["llama-gqa-tied"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _fails(lambda: shard_checkpoint(src, out, tp=2), OutputExistsError, "is not empty", "'notes.txt'")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    _fails(lambda: shard_checkpoint(src, tmp_path / "file", tp=2), OutputExistsError, "is a file")


class _Interrupt:
    """A progress callback that raises KeyboardInterrupt once ``after`` bytes are reported."""

    def __init__(self, after: int):
        self.after, self.seen = after, 0

    def __call__(self, n: int) -> None:
        self.seen += n
        if self.seen >= self.after:
            raise KeyboardInterrupt


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name.endswith(".safetensors") or name == "config.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_interrupted_run_resumes_and_matches_a_clean_run(checkpoints, tmp_path):
    src, _ = checkpoints["qwen2-tied"]
    kw = dict(tp=4, layout="vllm", quantize="fp8:per-channel", max_file_bytes=30_000)
    clean = shard_checkpoint(src, tmp_path / "clean", **kw)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        shard_checkpoint(src, out, progress=_Interrupt(clean.total_bytes // 2), **kw)
    assert [p.name for p in out.iterdir()] == [PARTIAL_DIR], "no output may appear before the run completes"
    with pytest.raises(UnfinishedOutputError, match="unfinished|not finished"):
        discover(out, 0)
    kept = [p for p in (out / PARTIAL_DIR).glob("model-rank-*.safetensors")]
    assert kept
    # a different command may not take the partial run over
    _fails(
        lambda: shard_checkpoint(src, out, **{**kw, "tp": 2}),
        OutputExistsError,
        "unfinished `gdsload shard` run of a different command",
        "tp=4 (now 2)",
    )
    resumed = shard_checkpoint(src, out, **kw)
    assert resumed.resumed_files == len(kept) and resumed.written_bytes < clean.total_bytes
    assert (
        resumed.written_bytes
        + sum(
            f.nbytes
            for f in plan_shard(src, ShardOptions(**kw)).files
            if (out / f.relpath).name in {k.name for k in kept}
        )
        == clean.total_bytes
    )
    _same_files(out, tmp_path / "clean")
    again = shard_checkpoint(src, out, **kw)
    assert again.already_complete and again.written_bytes == 0 and "nothing to do" in again.summary()
    _fails(
        lambda: shard_checkpoint(src, out, **{**kw, "layout": "hf"}),
        OutputExistsError,
        "already holds a sharded checkpoint",
        "layout='vllm' (now 'hf')",
    )


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from gdsload.loader.prepare.shard import shard_checkpoint
    seen = 0
    def progress(n):
        global seen
        seen += n
        if seen >= int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)
    shard_checkpoint(sys.argv[1], sys.argv[2], tp=2, layout="hf", max_file_bytes=50_000, progress=progress)
""")


def test_partial_dir_without_state_is_taken_over(checkpoints, tmp_path):
    """Killed between creating its directory and writing state.json: nothing to keep, nothing to refuse."""
    src, _ = checkpoints["mistral-mqa"]
    out = tmp_path / "out"
    (out / PARTIAL_DIR).mkdir(parents=True)
    (out / PARTIAL_DIR / ".lock").touch()
    result = shard_checkpoint(src, out, tp=2)
    assert not result.resumed_files and (out / "gdsload.json").exists() and not (out / PARTIAL_DIR).exists()


def test_a_run_killed_while_writing_its_manifest_resumes(checkpoints, tmp_path):
    src, _ = checkpoints["mistral-mqa"]
    out = tmp_path / "out"
    (out / PARTIAL_DIR).mkdir(parents=True)
    (out / ".gdsload.json.tmp-99999").write_text("{")  # the manifest's temporary file of a killed run
    shard_checkpoint(src, out, tp=2)
    assert (out / "gdsload.json").exists() and not list(out.glob(".gdsload.json.tmp-*"))


def test_sigkill_mid_file_then_rerun_resumes(checkpoints, tmp_path):
    src, _ = checkpoints["llama-bias-untied"]
    clean = shard_checkpoint(src, tmp_path / "clean", tp=2, layout="hf", max_file_bytes=50_000)
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-c", _KILL_SCRIPT, str(src), str(out), str(int(clean.total_bytes * 0.6))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr
    partial = out / PARTIAL_DIR
    assert [x.name for x in out.iterdir()] == [PARTIAL_DIR]
    assert list(partial.glob(".model-rank-*.tmp-*")), "the kill should land inside a file"
    resumed = shard_checkpoint(src, out, tp=2, layout="hf", max_file_bytes=50_000)
    assert resumed.resumed_files >= 1
    assert not partial.exists()
    _same_files(out, tmp_path / "clean")


def test_cli_shard_prints_summary_and_one_line_errors(checkpoints, tmp_path, monkeypatch, capsys):
    from gdsload.server import cli

    monkeypatch.setitem(cli._LAZY_COMMANDS, "shard", "gdsload.server.cmd_shard:shard")
    src, _ = checkpoints["mistral-mqa"]
    out = tmp_path / "out"
    cli.main(
        [
            "shard",
            str(src),
            str(out),
            "--tp",
            "2",
            "--layout",
            "hf",
            "--quantize",
            "fp8:per-channel",
            "--max-file-size",
            "20KiB",
            "--no-progress",
            "--json",
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["tp"] == 2 and doc["quantize"] == "fp8:per-channel" and len(doc["files"]["0"]) > 1
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["shard", str(src), str(tmp_path / "o3"), "--tp", "3"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.startswith("error: ") and "tp=3" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        cli.main(["shard", str(src), str(tmp_path / "o4"), "--tp", "2", "--quantize", "int4"])
    assert "use fp8, fp8:per-tensor or fp8:per-channel" in capsys.readouterr().err


def test_shard_with_compress_writes_compressed_shards_that_load_bit_exact(tmp_path):
    """`gdsload shard --compress zstd`: shards, then compresses into OUT; the loaded tensors match the plain shards."""
    import subprocess
    import sys

    import torch

    from gdsload.loader import load_rank
    from gdsload.loader.prepare.synthetic import PRESETS, make_checkpoint

    src = tmp_path / "hf"
    make_checkpoint(src, PRESETS["tiny"], tp=1)
    # make_checkpoint writes rank files; an HF source has model*.safetensors + config.json
    for f in src.glob("model-rank-*.safetensors"):
        f.rename(src / "model.safetensors")
    (src / "gdsload.json").unlink()
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    for out, extra in ((plain, []), (packed, ["--codec", "zstd"])):
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "gdsload.server.cli",
                "shard",
                str(src),
                str(out),
                "--tp",
                "2",
                "--progress",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr
    assert "compressed with zstd" in p.stdout and f"sharded -> {str(packed)!r}" in p.stdout
    assert "shard (" in p.stderr and "compress (zstd)" in p.stderr, p.stderr  # both halves show their progress
    assert sorted(x.name for x in tmp_path.iterdir()) == ["hf", "packed", "plain"]  # no partial dirs left
    from gdsload.loader.format.digests import file_digest
    from gdsload.loader.format.manifest import Manifest

    packed_files = [f for fs in Manifest.read(packed).ranks.values() for f in fs]  # digests of what is there
    assert len(packed_files) == 2 and all(f.digest == file_digest(packed / f.path) for f in packed_files)
    # The same command again: its output is there, nothing to do; a run stopped after its compressed output
    # appeared left the uncompressed shards beside it, and they go.
    shutil.copytree(plain, tmp_path / ".packed.uncompressed")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gdsload.server.cli",
            "shard",
            str(src),
            str(packed),
            "--tp",
            "2",
            "--no-progress",
            "--compress",
            "zstd",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and "nothing to do" in p.stdout, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["hf", "packed", "plain"]
    # Another command into the same OUT is refused before any sharding work, leaving nothing behind.
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gdsload.server.cli",
            "shard",
            str(src),
            str(packed),
            "--tp",
            "1",
            "--no-progress",
            "--compress",
            "zstd",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0 and "already exists" in p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["hf", "packed", "plain"]
    for rank in (0, 1):
        a, b = load_rank(plain, rank), load_rank(packed, rank)
        assert b.report.stored_bytes < a.report.stored_bytes
        for k, v in a.tensors.items():
            assert torch.equal(v.reshape(-1).view(torch.uint8), b.tensors[k].reshape(-1).view(torch.uint8)), k


# A kill at each commit point (every rename of a shard or compress run), then a load and a rerun.
_KILL_AT_RENAME = textwrap.dedent("""
    import os, signal, sys
    k = int(sys.argv[1])
    calls = [0]
    def dying(real):
        def call(*a, **kw):
            calls[0] += 1
            if calls[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **kw)
        return call
    os.replace, os.rename = dying(os.replace), dying(os.rename)
    from gdsload.server.cli import main
    main(sys.argv[2:])
""")


@pytest.mark.parametrize("command", ["shard", "compress"])
def test_a_kill_at_any_rename_leaves_nothing_that_loads_and_a_rerun_recovers(checkpoints, tmp_path, command):
    import time

    from gdsload.loader import load_rank
    from gdsload.loader.format.atomic import remove_dead_leftovers

    src, _ = checkpoints["llama-bias-untied"]
    if command == "shard":
        argv = lambda out: ["shard", str(src), str(out), "--tp", "2", "--max-file-size", "100KiB", "--no-progress"]  # noqa: E731
    else:
        sharded = tmp_path / "sharded"
        shard_checkpoint(src, sharded, tp=2, max_file_bytes=100_000)
        argv = lambda out: ["compress", str(sharded), str(out), "--codec", "zstd", "--device", "cpu"]  # noqa: E731
    clean = tmp_path / "clean"
    subprocess.run([sys.executable, "-m", "gdsload.server.cli", *argv(clean)], check=True, capture_output=True)
    want = {r: {k: v.clone() for k, v in load_rank(clean, r).tensors.items()} for r in range(2)}
    killed = 0
    for k in range(1, 60):
        out = tmp_path / f"out{k}"
        p = subprocess.run(
            [sys.executable, "-c", _KILL_AT_RENAME, str(k), *argv(out)], capture_output=True, text=True, timeout=120
        )
        if p.returncode == 0:
            break  # past the last rename: the run finished
        assert p.returncode == -signal.SIGKILL, p.stderr
        killed += 1
        for r in range(2):  # whatever the kill left either refuses to load or is the whole, finished model
            try:
                got = load_rank(out, r).tensors
            except (UnfinishedOutputError, NoFilesForRankError, FileNotFoundError):
                continue
            assert got.keys() == want[r].keys() and all(torch.equal(got[n], want[r][n]) for n in got), (k, r)
        p = subprocess.run(
            [sys.executable, "-m", "gdsload.server.cli", *argv(out)], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 0, (k, p.stderr)
        for r in range(2):
            got = load_rank(out, r).tensors
            assert all(torch.equal(got[n], want[r][n]) for n in want[r]), (k, r)
        leftovers = [x for x in tmp_path.iterdir() if x.name.startswith(f".out{k}")]
        # Killed in the instant between making its staging directory and locking it, a run leaves it under its
        # creating name: the next run after LEFTOVER_MIN_AGE_S removes it.
        for x in leftovers:
            assert ".creating-" in x.name and not any(x.iterdir()), (k, x.name)
            os.utime(x, (time.time() - 3600, time.time() - 3600))
        if leftovers:
            remove_dead_leftovers(tmp_path, f".out{k}.partial-")
            assert not [x.name for x in tmp_path.iterdir() if x.name.startswith(f".out{k}")], k
    assert killed >= 5, "the run has fewer commit points than expected"


def test_compression_is_part_of_the_command(checkpoints, tmp_path):
    """A sharding that ends compressed is another command: its fingerprint differs (so neither resumes the
    other's partial run), while an uncompressed sharding's plan and fingerprint leave the codec out."""
    src, _ = checkpoints["llama-gqa-tied"]
    plain = plan_shard(src, ShardOptions(tp=2))
    packed = plan_shard(src, ShardOptions(tp=2, compress="ans"))
    assert "compress" not in plain.options.describe() and packed.options.describe()["compress"] == "ans"
    assert plain.fingerprint != packed.fingerprint
    with pytest.raises(ConfigError, match="compress='lz9' is not one of"):
        ShardOptions(tp=2, compress="lz9")
    # An interrupted uncompressed run in OUT is not taken for a compressed one.
    out = tmp_path / "out"
    (out / PARTIAL_DIR).mkdir(parents=True)
    (out / PARTIAL_DIR / "state.json").write_text(
        json.dumps({"fingerprint": plain.fingerprint, "source": str(plain.source), **plain.options.describe()})
    )
    with pytest.raises(OutputExistsError, match=r"compress=None \(now 'ans'\)"):
        execute_plan(packed, out)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_unquantized_tensor_is_built_on_the_gpu_path(checkpoints, kind):
    """The GPU sharding (`shard --compress ans`) builds every tensor the rules make for these models, at
    every tp and layout; quantized weights go through torch."""
    from gdsload.loader.prepare.gpu_shard import _buildable

    src, _ = checkpoints[kind]
    for tp in (1, 2, 4):
        for layout in ("vllm", "hf"):
            try:
                plan = plan_shard(src, ShardOptions(tp=tp, layout=layout))
            except ShardConfigError:
                continue
            assert all(_buildable(plan, t, s.dtype) for f in plan.files for t, s in zip(f.tensors, f.specs))
    plan = plan_shard(src, ShardOptions(tp=2, quantize="fp8"))
    assert not all(_buildable(plan, t, s.dtype) for f in plan.files for t, s in zip(f.tensors, f.specs))


def test_constants_for_the_gpu_path_are_the_bytes_torch_makes():
    from gdsload.loader.dtypes import to_torch
    from gdsload.loader.prepare.gpu_shard import _filled

    for dtype in ("F32", "F16", "BF16"):
        for value in (1.0, -1.0, 0.0, 1 / 3, 2.0**-130, 65504.0, *((3.0e38,) if dtype != "F16" else ())):
            want = torch.full((5,), value, dtype=to_torch(dtype)).view(torch.uint8).numpy().tobytes()
            assert _filled(value, dtype, 5).tobytes() == want, (dtype, value)


def test_planning_a_sharding_imports_no_torch(checkpoints):
    """The shard command and its planning import no torch (the GPU path builds files without it)."""
    import subprocess
    import sys

    src, _ = checkpoints["llama-gqa-tied"]
    code = (
        "import sys; import gdsload.server.cmd_shard; from gdsload.loader.prepare.shard import plan_shard, "
        f"ShardOptions; plan_shard({str(src)!r}, ShardOptions(tp=2, compress='ans')); print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stderr


def test_an_unfinished_gpu_run_is_not_continued_through_torch(checkpoints, tmp_path, capsys):
    """A `shard --compress ans` run that began building its files on a GPU resumes only that way: where
    that path cannot run (here, no GPU), the rerun says so and leaves OUT as it is."""
    from gdsload.server import cli

    src, _ = checkpoints["llama-gqa-tied"]
    plan = plan_shard(src, ShardOptions(tp=2, compress="ans"))
    out = tmp_path / "out"
    (out / PARTIAL_DIR).mkdir(parents=True)
    state = {"fingerprint": plan.fingerprint, "source": str(plan.source), **plan.options.describe()}
    (out / PARTIAL_DIR / "state.json").write_text(json.dumps(state))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["shard", str(src), str(out), "--tp", "2", "--compress", "ans", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code != 0 and "built its files on a GPU" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == [PARTIAL_DIR]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_compress_and_shard_record_the_digest_algorithm_asked_for(tmp_path, checkpoints):
    """blake3 by default; ``--digest-algorithm sha256`` records each file's sha256 as hashlib computes it, and
    the loader checks either kind (a corrupt byte fails the check, naming the algorithm)."""
    import hashlib

    import blake3

    from gdsload.loader.errors import IntegrityError

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            [sys.executable, "-m", "gdsload.server.cli", *args], capture_output=True, text=True, timeout=300
        )
        assert p.returncode == 0 or not ok, p.stderr
        return p

    model = tmp_path / "plain"
    run("bench", "--make-model", "8MB", "--out", str(model))
    src, _ = checkpoints["llama-gqa-tied"]
    run("compress", str(model), str(tmp_path / "z-b3"), "--codec", "zstd", "--device", "cpu")
    run("shard", str(src), str(tmp_path / "s-b3"), "--tp", "2", "--no-progress")
    run(
        "compress",
        str(model),
        str(tmp_path / "z-sha"),
        "--codec",
        "zstd",
        "--device",
        "cpu",
        "--digest-algorithm",
        "sha256",
    )
    run("shard", str(src), str(tmp_path / "s-sha"), "--tp", "2", "--no-progress", "--digest-algorithm", "sha256")
    oracle = {"blake3": lambda b: blake3.blake3(b).hexdigest(), "sha256": lambda b: hashlib.sha256(b).hexdigest()}
    for algorithm, suffix in (("blake3", "b3"), ("sha256", "sha")):
        for out in (tmp_path / f"z-{suffix}", tmp_path / f"s-{suffix}"):
            files = [f for fs in Manifest.read(out).ranks.values() for f in fs]
            assert files and all(
                f.digest == f"{algorithm}:" + oracle[algorithm]((out / f.path).read_bytes()) for f in files
            ), out
        assert load_rank(tmp_path / f"s-{suffix}", 1, verify=True).report.verified
        victim = tmp_path / f"s-{suffix}" / Manifest.read(tmp_path / f"s-{suffix}").ranks[1][0].path
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 0x01
        victim.write_bytes(bytes(raw))
        with pytest.raises(IntegrityError, match=f"{algorithm} digest"):
            load_rank(tmp_path / f"s-{suffix}", 1, verify=True)
    assert "--digest-algorithm" in run("compress", "--help").stdout
    bad = run("compress", str(model), str(tmp_path / "z-md5"), "--digest-algorithm", "md5", ok=False)
    assert bad.returncode == 2 and "'md5' is not one of 'blake3', 'sha256'" in bad.stderr
    assert not (tmp_path / "z-md5").exists()
    with pytest.raises(ConfigError, match="digest='md5' names no digest algorithm gdsload knows; give True"):
        shard_checkpoint(src, tmp_path / "s-md5", tp=2, digest="md5")
    assert not (tmp_path / "s-md5").exists()


def test_the_digest_asked_for_is_recorded_whatever_writes_the_files_and_a_rerun_can_change_it(checkpoints, tmp_path):
    """A writer that computes another digest (or none) than the one asked for: the manifest still records the
    one asked for, hashed from the file. A finished output rerun with another digest option keeps its files
    and records the digests asked for."""
    import functools
    import hashlib

    import blake3

    from gdsload.loader.format.writer import AlignedWriter

    src, _ = checkpoints["llama-gqa-tied"]
    out = tmp_path / "sha"
    shard_checkpoint(src, out, tp=2, digest="sha256", writer_factory=functools.partial(AlignedWriter, threads=2))
    listed = [f for fs in Manifest.read(out).ranks.values() for f in fs]
    data = {f.path: (out / f.path).read_bytes() for f in listed}
    assert listed and all(f.digest == "sha256:" + hashlib.sha256(data[f.path]).hexdigest() for f in listed)
    extra = Manifest.read(out).extra
    for digest, want in (
        (True, lambda b: "blake3:" + blake3.blake3(b).hexdigest()),
        (False, lambda b: None),
        ("sha256", lambda b: "sha256:" + hashlib.sha256(b).hexdigest()),
    ):
        assert shard_checkpoint(src, out, tp=2, digest=digest).already_complete
        again = Manifest.read(out)
        assert [(f.path, f.digest) for fs in again.ranks.values() for f in fs] == [
            (f.path, want(data[f.path])) for f in listed
        ]
        assert again.extra == extra and all((out / p).read_bytes() == b for p, b in data.items())


def test_shard_follows_no_link_out_of_the_source_and_keeps_private_files_private(checkpoints, tmp_path):
    src = _copy(checkpoints["llama-gqa-tied"][0], tmp_path / "src")
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    _fails(
        lambda: plan_shard(src, ShardOptions(tp=2)),
        SourceCheckpointError,
        "outside the source directory",
        "does not follow links out of SRC",
    )
    assert not (tmp_path / "out").exists()
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer.json").chmod(0o600)
    for f in src.glob("*.safetensors"):
        f.chmod(0o640)
    shard_checkpoint(src, tmp_path / "out", tp=2)
    out = tmp_path / "out"
    assert (out / "tokenizer.json").stat().st_mode & 0o777 == 0o600
    assert all(f.stat().st_mode & 0o007 == 0 for f in out.glob("*.safetensors")), "private weights became readable"
