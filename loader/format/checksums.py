"""Per-tensor checksums a writer records in the header, so that every load can check the bytes it loaded.

``__metadata__["gdsload.checksums"]`` is a JSON document::

    {"version": 1, "algorithm": "crc32", "tensors": {"lm_head.weight": "9a3f01c2", "model.norm.weight": ...}}

Each value is the CRC-32 of zlib (``zlib.crc32``; the ``crc32`` compressed tensors record of their decoded bytes,
and what nvCOMP's batched CRC kernel computes on a GPU) of the tensor's bytes as a load hands them out: a raw
tensor's stored bytes, a compressed tensor's decoded bytes. On the CPU the ``isal`` package computes it (Intel's
ISA-L, carry-less multiplication over wide registers: several times zlib's speed, without the GIL); where it is
not installed, ``zlib.crc32`` gives the same values, slower. A file re-packed without changing its
tensors (``gdsload compress`` keeps the metadata) so keeps a valid table. Values are 8 hex digits, so a writer
can lay the header out with zeros in their place before the data exists and fill them in afterwards without
moving anything (:class:`~gdsload.loader.format.writer.AlignedWriter` does).

>>> doc = render({"w": crc32(b"abc")})
>>> parse_checksums_text(doc, {"w"}, "'x.safetensors'")
{'w': 891568578}
"""

from __future__ import annotations

import json
import logging
import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ..errors import IntegrityError
from . import strict_json

__all__ = [
    "METADATA_KEY",
    "ALGORITHM",
    "crc32",
    "crc32_combiner",
    "CRC_PIECE_BYTES",
    "combine_pieces",
    "crc_piece_count",
    "crc_pieces",
    "render",
    "placeholder",
    "parse_checksums",
    "parse_checksums_text",
    "require",
]

log = logging.getLogger(__name__)

METADATA_KEY = "gdsload.checksums"
ALGORITHM = "crc32"
FORMAT_VERSION = 1
_HEX = frozenset("0123456789abcdef")


_IMPL: Callable[..., int] | None = None


def _impl() -> Callable[..., int]:
    global _IMPL
    if _IMPL is None:
        try:
            from isal import isal_zlib

            _IMPL = isal_zlib.crc32
        except ImportError:  # same values, a few times slower
            import zlib

            log.info(
                "the isal package is not installed: checksums are computed with zlib.crc32 (slower); "
                "`pip install isal` (a gdsload dependency) makes them faster"
            )
            _IMPL = zlib.crc32
    return _IMPL


def require() -> None:
    """Pick the CRC-32 implementation now (ISA-L's, else zlib's)."""
    _impl()


def crc32(data: Any, value: int = 0) -> int:
    """zlib's CRC-32 of the bytes-like ``data``, continuing from ``value`` (the CRC of the bytes before it).

    ISA-L computes it where the ``isal`` package is installed, without the GIL: threads checking different
    tensors run at once.
    """
    return _impl()(data, value)


def crc32_combiner() -> Callable[[int, int, int], int] | None:
    """``combine(crc_a, crc_b, len_b)``: the CRC-32 of ``a + b`` from the CRCs of its two parts (ISA-L's
    ``crc32_combine``), or None where the ``isal`` package is missing (``zlib`` has no such call).

    What lets a long range be checked in pieces side by side (on a GPU, one piece per block of threads) and
    still be compared with the one CRC-32 its file records.
    """
    try:
        from isal import isal_zlib
    except ImportError:
        return None
    return isal_zlib.crc32_combine


CRC_PIECE_BYTES = 2 << 20
"""Ranges longer than this are checked in pieces of this size, side by side, and their CRCs combined on the host.

nvCOMP picks one kernel shape for a whole batch from its largest range; a rank's tensors range from a few KiB
to a GiB, so the largest tensors would each run on a few blocks of threads while the rest of the GPU idles.
Pieces of one size keep every SM busy."""


