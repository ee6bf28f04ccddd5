"""The data region of every ``*.safetensors`` file in a directory, for the diagnostics here."""

import json
import os
import struct


def data_spans(d: str) -> list[tuple[str, int, int]]:
    """``(path, offset of the data, bytes of data)`` per file, in name order."""
    spans = []
    for p in sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors")):
        with open(p, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            hdr = json.loads(fh.read(n))
        spans.append((p, 8 + n, max(v["data_offsets"][1] for k, v in hdr.items() if k != "__metadata__")))
    return spans


def kvikio_arena(d: str, threads: int, task: int, bounce: int):  # noqa: ANN201 - cupy is imported here only
    """GPU 0's context, one device buffer for every file's data, and kvikio's compat settings: the
    diagnostics' common start. Returns ``(spans, total bytes, arena)``."""
    import cupy
    import kvikio
    import kvikio.defaults

    cupy.cuda.Device(0).use()
    cupy.empty(1, dtype=cupy.uint8)
    spans = data_spans(d)
    total = sum(e for _, _, e in spans)
    arena = cupy.empty(total, dtype=cupy.uint8)
    kvikio.defaults.set(
        {"num_threads": threads, "task_size": task, "bounce_buffer_size": bounce, "compat_mode": kvikio.CompatMode.ON}
    )
    return spans, total, arena


def warm_kvikio(spans: list[tuple[str, int, int]], arena, threads: int, task: int) -> float:  # noqa: ANN001
    """One kvikio task per thread from the first file into ``arena``: its threads make their CUDA streams
    and pinned bounce buffers. Returns the seconds it took."""
    import time

    import cupy
    import kvikio

    f = kvikio.CuFile(spans[0][0], "r")
    t = time.perf_counter()
    for fu in [f.pread(arena[i * task : (i + 1) * task], task, spans[0][1] + i * task) for i in range(threads)]:
        fu.get()
    cupy.cuda.runtime.deviceSynchronize()
    seconds = round(time.perf_counter() - t, 4)
    f.close()
    return seconds
