"""Make output tensors from their :class:`~.recipe.Recipe` and write a planned file, through torch on the CPU.

Each part's source region is read in pieces of at most :data:`CHUNK_BYTES` (split along the view's
largest stride), copied with ``Tensor.copy_`` semantics into the part's strided region of the output —
so a dtype converts exactly as the engine's own loader converts it — or, for ``fp8``, quantized a row
at a time with the scale of the *whole* source tensor (or row) first. Memory: the output tensor being
built plus one piece of its source.
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..config import format_bytes
from ..dtypes import to_torch
from ..errors import GdsloadError
from ..format.writer import TensorSpec
from .quantize import QuantScheme, compute_scale, quantize_into
from .recipe import Part, Recipe, View
from .source import SourceCheckpoint, SourceCheckpointError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHUNK_BYTES",
    "TensorBuilder",
    "TensorFileWriter",
    "WriterFactory",
    "write_file",
    "ShardWriteError",
    "CompressWriteError",
    "write_error",
]

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20
"""Largest piece of a source tensor read at once."""


class ShardWriteError(GdsloadError, OSError):
    """Writing OUT failed (no space left, permissions, I/O error); nothing partial is left behind."""


class CompressWriteError(GdsloadError, OSError):
    """Writing a compressed copy failed (no space left, a file too large, a read-only filesystem); nothing
    partial is left behind."""


def write_error(e: OSError, path: Path, what: str, kind: type[OSError] = ShardWriteError) -> OSError:
    """A ``kind`` (:class:`ShardWriteError` by default) for ``e``, naming ``path``, what was being written, and
    the fix."""
    code = e.errno if e.errno is not None else errno.EIO
    reason = e.strerror or str(e)
    fix = (
        "free space on that filesystem or choose an OUT with room"
        if code in (errno.ENOSPC, errno.EDQUOT)
        else "check the directory's permissions and the filesystem"
    )
    err = kind(
        code,
        f"writing {str(path)!r} ({what}) failed: {reason} [errno {code}]; nothing partial was kept — {fix}, then rerun",
    )
    err.filename = str(path)
    return err


class TensorFileWriter(Protocol):
    """What a planned file is written through (:class:`~gdsload.loader.format.writer.AlignedWriter` by
    default). ``order`` is the sequence in which ``write`` must be called; a writer that transforms each
    tensor before storing it (a compressor) implements the same interface."""

    order: list[TensorSpec]

    def __enter__(self) -> TensorFileWriter: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any: ...

    def write(self, name: str, tensor: torch.Tensor) -> None: ...


WriterFactory = Callable[[Path, Sequence[TensorSpec], Mapping[str, str]], TensorFileWriter]


def _strided(t: torch.Tensor, view: View) -> torch.Tensor:
    """``view`` of the elements of ``t`` (contiguous), wherever ``t`` starts in its storage."""
    import torch

    return torch.as_strided(t, view.shape, view.strides, t.storage_offset() + view.offset)


def _pieces(part: Part) -> list[tuple[View, View]]:
    """``(dst, src)`` pieces of a reading part, each spanning at most :data:`CHUNK_BYTES` of the source."""
    assert part.src is not None
    out = []
    for dim, a, b in part.src.chunks(max(1, CHUNK_BYTES // 4)):
        if dim < 0:
            out.append((part.dst, part.src))
        else:
            out.append((part.dst.narrow(dim, a, b - a), part.src.narrow(dim, a, b - a)))
    return out


class TensorBuilder:
    """Builds output tensors from one source checkpoint; FP8 scales computed once per source tensor.

    >>> builder = TensorBuilder(SourceCheckpoint("/models/Llama-3-8B"), None)  # doctest: +SKIP
    >>> builder.build(recipe).shape
    torch.Size([3072, 4096])
    """

    def __init__(self, source: SourceCheckpoint, scheme: QuantScheme | None):
        import torch

        self.source = source
        self.scheme = scheme
        self._scales: dict[str, torch.Tensor] = {}
        self._work = torch.empty(0, dtype=torch.float32)

    def build(self, recipe: Recipe) -> torch.Tensor:
        """The tensor ``recipe`` describes (CPU, contiguous)."""
        import torch

        dtype = to_torch(recipe.dtype)
        out = torch.empty(recipe.shape, dtype=dtype)
        if recipe.init is not None:
            out.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(recipe.init), dtype=torch.uint8))
        for part in recipe.parts:
            dst = _strided(out, part.dst)
            if part.kind == "fill":
                dst.fill_(part.value)  # type: ignore[arg-type]
            elif part.kind == "const":
                values = torch.frombuffer(bytearray(part.value), dtype=dtype) if part.value else out.new_empty(0)  # type: ignore[arg-type]
                dst.copy_(values.reshape(part.dst.shape))
            elif part.kind == "scale":
                assert part.source is not None and part.src is not None
                dst.copy_(_strided(self.scale(part.source).contiguous(), part.src))
            elif part.kind == "copy":
                for d, s in _pieces(part):
                    lo, hi = s.span()
                    data = self.source.read(part.source, lo, hi)  # type: ignore[arg-type]
                    _strided(out, d).copy_(_strided(data, s._replace(offset=s.offset - lo)))
            elif part.kind == "fp8":
                self._quantized(out, part)
            else:
                raise ValueError(
                    f"part kind {part.kind!r} of {recipe.name!r} is not one of copy, fp8, scale, fill, const"
                )
        return out

    def _row(self, name: str) -> int:
        shape = self.source.shape(name)
        return math.prod(shape[1:]) if len(shape) > 1 else 1

    def _quantized(self, out: torch.Tensor, part: Part) -> None:
        """Quantize the source rows ``part`` reads (whole rows, with their scales), then copy its view of them."""
        import torch

        assert part.source is not None and part.src is not None
        name, row = part.source, self._row(part.source)
        scale = self.scale(name)
        for d, s in _pieces(part):
            lo, hi = s.span()
            r0, r1 = lo // row, -(-hi // row)
            rows = self.source.read(name, r0 * row, r1 * row).reshape(r1 - r0, row)
            q = torch.empty((r1 - r0, row), dtype=torch.float8_e4m3fn)
            if self._work.numel() < rows.numel():
                self._work = torch.empty(rows.numel(), dtype=torch.float32)
            quantize_into(q, rows, scale if scale.dim() == 0 else scale[r0:r1], self._work)
            _strided(out, d).copy_(_strided(q.reshape(-1), s._replace(offset=s.offset - r0 * row)))

    def scale(self, name: str) -> torch.Tensor:
        """fp32 scale of the whole source tensor ``name``: 0-d, or ``[rows, 1]`` per output channel."""
        import torch

        if self.scheme is None:
            raise SourceCheckpointError(f"a recipe quantizes {name!r} but no --quantize scheme was given")
        if name not in self._scales:
            rows, row = self.source.shape(name)[0] if self.source.shape(name) else 1, self._row(name)
            step = max(1, (CHUNK_BYTES // 4) // max(1, row))
            parts = []
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                chunk = self.source.read(name, r0 * row, r1 * row).reshape(r1 - r0, row)
                lo, hi = chunk.aminmax(dim=1) if self.scheme.per_channel else chunk.aminmax()
                parts.append(torch.maximum(hi.float(), lo.float().neg()).reshape(-1))
            amax = torch.cat(parts) if parts else torch.zeros(1)
            if not bool(torch.isfinite(amax).all()):
                raise SourceCheckpointError(
                    f"tensor {name!r} in {self.source.tensors[name].path!r} holds inf or NaN values; fp8 scales "
                    "from it would zero every other weight. Fix the source weights, or shard without --quantize"
                )
            self._scales[name] = compute_scale(amax if self.scheme.per_channel else amax.max(), self.scheme)
        return self._scales[name]


def write_file(
    builder: TensorBuilder,
    path: Path,
    recipes: Sequence[Recipe],
    specs: Sequence[TensorSpec],
    metadata: Mapping[str, str],
    writer_factory: WriterFactory,
    progress: Callable[[int], None] | None = None,
) -> str | None:
    """Build and write one file's tensors through ``writer_factory``; returns the digest its writer computed, if any.

    An ``OSError`` from the writer becomes a :class:`ShardWriteError` naming the file and the tensor.
    """
    by_name = {r.name: r for r in recipes}
    current = "the header"
    try:
        with writer_factory(path, list(specs), metadata) as w:
            for spec in w.order:
                current = f"tensor {spec.name!r}"
                tensor = builder.build(by_name[spec.name])
                w.write(spec.name, tensor)
                del tensor
                if progress is not None:
                    progress(spec.nbytes)
    except OSError as e:
        if isinstance(e, GdsloadError):
            raise
        failed = getattr(e, "tensor", None)  # AlignedWriter's writes finish later than write() returns
        raise write_error(e, path, f"tensor {failed!r}" if failed else current) from e
    log.info("wrote %s (%s, %d tensors)", path.name, format_bytes(sum(s.nbytes for s in specs)), len(specs))
    return getattr(w, "digest", None)
