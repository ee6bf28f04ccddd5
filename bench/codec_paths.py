"""Micro-benchmark of nvCOMP codecs on weight-like data: ratio, encode and decode GB/s.

Compares, on N(0, 0.02) bf16 (and fp8/fp32 variants):
- ANS ``NVCOMP_NATIVE`` per tensor, for several ``data_type`` choices and tensor sizes,
  decoding into a caller-provided buffer (as the loader does);
- ANS on split byte planes (high and low byte of each bf16 compressed separately);
- Zstd and GDeflate ``NATIVE``, and Zstd ``RAW`` chunks through the batch API.

    python -m gdsload.bench.codec_paths --out codecs.json

It informs the choice of the compressed format's defaults.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _time(fn, repeat: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    from nvidia import nvcomp

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = []

    def rec(**r):
        print(json.dumps(r), flush=True)
        results.append(r)

    g = torch.Generator(device="cuda").manual_seed(0)
    MiB = 1 << 20
    base = (0.02 * torch.randn(512 * MiB // 2, device="cuda", generator=g)).to(torch.bfloat16)
    data = {
        "bf16": base.view(torch.uint8),
        "fp8": (base.float() * 20).to(torch.float8_e4m3fn).view(torch.uint8),
        "fp32": (0.02 * torch.randn(128 * MiB // 4, device="cuda", generator=g)).view(torch.uint8),
    }

    def native(kind: str, src: torch.Tensor, **opts):
        try:
            codec = nvcomp.Codec(**opts)
            enc = codec.encode(nvcomp.as_array(src))
            out = torch.empty_like(src)
            dec_cfg = codec.decompression_config(enc)
            te = _time(lambda: codec.encode(nvcomp.as_array(src)))
            td = _time(lambda: codec.decode(enc, out=nvcomp.as_array(out), decompression_config=dec_cfg))
            td_cfg = _time(lambda: codec.decode(enc, out=nvcomp.as_array(out)))
            ok = torch.equal(out, src)
            rec(kind=kind, bytes=src.numel(), opts={k: str(v) for k, v in opts.items()},
                ratio=src.numel() / enc.buffer_size, enc_gbps=src.numel() / te / 1e9,
                dec_gbps=src.numel() / td / 1e9, dec_gbps_with_configure=src.numel() / td_cfg / 1e9, exact=ok)
        except Exception as e:
            rec(kind=kind, opts={k: str(v) for k, v in opts.items()}, error=repr(e))

    for dt in ("<f2", "|u1", "<u2"):
        native("ans-native", data["bf16"], algorithm="ANS", data_type=dt)
    for size in (16 * MiB, 64 * MiB, 256 * MiB):
        native("ans-native-size", data["bf16"][:size], algorithm="ANS", data_type="<f2")
    for chunk in (16384, 65536, 262144):
        native("ans-native-chunk", data["bf16"], algorithm="ANS", data_type="<f2", uncomp_chunk_size=chunk)
    for dt in ("|u1", "|i1", "|f1"):
        native("ans-fp8", data["fp8"], algorithm="ANS", data_type=dt)
    for dt in ("<f4", "<u4", "|u1", "<f2"):
        native("ans-fp32", data["fp32"], algorithm="ANS", data_type=dt)
    native("ans-checksum", data["bf16"], algorithm="ANS", data_type="<f2",
           checksum_policy=nvcomp.ChecksumPolicy.COMPUTE_AND_VERIFY)
    native("zstd-native", data["bf16"], algorithm="Zstd")
    native("gdeflate-native", data["bf16"], algorithm="GDeflate")
    # Byte planes: bf16 = [low byte, high byte] little-endian.
    planes = data["bf16"].view(-1, 2)
    lo, hi = planes[:, 0].contiguous(), planes[:, 1].contiguous()
    for name, plane in (("plane-hi", hi), ("plane-lo", lo)):
        native(name, plane, algorithm="ANS", data_type="|u1")
    # Zstd RAW chunks, batch API (what CPU-decodable files use).
    for chunk in (65536, 262144, 1 << 20):
        try:
            codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW)
            src = data["bf16"][: 256 * MiB]
            pieces = list(src.split(chunk))
            batch = nvcomp.as_arrays(pieces)
            enc = codec.encode(batch)
            outs = [torch.empty_like(p) for p in pieces]
            out_batch = nvcomp.as_arrays(outs)
            td = _time(lambda: codec.decode(enc, out=out_batch))
            total = sum(enc[i].buffer_size for i in range(len(pieces)))
            rec(kind="zstd-raw-batch", chunk=chunk, ratio=src.numel() / total, dec_gbps=src.numel() / td / 1e9,
                exact=all(torch.equal(a, b) for a, b in zip(outs, pieces)))
        except Exception as e:
            rec(kind="zstd-raw-batch", chunk=chunk, error=repr(e))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
