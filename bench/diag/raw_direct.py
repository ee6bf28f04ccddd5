# Diagnostic from session 8 (not installed with the package): one O_DIRECT read of every byte of a
# checkpoint's files into host memory, no GPU, with a chosen kind of buffer; prints one JSON line
# {"bytes", "seconds", "buffer", ...}. cold_shapes.py runs it in a fresh process per load ("raw:KIND:TxMiB").
# Question it answers: does the size of the requests that reach the disk (and so the speed of a cold
# read) depend on how physically contiguous the read buffer is? Kinds:
#   4k    anonymous mmap, MADV_NOHUGEPAGE: 4 KiB pages, scattered (as malloc'd buffers usually are)
#   thp   anonymous mmap, MADV_HUGEPAGE: 2 MiB pages where the kernel has them
#   cuda  cudaHostAlloc (cupy.cuda.alloc_pinned_memory): what kvikio's and fastsafetensors' bounce buffers are
# Order: "queue" (threads take reads off one queue, file after file) or "perfile" (one thread per file,
# front to back: fastsafetensors' pattern).
# Usage: python bench/diag/raw_direct.py MODEL_DIR KIND THREADS MIB [queue|perfile]
import json
import mmap
import sys
from pathlib import Path

from gdsload.bench.limits import _raw_read

model, kind, threads, mib = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
order = sys.argv[5] if len(sys.argv) > 5 else "queue"
chunk = round(mib * 2**20) // 4096 * 4096
files = sorted(str(p) for p in Path(model).glob("*.safetensors"))
keep: list = []  # owners of the buffers' memory


def make_buffer() -> memoryview:
    if kind in ("4k", "thp"):
        m = mmap.mmap(-1, chunk)
        m.madvise(mmap.MADV_NOHUGEPAGE if kind == "4k" else mmap.MADV_HUGEPAGE)
        m[:] = bytes(chunk)  # fault the pages in now, not during the timed reads
        keep.append(m)
        return memoryview(m)
    if kind == "cuda":
        import cupy
        import numpy
        p = cupy.cuda.alloc_pinned_memory(chunk)
        keep.append(p)
        a = numpy.frombuffer(p, dtype=numpy.uint8, count=chunk)
        assert a.ctypes.data % 4096 == 0, "pinned buffer not page aligned"
        return memoryview(a)
    raise SystemExit(f"unknown buffer kind {kind!r}: 4k, thp or cuda")


n_threads = len(files) if order == "perfile" else threads
pool = [make_buffer() for _ in range(n_threads)]  # made before the clock starts (CUDA's start-up too)
total, seconds = _raw_read(files, direct=True, threads=threads, chunk=chunk, per_file=order == "perfile",
                           buffer=lambda nbytes: pool.pop())
print(json.dumps({"bytes": total, "seconds": seconds, "buffer": kind, "threads": n_threads, "chunk": chunk,
                  "order": order}))
