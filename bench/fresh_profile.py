"""Where a fresh process's load spends its time: ``load_rank`` N times in one new process, traced.

The cold-start bench times one load per fresh process. This diagnostic runs that first load and
then ``--repeat - 1`` more in the same process, and wraps the loader's steps (discover, plan,
arena allocation, backend open/read/close, residency check, kvikio file opens, decode) with
timers, so a first-load penalty shows up next to the step that pays it:

    python -m gdsload.bench.fresh_profile /dev/shm/model --backend pinned --repeat 3

Prints one JSON line per load. ``--timeline`` adds, for a compressed load, each staging group's times:
reads submitted and done, decode started and finished, in seconds from the start of the decode stage.
``--prewarm-h2d`` copies 1 GiB host-to-device before the first
load (tells GPU/PCIe power-state ramp-up apart from software start-up costs). Loader options come
from the ``GDSLOAD_*`` environment variables as usual.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import time
from collections import defaultdict
from typing import Any

PROCESS_START = time.perf_counter()

_TRACE: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])


def _wrap(owner: Any, attr: str, label: str) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def timed(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            rec = _TRACE[label]
            rec[0] += time.perf_counter() - t
            rec[1] += 1

    setattr(owner, attr, timed)


def _instrument() -> None:
    # Functions a load imports when it runs (the decode stage, the codecs) are wrapped where they are
    # imported from: their modules' attributes.
    import gdsload.loader.codecs as codecs
    import gdsload.loader.io as backends
    import gdsload.loader.io.pinned as pinned
    import gdsload.loader.pipeline.decode as decode
    import gdsload.loader.pipeline.load as load

    _wrap(load, "discover", "discover")
    _wrap(load, "plan_rank", "plan_rank")
    _wrap(load, "select_backend", "select_backend")
    _wrap(decode, "load_compressed", "load_compressed")
    _wrap(backends.Backend, "allocate", "allocate")
    _wrap(pinned, "is_cold", "pinned.is_cold")
    for m in ("open", "read", "submit", "close"):
        _wrap(pinned.PinnedBackend, m, f"pinned.{m}")
    _wrap(codecs, "nvcomp_available", "codecs.nvcomp_available")
    _wrap(codecs.GpuCodecs, "__init__", "codecs.GpuCodecs()")
    _wrap(codecs.GpuCodecs, "decode_many", "codecs.GpuCodecs.decode_many")
    try:
        import kvikio

        _wrap(kvikio, "CuFile", "kvikio.CuFile()")
    except ImportError:
        pass


_GROUPS: list[dict[str, float]] = []
_START: list[float] = [0.0]


def _timeline() -> None:
    """Record each staging group of a compressed load on a GPU: when its reads were submitted, when they were
    done, when the decoder started and finished it (seconds from the start of the decode stage)."""
    import gdsload.loader.codecs as codecs
    import gdsload.loader.pipeline.decode as decode

    load_compressed, pipeline, decode_many = decode.load_compressed, decode._pipeline, codecs.GpuCodecs.decode_many

    def since() -> float:
        return round(time.perf_counter() - _START[0], 4)

    def timed_load(*a: Any, **kw: Any) -> Any:
        _GROUPS.clear()
        _START[0] = time.perf_counter()
        return load_compressed(*a, **kw)

    def timed_pipeline(n: int, free: Any, submit: Any, hand_off: Any, errors: Any) -> None:
        def timed_submit(i: int, k: int) -> Any:
            g = {"submitted": since()}
            _GROUPS.append(g)
            wait = submit(i, k)

            def timed_wait() -> None:
                wait()
                g["read"] = since()
            return timed_wait
        return pipeline(n, free, timed_submit, hand_off, errors)

    def timed_decode(self: Any, jobs: Any) -> None:
        g = next((g for g in _GROUPS if "decoding" not in g), {})
        g["decoding"] = since()
        decode_many(self, jobs)
        g["decoded"] = since()

    decode.load_compressed, decode._pipeline = timed_load, timed_pipeline
    codecs.GpuCodecs.decode_many = timed_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--backend", default="pinned")
    ap.add_argument("--device", default="cuda:0", help="CUDA device to load to (this profile times GPU loads)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prewarm-h2d", action="store_true")
    ap.add_argument("--label", default="")
    ap.add_argument("--timeline", action="store_true",
                    help="also print each staging group of a compressed load: submitted, read, decoding, decoded")
    args = ap.parse_args()
    if not args.device.startswith("cuda"):
        ap.error(f"--device {args.device!r}: this profile times loads to a GPU; give cuda or cuda:N")

    t = time.perf_counter()
    import torch

    imports = {"torch": time.perf_counter() - t}
    t = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device=args.device)
    imports["cuda_context"] = time.perf_counter() - t
    t = time.perf_counter()
    from gdsload.loader import load_rank

    for optional in ("kvikio", "nvidia.nvcomp"):
        try:
            __import__(optional)
        except ImportError:
            pass
    imports["gdsload+kvikio+nvcomp"] = time.perf_counter() - t
    if args.timeline:
        _timeline()
    _instrument()
    if args.prewarm_h2d:
        src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(1 << 30, dtype=torch.uint8, device=args.device)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        del src, dst
    for i in range(args.repeat):
        _TRACE.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = load_rank(args.model_dir, 0, device=args.device, backend=args.backend)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        rep = res.report
        line = {"label": args.label, "load": i, "seconds": round(seconds, 4),
                "gbps": round(rep.logical_bytes / seconds / 1e9, 2), "backend": rep.backend,
                "engines": getattr(rep, "engines", None),
                "phases": {k: round(v, 4) for k, v in rep.phases.items()},
                "trace": {k: [round(v[0], 4), v[1]] for k, v in _TRACE.items()},
                "decode_busy_seconds": round(rep.decode_busy_seconds, 4),
                "stored_bytes": rep.stored_bytes, "logical_bytes": rep.logical_bytes}
        if args.timeline:
            line["groups"] = list(_GROUPS)
        if i == 0:
            line["startup"] = {k: round(v, 3) for k, v in imports.items()}
            line["process_to_first_load_s"] = round(t - PROCESS_START, 3)
        print(json.dumps(line), flush=True)
        res.close()
        del res
        gc.collect()


if __name__ == "__main__":
    main()
