"""How each output tensor of ``gdsload shard`` is made from the source checkpoint: a :class:`Recipe` of :class:`Part`\\ s.

A part writes one strided region of the output tensor (:class:`View`: element offset, shape, strides —
what ``torch.as_strided`` takes). It copies a strided view of one source tensor (``copy``; the dtype
converts as ``Tensor.copy_`` converts it), quantizes one to FP8 with that source's scale (``fp8``), writes
the scale(s) of a source quantized so (``scale``: a virtual tensor of shape ``()`` per tensor, or
``(rows, 1)`` per output channel), fills a constant (``fill``), or writes given bytes (``const``). Parts
apply in order over ``init`` (bytes of the whole tensor) or, without it, over uninitialised memory that
the parts cover entirely.

Recipes come from the installed vLLM (:mod:`.layout_vllm`: its own weight loaders, traced) or from the
Llama-family rules (:mod:`.layout_rules`); :mod:`.build` makes tensors from them. Nothing here reads data.

>>> View.of((4, 6)).narrow(1, 2, 3)
View(offset=2, shape=(4, 3), strides=(6, 1))
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

__all__ = ["View", "Part", "Recipe", "PART_KINDS"]

PART_KINDS = ("copy", "fp8", "scale", "fill", "const")


class View(NamedTuple):
    """A strided region of a tensor's elements: ``torch.as_strided(t, shape, strides, offset)``."""

    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, shape: tuple[int, ...], offset: int = 0) -> View:
        """The whole of a contiguous tensor of ``shape`` (starting at ``offset``)."""
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return cls(offset, tuple(shape), tuple(reversed(strides)))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def span(self) -> tuple[int, int]:
        """First element and one past the last element the view touches (``(offset, offset)`` when empty)."""
        if not self.numel:
            return self.offset, self.offset
        lo = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s < 0)
        hi = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s > 0)
        return lo, hi + 1

    def narrow(self, dim: int, start: int, length: int) -> View:
        """Elements ``[start, start + length)`` along ``dim`` (``Tensor.narrow``)."""
        shape = list(self.shape)
        shape[dim] = length
        return View(self.offset + start * self.strides[dim], tuple(shape), self.strides)

    def chunks(self, limit: int) -> Iterator[tuple[int, int, int]]:
        """``(dim, start, stop)`` pieces of this view, along the dimension with the largest stride, each spanning at
        most about ``limit`` elements (a piece is at least one step of that dimension)."""
        lo, hi = self.span()
        if hi - lo <= limit or not self.numel:
            yield -1, 0, 0
            return
        dim = max(range(len(self.shape)), key=lambda d: abs(self.strides[d]) if self.shape[d] > 1 else -1)
        step = abs(self.strides[dim]) or 1
        per = max(1, limit // step)
        for start in range(0, self.shape[dim], per):
            yield dim, start, min(self.shape[dim], start + per)

    def to_json(self) -> list[Any]:
        return [self.offset, list(self.shape), list(self.strides)]

    @classmethod
    def from_json(cls, doc: Any) -> View:
        offset, shape, strides = doc
        return cls(int(offset), tuple(int(n) for n in shape), tuple(int(s) for s in strides))


class Part(NamedTuple):
    """One write into an output tensor (see the module docstring)."""

    dst: View
    kind: str
    source: str | None = None
    """The source tensor (``copy``, ``fp8``, and ``scale``: the weight whose scale it is)."""
    src: View | None = None
    """The elements of ``source`` (of its virtual scale tensor, for ``scale``)."""
    value: float | bytes | None = None
    """``fill``: the constant; ``const``: the bytes, in the output dtype, of ``dst``'s elements in order."""


class Recipe(NamedTuple):
    """One output tensor: its name, safetensors dtype and shape, and how it is made."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    init: bytes | None = None
    """Bytes of the whole tensor the parts are applied over (a value the engine gives it when it is built)."""

    @property
    def sources(self) -> tuple[str, ...]:
        """The source tensors it reads, in first-use order."""
        return tuple(dict.fromkeys(p.source for p in self.parts if p.source is not None and p.kind != "scale"))

    @property
    def quantized_sources(self) -> tuple[str, ...]:
        """The sources whose FP8 scales it needs (``fp8`` and ``scale`` parts)."""
        return tuple(dict.fromkeys(p.source for p in self.parts if p.kind in ("fp8", "scale") and p.source))

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Recipe:
        """A recipe from the document :mod:`.vllm_trace` prints for one state-dict entry."""
        parts = []
        for p in doc["parts"]:
            dst = View.from_json(p["dst"])
            if "fill" in p:
                parts.append(Part(dst, "fill", value=float(p["fill"])))
            elif "const" in p:
                parts.append(Part(dst, "const", value=base64.b64decode(p["const"])))
            else:
                parts.append(Part(dst, p.get("op", "copy"), str(p["src"]), View.from_json(p["view"])))
        init = base64.b64decode(doc["init"]) if doc.get("init") else None
        return cls(str(doc["name"]), str(doc["dtype"]), tuple(int(n) for n in doc["shape"]), tuple(parts), init)
