"""Codecs on the CPU: a tensor's chunks compressed, and decoded, by many threads at once through each codec's
:meth:`~gdsload.loader.codecs.registry.Codec.encode_chunk` / :meth:`~gdsload.loader.codecs.registry.Codec.decode_chunk`
(``zstandard`` and most compressors let go of the GIL)."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

from .registry import codec, codec_names
from ..errors import CodecError
from ..format.compression import CompressedEntry

if TYPE_CHECKING:  # numpy is imported by the encoder: decoding imports none
    import numpy as np

__all__ = ["encode_chunks", "cpu_decode", "check_crc32"]


def encode_chunks(
    name: str, data: np.ndarray, codec_name: str, params: dict[str, Any], threads: int, *, checksum: bool
) -> tuple[np.ndarray, tuple[int, ...], int | None]:
    """The chunks of the host bytes ``data`` compressed with ``codec_name`` by ``threads`` threads at once and put one
    after the other into one array (also by the threads, a run of chunks each); returns it, the chunks' sizes and,
    with ``checksum``, zlib's CRC-32 of ``data`` computed beside them."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    spec = codec(codec_name)
    if not spec.cpu_encode:
        cpu = [c for c in codec_names() if codec(c).cpu_encode]
        raise CodecError(
            f"tensor {name!r}: codec {codec_name!r} compresses on a GPU only (nvCOMP); run on a CUDA host or use "
            f"a codec the CPU writes ({', '.join(cpu)})"
        )
    chunk = spec.chunk_bytes

    def one(at: int) -> bytes:
        return spec.encode_chunk(memoryview(data[at : at + chunk]), params)

    with ThreadPoolExecutor(threads) as pool:
        crc = pool.submit(zlib.crc32, data) if checksum else None
        chunks = list(pool.map(one, range(0, len(data), chunk)))
        sizes = tuple(len(c) for c in chunks)
        starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        blob = np.empty(int(starts[-1]), dtype=np.uint8)

        def gather(first: int, stop: int) -> None:
            for i in range(first, stop):
                blob[starts[i] : starts[i + 1]] = np.frombuffer(chunks[i], dtype=np.uint8)

        per = -(-len(chunks) // threads) if chunks else 1
        list(pool.map(lambda f: gather(f, min(f + per, len(chunks))), range(0, len(chunks), per)))
        return blob, sizes, crc.result() if crc is not None else None


def cpu_decode(
    entry: CompressedEntry, src: memoryview, dst: memoryview, *, verify: bool, path: str, threads: int = 4
) -> None:
    """Decode ``entry`` from its stored bytes ``src`` into ``dst`` (both host memory)."""
    where = f"{path!r}: tensor {entry.name!r}"
    spec = codec(entry.codec)
    if not spec.cpu_decode:
        raise CodecError(
            f"{where} is compressed with {entry.codec!r}, which only a GPU decodes (nvCOMP); load it with "
            "device='cuda' on a GPU host, or re-compress with `gdsload compress --codec zstd` for CPU hosts"
        )
    params = entry.params
    from concurrent.futures import ThreadPoolExecutor

    def one(span: tuple[int, int, int, int]) -> None:
        s_off, s_len, d_off, d_len = span
        try:
            out = spec.decode_chunk(src[s_off : s_off + s_len], d_len, params)
        except Exception as e:  # each codec's own error for a damaged chunk
            raise CodecError(
                f"{where}: the {entry.codec} chunk at stored byte {s_off} is corrupt ({type(e).__name__}: {e})"
            ) from None
        if len(out) != d_len:
            raise CodecError(f"{where}: a chunk decoded to {len(out)} bytes, the metadata says {d_len}")
        dst[d_off : d_off + d_len] = out

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, entry.chunk_spans()))
    if verify:
        check_crc32(entry, dst, where)


def check_crc32(entry: CompressedEntry, decoded: Any, where: str) -> None:
    """Raise :class:`CodecError` unless the host bytes ``decoded`` match ``entry``'s recorded crc32 (if any).
    (ANS chunks decoded on a GPU are checked there instead: :mod:`gdsload.loader.codecs.nvcomp_c`.)"""
    if entry.crc32 is not None:
        got = zlib.crc32(decoded)
        if got != entry.crc32:
            raise CodecError(
                f"{where}: decoded bytes have CRC-32 {got:#010x} where the file records "
                f"{entry.crc32:#010x}; the file is corrupt"
            )
