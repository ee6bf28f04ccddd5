# Diagnostic from session 11 (not installed with the package): where a one-GPU load of an ANS-compressed copy
# spends its time. Each mode runs in a fresh process (one GPU, cupy, no torch), modes take turns, round after round:
#   load[+OPT...]  load_rank_bare, as a sidecar worker loads (phases, decoder busy time, a checksum of the arena);
#                  OPT: slotsN (N staging buffers), nosync (no device-wide synchronize after each group's reads;
#                  kvikio's reads are complete in device memory when their futures are), switch (the interpreter's
#                  switch interval at 0.5 ms instead of 5 ms);
#   profile        load_rank_bare under cProfile: the 25 slowest calls by cumulative time, as text;
#   groups         the reads alone, into two staging buffers, group after group as load_compressed issues them;
#   alone          every tensor's stored bytes read first (4 KiB-aligned places, as in staging), then decoded with
#                  nothing else running, one nvCOMP call per tensor: the decoder's time without reads beside it;
#                  meanwhile a Python thread counts, and its pace against a sleep of the same length says how much
#                  of the decoding holds the GIL (1.0: none of it);
#   alonegroups    as alone, but decoded group by group as a load's decoder does (the default staging's groups, each
#                  waited for), so a batched call's size matches the load's (session 12);
#   whole          the reads alone, each file's compressed bytes as one read into one device buffer (as a plain file
#                  is read). Decoding from there is not possible: nvCOMP wants 16-byte aligned streams, and the
#                  tensors of a compressed file are packed.
# A mode may end in @DIR: that model instead of DIR (session 12: ANS as raw chunks against the native streams).
# Usage: python bench/diag/ans_phases.py ROUNDS OUT.jsonl DIR MODE...   (worker: ... worker DIR MODE)
#        python bench/diag/ans_phases.py native SRC OUT   (an ANS copy in the layout written before session 12:
#                                                          one nvCOMP container per tensor)
import json
import subprocess
import sys
import time


