"""A vLLM ``sharded_state`` directory without a manifest whose rank lost its last part: refused, not loaded."""

from __future__ import annotations

import pytest
import torch

from gdsload.loader import NoFilesForRankError, discover, load_rank, save_file


def _sharded_state(root, parts: int = 3, tp: int = 2) -> None:
    """What vLLM's save_sharded_state writes: every rank the same names (its own slices), split into parts."""
    for rank in range(tp):
        for part in range(parts):
            save_file(
                {f"layers.{part}.{k}": torch.full((4, 8), float(rank * 10 + part)) for k in ("q", "k")},
                root / f"model-rank-{rank}-part-{part}.safetensors",
            )


def test_a_rank_missing_its_last_part_is_refused(tmp_path):
    _sharded_state(tmp_path)
    (tmp_path / "model-rank-1-part-2.safetensors").unlink()
    with pytest.raises(
        NoFilesForRankError,
        match=r"rank 1 under .* has 2 part\(s\), rank 0 of the same pipeline "
        r"stage has 3.*'layers.2.k'.*last part is missing",
    ):
        load_rank(tmp_path, 1)
    assert load_rank(tmp_path, 0).report.verified  # the complete rank still loads


def test_ranks_with_the_same_names_in_fewer_parts_load(tmp_path):
    """Another split of the same tensors (parts cut at other sizes) is not a missing part."""
    _sharded_state(tmp_path)
    (tmp_path / "model-rank-1-part-1.safetensors").unlink()
    (tmp_path / "model-rank-1-part-2.safetensors").unlink()
    save_file(
        {f"layers.{p}.{k}": torch.ones(4, 8) for p in range(3) for k in ("q", "k")},
        tmp_path / "model-rank-1-part-0.safetensors",
    )
    assert discover(tmp_path, 1).files[-1].endswith("model-rank-1-part-0.safetensors")
    assert len(load_rank(tmp_path, 1).tensors) == 6


def test_pipeline_stages_are_compared_within_a_stage(tmp_path):
    """With pipeline parallel, stages hold different layers (and may have more parts): only a rank's own
    stage is compared."""
    for pp, parts in ((0, 2), (1, 1)):
        for tp in range(2):
            for part in range(parts):
                save_file(
                    {f"s{pp}.{part}.w": torch.ones(2)}, tmp_path / f"model-pp-{pp}-tp-{tp}-part-{part}.safetensors"
                )
    assert len(load_rank(tmp_path, 2).tensors) == 1  # stage 1 has one part per rank: complete
    (tmp_path / "model-pp-0-tp-1-part-1.safetensors").unlink()
    with pytest.raises(NoFilesForRankError, match="rank 1 .* rank 0 of the same pipeline stage"):
        load_rank(tmp_path, 1)
