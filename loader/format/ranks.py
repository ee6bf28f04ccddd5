"""Parallel layouts: how an engine numbers its ranks over tensor × pipeline × expert parallel, and the file names.

A rank is numbered as vLLM numbers it (``initialize_model_parallel``): tensor parallel innermost, so
global rank ``g`` is pipeline stage ``g // tp``, tensor-parallel rank ``g % tp``. Expert parallel in vLLM
spreads the experts over the ranks of a stage (``--enable-expert-parallel``: the expert-parallel group is
the tensor-parallel group when data parallel is 1), so it adds no ranks: ``ep`` is 1 or ``tp``.

Files are named as vLLM's ``sharded_state`` loader looks for them: ``model-rank-{tp_rank}-part-{part}`` with
one pipeline stage, ``model-pp-{pp_rank}-tp-{tp_rank}-part-{part}`` with several.

>>> layout = ParallelLayout(tp=2, pp=2, ep=2)
>>> layout.world, layout.coords(3), layout.file_name(3, 0)
(4, (1, 1), 'model-pp-1-tp-1-part-0.safetensors')
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..errors import ConfigError

__all__ = ["ParallelLayout", "TP_PATTERN", "PP_TP_PATTERN", "parse_rank_file", "rank_ranges"]

TP_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
"""vLLM's ``sharded_state`` file name with one pipeline stage (its ``TP_ONLY_PATTERN``)."""
PP_TP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
"""vLLM's ``sharded_state`` file name with pipeline parallel (its ``PP_AND_TP_PATTERN``)."""

_TP_RE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")
_PP_TP_RE = re.compile(r"^model-pp-(\d+)-tp-(\d+)-part-(\d+)\.safetensors$")
MAX_WORLD = 4096
"""More ranks than any deployment has: a larger layout is a mistake in the input, refused before any work."""


class _Sizes(NamedTuple):
    tp: int = 1
    pp: int = 1
    ep: int = 1


class ParallelLayout(_Sizes):
    """``tp`` × ``pp`` ranks, experts spread over ``ep`` of each stage's ranks (1: every rank holds every expert).

    ``tp``: tensor-parallel size (``--tensor-parallel-size``); ``pp``: pipeline stages
    (``--pipeline-parallel-size``); ``ep``: expert-parallel size, 1 or ``tp`` (vLLM's
    ``--enable-expert-parallel`` with data parallel 1). A named tuple (the load path imports no dataclasses).
    """

    __slots__ = ()

    def __new__(cls, tp: int = 1, pp: int = 1, ep: int = 1) -> ParallelLayout:
        for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if ep not in (1, tp):
            raise ConfigError(
                f"ep={ep} with tp={tp}: expert parallel spreads the experts over a stage's "
                f"tensor-parallel ranks (vLLM's --enable-expert-parallel), so ep is 1 or {tp}; pass --ep {tp}"
            )
        if tp * pp > MAX_WORLD:
            raise ConfigError(f"tp={tp} x pp={pp} = {tp * pp} ranks is more than {MAX_WORLD}; check the sizes")
        return super().__new__(cls, tp, pp, ep)

    @property
    def world(self) -> int:
        """Ranks in all: ``tp * pp``."""
        return self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int]:
        """``(pp_rank, tp_rank)`` of global rank ``rank``."""
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is outside 0..{self.world - 1} (tp={self.tp} x pp={self.pp})")
        return divmod(rank, self.tp)

    def rank_of(self, tp_rank: int, pp_rank: int = 0) -> int:
        """The global rank of tensor-parallel rank ``tp_rank`` in stage ``pp_rank``."""
        return pp_rank * self.tp + tp_rank

    def file_name(self, rank: int, part: int) -> str:
        """Part ``part`` of global rank ``rank``, named as vLLM's ``sharded_state`` loader looks for it."""
        pp_rank, tp_rank = self.coords(rank)
        if self.pp == 1:
            return TP_PATTERN.format(rank=tp_rank, part=part)
        return PP_TP_PATTERN.format(pp_rank=pp_rank, tp_rank=tp_rank, part=part)

    def describe(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep}

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp} ep={self.ep}"


def parse_rank_file(name: str) -> tuple[int | None, int, int] | None:
    """``(pp_rank or None, tp_rank, part)`` of a vLLM ``sharded_state`` file name, else None.

    >>> parse_rank_file("model-pp-1-tp-0-part-2.safetensors"), parse_rank_file("model-rank-3-part-0.safetensors")
    ((1, 0, 2), (None, 3, 0))
    """
    if m := _TP_RE.match(name):
        return None, int(m[1]), int(m[2])
    if m := _PP_TP_RE.match(name):
        return int(m[1]), int(m[2]), int(m[3])
    return None


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``: ranks as people write them."""
    out, rs = [], sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)