def worker(d: str, mode: str) -> dict:
    import cupy
    cupy.cuda.Device(0).use()
    cupy.empty(1)
    import kvikio  # noqa: F401 - imported before the clock, as a sidecar worker has
    import nvidia.nvcomp  # noqa: F401
    from gdsload.loader.backends import ReadOptions
    from gdsload.loader.bare import _KvikioReader, load_rank_bare
    from gdsload.loader.decode import _groups
    from gdsload.loader.discovery import discover
    from gdsload.loader.plan import Extent, align_up, plan_rank

    sync = cupy.cuda.runtime.deviceSynchronize
    if mode.split("+")[0] == "load":
        import gdsload.loader.decode as dec
        for opt in mode.split("+")[1:]:
            if opt.startswith("slots"):
                dec.STAGING_SLOTS = int(opt[5:])
            elif opt == "nosync":
                _KvikioReader._synchronize = lambda self: None
            elif opt == "switch":
                sys.setswitchinterval(0.0005)
            else:
                raise SystemExit(f"unknown option {opt!r}")
        t = time.perf_counter()
        res = load_rank_bare(d, 0)
        sync()
        seconds = time.perf_counter() - t
        rep = res.report
        words = res.arena[: res.arena.size // 8 * 8].view(cupy.uint64)
        return {"seconds": seconds, "gbps": rep.logical_bytes / seconds / 1e9, "bytes": rep.logical_bytes,
                "stored": rep.stored_bytes, "phases": {k: round(v, 4) for k, v in rep.phases.items()},
                "decode_busy": rep.decode_busy_seconds, "staging": rep.staging_bytes, "checksum": int(words.sum())}
    if mode == "profile":
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.runcall(load_rank_bare, d, 0)
        seconds = time.perf_counter() - t
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
        return {"seconds": seconds, "profile": text.getvalue()[-6000:]}
    plan = plan_rank(discover(d, 0))
    stored = sum(t.entry.stored_bytes for t in plan.compressed)
    reader = _KvikioReader(0, ReadOptions())
    reader.open(plan)
    out: dict = {"stored": stored, "tensors": len(plan.compressed)}
    if mode == "groups":
        biggest = max(align_up(t.entry.stored_bytes, 4096) for t in plan.compressed)
        size = max(512 << 20, biggest)  # two buffers of 512 MiB (or the largest tensor): the default until session 11
        groups = _groups(plan.compressed, size)
        slots = [reader.allocate(size) for _ in range(2)]
        t = time.perf_counter()
        pending = None
        for i, g in enumerate(groups):
            w = reader.submit([Extent(x.file_index, x.file_offset, x.entry.stored_bytes, off) for x, off in g], slots[i % 2])
            if pending is not None:
                pending()
            pending = w
        pending()
        out.update(seconds=time.perf_counter() - t, groups=len(groups))
        reader.close()
        return out
    if mode in ("alone", "alonegroups"):
        import threading

        from gdsload.loader.codecs import GpuCodecs
        places, cursor = [], 0
        for x in plan.compressed:
            places.append(cursor)
            cursor = align_up(cursor + x.entry.stored_bytes, 4096)
        buf, arena = reader.allocate(cursor), reader.allocate(plan.arena_bytes)
        reader.read([Extent(x.file_index, x.file_offset, x.entry.stored_bytes, at) for x, at in zip(plan.compressed, places)], buf)
        reader.close()
        codecs = GpuCodecs(0, None)
        count, stop = [0], threading.Event()

        def spin() -> None:
            while not stop.is_set():
                count[0] += 1

        from gdsload.loader.decode import DEFAULT_STAGING, STAGING_SLOTS
        where = dict(zip((x.entry.name for x in plan.compressed), places))
        batches = ([[x for x, _ in g] for g in _groups(plan.compressed, DEFAULT_STAGING // STAGING_SLOTS)]
                   if mode == "alonegroups" else [plan.compressed])
        out["batches"] = len(batches)

        def decode_all() -> None:
            for batch in batches:
                codecs.decode_many([(x.entry, buf[where[x.entry.name] : where[x.entry.name] + x.entry.stored_bytes],
                                     arena[x.arena_offset : x.arena_offset + x.entry.nbytes],
                                     plan.files[x.file_index].path) for x in batch])
                sync()
                codecs.finish()

        decode_all()  # warm-up: nvCOMP's first calls set up
        spinner = threading.Thread(target=spin)
        spinner.start()
        t = time.perf_counter()
        c0 = count[0]
        decode_all()
        out["decode_seconds"] = time.perf_counter() - t
        during = (count[0] - c0) / out["decode_seconds"]
        t, c0 = time.perf_counter(), count[0]
        time.sleep(out["decode_seconds"])
        idle = (count[0] - c0) / (time.perf_counter() - t)
        stop.set()
        spinner.join()
        out["spinner_pace_during_decode"] = during / idle if idle else None
        return out
    # whole: one read per file of its compressed span, into one buffer
    spans = {}
    for x in plan.compressed:
        lo, hi = spans.get(x.file_index, (x.file_offset, x.file_offset))
        spans[x.file_index] = (min(lo, x.file_offset), max(hi, x.file_offset + x.entry.stored_bytes))
    base, cursor = {}, 0
    for i, (lo, hi) in sorted(spans.items()):
        base[i] = cursor
        cursor = align_up(cursor + hi - lo, 4096)
    buf = reader.allocate(cursor)
    t = time.perf_counter()
    reader.read([Extent(i, lo, hi - lo, base[i]) for i, (lo, hi) in sorted(spans.items())], buf)
    out["read_seconds"] = time.perf_counter() - t
    reader.close()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3])))
        sys.exit(0)
    if sys.argv[1] == "native":
        from gdsload.loader.compress import compress_dir
        from gdsload.loader.compression import CODECS
        CODECS["ans"] = ("native", "chunks")
        print(compress_dir(sys.argv[2], sys.argv[3], codec="ans", device="cuda"))
        sys.exit(0)
    rounds, path, d, modes = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    with open(path, "w") as fh:
        for rnd in range(rounds):
            k = rnd % len(modes)
            for m in modes[k:] + modes[:k]:
                mode, _, other = m.partition("@")
                p = subprocess.run([sys.executable, __file__, "worker", other or d, mode], capture_output=True, text=True,
                                   timeout=120)
                rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
                rec = {"round": rnd, "mode": m, **(rows[0] if rows else {"err": p.stderr[-400:]})}
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                print(json.dumps(rec)[:400], flush=True)