def crc_piece_count(nbytes: int, piece: int) -> int:
    """How many pieces :func:`crc_pieces` cuts a range of ``nbytes`` into."""
    return max(1, -(-nbytes // piece)) if piece > 0 else 1


def crc_pieces(spans: Sequence[tuple[int, int]], piece: int) -> tuple[list[int], list[int], list[int]]:
    """Split byte ranges ``(address, nbytes)`` into pieces of at most ``piece`` bytes (0: no split): the pieces'
    addresses and sizes, and how many pieces each range has. A range's first piece is its short one, so that
    every later piece has the full size (:func:`combine_pieces` folds them in order)."""
    addresses: list[int] = []
    sizes: list[int] = []
    counts: list[int] = []
    for address, n in spans:
        if piece <= 0 or n <= piece:
            addresses.append(address)
            sizes.append(n)
            counts.append(1)
            continue
        head = n % piece or piece
        addresses.append(address)
        sizes.append(head)
        addresses.extend(range(address + head, address + n, piece))
        sizes.extend(itertools.repeat(piece, (n - head) // piece))
        counts.append(1 + (n - head) // piece)
    return addresses, sizes, counts


def combine_pieces(crcs: Sequence[int], sizes: Sequence[int], counts: Sequence[int], combine: Any) -> list[int]:
    """Each range's CRC-32 from its pieces' (as :func:`crc_pieces` split them), folded in order by ``combine``."""
    out: list[int] = []
    i = 0
    for k in counts:
        crc = crcs[i]
        for j in range(i + 1, i + k):
            crc = combine(crc, crcs[j], sizes[j])
        out.append(crc)
        i += k
    return out


def render(checksums: Mapping[str, int]) -> str:
    """The metadata value recording ``checksums`` (tensor name -> CRC-32)."""
    return json.dumps(
        {
            "version": FORMAT_VERSION,
            "algorithm": ALGORITHM,
            "tensors": {name: f"{value:08x}" for name, value in checksums.items()},
        },
        separators=(",", ":"),
    )


def placeholder(names: Collection[str]) -> str:
    """:func:`render` of zeros for ``names``: as long as the final value, whatever the checksums turn out to be."""
    return render(dict.fromkeys(names, 0))


def parse_checksums(header: Any) -> dict[str, int] | None:
    """The checksums a file records (tensor name -> CRC-32), or None when it records none.

    Raises :class:`IntegrityError` naming the file and the field when the table is malformed or names a tensor
    the file does not hold.
    """
    raw = header.metadata.get(METADATA_KEY)
    if raw is None:
        return None
    return parse_checksums_text(raw, {t.name for t in header.tensors}, repr(header.path))


def parse_checksums_text(raw: str, names: Collection[str], where: str) -> dict[str, int]:
    """The table in the metadata value ``raw`` of the file ``where`` holding tensors ``names``."""
    field = f"{where}: __metadata__[{METADATA_KEY!r}]"
    doc = strict_json.loads(raw, IntegrityError, field)
    if (
        not isinstance(doc, dict)
        or doc.get("version") != FORMAT_VERSION
        or doc.get("algorithm") != ALGORITHM
        or not isinstance(doc.get("tensors"), dict)
    ):
        raise IntegrityError(
            f"{field} is not a version {FORMAT_VERSION} {ALGORITHM} table (got "
            f"{strict_json.brief(doc)}); rewrite the file with gdsload, or load it with verify=False"
        )
    out: dict[str, int] = {}
    for name, value in doc["tensors"].items():
        if name not in names:
            raise IntegrityError(
                f"{field} records a checksum for tensor {strict_json.brief(name)}, which the file "
                "does not hold; the header was edited: rewrite the file with gdsload"
            )
        if not isinstance(value, str) or len(value) != 8 or not _HEX.issuperset(value):
            raise IntegrityError(
                f"{field}: the checksum of tensor {name!r} is {strict_json.brief(value)}, not 8 "
                "lowercase hex digits; rewrite the file with gdsload"
            )
        out[name] = int(value, 16)
    return out
