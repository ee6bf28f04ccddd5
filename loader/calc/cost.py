"""Checkpoint compression money math: GPU idle time and storage, raw versus compressed checkpoints.

While a synchronous checkpoint is written every GPU of the job waits. Compressing on the GPU first shrinks the
bytes to write; with compression and writing pipelined (chunk *n+1* compresses while chunk *n* is written) the
wait is ``max(compress_time, write_time_of_compressed_bytes)``, otherwise their sum. Every figure comes from
measured inputs; units are decimal: GB = 10^9 bytes, GB/s = 10^9 bytes per second, a month = 30 days.

>>> from gdsload.loader.calc.cost import CostInputs, checkpoint_cost
>>> r = checkpoint_cost(CostInputs(checkpoint_bytes=782 * 10**9, ratio=1.25, compress_gbps=20, write_gbps=5,
...                                gpus=8, gpu_hour_usd=4.40, interval_s=1800, retention=5,
...                                storage_usd_gb_month=0.02))
>>> round(r.write_raw_s, 3), round(r.wait_pipelined_s, 3)   # 782 GB / 5 GB/s; max(782 / 160, 625.6 / 5)
(156.4, 125.12)
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = [
    "GB",
    "MONTH_SECONDS",
    "COMPRESS_SCOPES",
    "REPORT_KEYS",
    "CostInputs",
    "CostResult",
    "checkpoint_cost",
    "parse_duration",
    "read_report",
]

GB = 10**9
MONTH_SECONDS = 30 * 86400
"""A month is 30 days (2,592,000 s): 1440 checkpoints at a 30-minute interval."""

COMPRESS_SCOPES = ("per-gpu", "aggregate")
"""How ``compress_gbps`` was measured: by one GPU (all GPUs compress their share in parallel), or for the job."""

REPORT_KEYS: dict[str, str] = {
    "ratio": "uncompressed / compressed bytes (or give logical_bytes and stored_bytes)",
    "compress_gbps": "GB/s of uncompressed input (or give logical_bytes and compress_seconds)",
    "write_gbps": "storage write GB/s of compressed bytes (or give stored_bytes and write_seconds)",
    "compress_scope": "'per-gpu' (default: one GPU's measurement) or 'aggregate'",
    "logical_bytes": "uncompressed bytes of the measured checkpoint",
    "stored_bytes": "compressed bytes written",
    "compress_seconds": "seconds spent compressing logical_bytes",
    "write_seconds": "seconds spent writing stored_bytes",
}
"""Keys ``read_report`` understands in a JSON object (flat, or under a top-level ``"checkpoint"`` key)."""

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|hr|d)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}


def parse_duration(value: str | float, *, what: str = "--interval") -> float:
    """``"30m"`` -> 1800.0. Plain numbers are seconds; units s, m/min, h/hr, d.

    >>> parse_duration("1.5h"), parse_duration(90)
    (5400.0, 90.0)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(str(value))
        if not m:
            raise ConfigError(
                f"{what} {value!r} is not a duration; write seconds or a number with a unit: 90s, 30m, 1.5h, 1d"
            )
        seconds = float(m[1]) * _DURATION_UNITS[m[2].lower() if m[2] else None]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{what} {value!r} must be a positive duration")
    return seconds


def _number(doc: Mapping[str, Any], key: str, path: str) -> float | None:
    v = doc.get(key)
    if v is None:
        return None
    try:
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
    except OverflowError:  # an integer too large for a float
        ok = False
    if not ok:
        raise ConfigError(f"{path}: {key}={v!r} must be a positive number within a float's range")
    return float(v)


def read_report(path: str | Path) -> dict[str, Any]:
    """Measured ``ratio``, ``compress_gbps``, ``write_gbps`` and ``compress_scope`` from a JSON report.

    Keys are listed in :data:`REPORT_KEYS`; direct figures win over the ones derived from bytes and seconds.
    Only the figures found are returned.

    >>> import json, tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    ...     json.dump({"logical_bytes": 3e9, "stored_bytes": 2e9, "compress_seconds": 0.5}, f)
    >>> read_report(f.name)
    {'ratio': 1.5, 'compress_gbps': 6.0}
    """
    p = str(path)
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--from-report {p!r} is not a readable JSON report: {e}") from e
    if isinstance(doc, Mapping) and isinstance(doc.get("checkpoint"), Mapping):
        doc = doc["checkpoint"]
    if not isinstance(doc, Mapping):
        raise ConfigError(f"--from-report {p!r} holds a JSON {type(doc).__name__}; expected an object")
    logical, stored = _number(doc, "logical_bytes", p), _number(doc, "stored_bytes", p)
    c_s, w_s = _number(doc, "compress_seconds", p), _number(doc, "write_seconds", p)
    out: dict[str, Any] = {}
    ratio = _number(doc, "ratio", p) or (logical / stored if logical and stored else None)
    compress = _number(doc, "compress_gbps", p) or (logical / c_s / GB if logical and c_s else None)
    write = _number(doc, "write_gbps", p) or (stored / w_s / GB if stored and w_s else None)
    for key, value in (("ratio", ratio), ("compress_gbps", compress), ("write_gbps", write)):
        if value is not None:
            out[key] = value
    if "compress_scope" in doc:
        if doc["compress_scope"] not in COMPRESS_SCOPES:
            raise ConfigError(f"{p}: compress_scope={doc['compress_scope']!r} is not one of {list(COMPRESS_SCOPES)}")
        out["compress_scope"] = doc["compress_scope"]
    if not out:
        raise ConfigError(f"--from-report {p!r} has none of the known keys: {', '.join(REPORT_KEYS)}")
    return out


@dataclass(frozen=True)
class CostInputs:
    """Measured figures and prices. Sizes in bytes, speeds in GB/s (10^9 bytes/s), times in seconds.

    >>> CostInputs(10**12, 1.3, 50, 10, 8, 2.0, 1800, 3, 0.02).compress_scope
    'per-gpu'
    """

    checkpoint_bytes: int
    """Uncompressed bytes of one checkpoint, all ranks together."""
    ratio: float
    """Compression ratio, uncompressed / compressed (1.0: incompressible)."""
    compress_gbps: float
    """Compression throughput in GB/s of uncompressed input; see ``compress_scope``."""
    write_gbps: float
    """Storage write throughput in GB/s, aggregate over all writers."""
    gpus: int
    """GPUs of the job, all idle while a synchronous checkpoint is written."""
    gpu_hour_usd: float
    """Price of one GPU-hour in dollars."""
    interval_s: float
    """Seconds from one checkpoint to the next."""
    retention: int
    """Checkpoints kept on storage at any time."""
    storage_usd_gb_month: float
    """Storage price in dollars per GB-month."""
    compress_scope: str = "per-gpu"
    """``per-gpu``: one GPU's rate, every GPU compresses an equal share in parallel (aggregate = rate × gpus);
    ``aggregate``: the job's total rate."""
    month_s: float = MONTH_SECONDS
    """Seconds in the month the money is counted over."""

    def __post_init__(self) -> None:
        def positive(name: str, flag: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            try:
                ok = (
                    not isinstance(v, bool)
                    and isinstance(v, (int, float))
                    and math.isfinite(v)
                    and (v >= 0 if allow_zero else v > 0)
                )
            except OverflowError:  # an integer too large for a float
                ok = False
            if not ok:
                raise ConfigError(
                    f"{name} ({flag}) = {v!r} must be a {'non-negative' if allow_zero else 'positive'} number"
                )

        if type(self.checkpoint_bytes) is not int or self.checkpoint_bytes < 1:
            raise ConfigError(f"checkpoint_bytes (--size) = {self.checkpoint_bytes!r} must be a positive size")
        positive("ratio", "--ratio")
        if self.ratio < 1:
            raise ConfigError(
                f"ratio (--ratio) = {self.ratio!r} must be >= 1.0 (uncompressed / compressed; "
                "data that does not shrink is stored raw)"
            )
        positive("compress_gbps", "--compress-gbps")
        positive("write_gbps", "--write-gbps")
        if type(self.gpus) is not int or self.gpus < 1:
            raise ConfigError(f"gpus (--gpus) = {self.gpus!r} must be a positive integer")
        positive("gpu_hour_usd", "--gpu-hour-usd", allow_zero=True)
        positive("interval_s", "--interval")
        if type(self.retention) is not int or self.retention < 1:
            raise ConfigError(
                f"retention (--retention) = {self.retention!r} must be a positive integer (checkpoints kept)"
            )
        positive("storage_usd_gb_month", "--storage-usd-gb-month", allow_zero=True)
        if self.compress_scope not in COMPRESS_SCOPES:
            raise ConfigError(
                f"compress_scope (--compress-scope) = {self.compress_scope!r} is not known; "
                f"allowed values: {', '.join(COMPRESS_SCOPES)}"
            )
        positive("month_s", "month_s")

    @property
    def compress_gbps_aggregate(self) -> float:
        return self.compress_gbps * self.gpus if self.compress_scope == "per-gpu" else self.compress_gbps


@dataclass(frozen=True)
class CostResult:
    """Per checkpoint and per month, raw versus compressed. Seconds are wall time unless named GPU-seconds."""

    inputs: CostInputs
    compressed_bytes: float
    compress_gbps_aggregate: float
    write_raw_s: float
    compress_s: float
    write_compressed_s: float
    wait_pipelined_s: float
    """``max(compress_s, write_compressed_s)``."""
    wait_serial_s: float
    """``compress_s + write_compressed_s`` (no overlap)."""
    bound: str
    """What limits the pipelined wait: ``compress`` or ``write``."""
    saved_s: float
    """Wall seconds saved per checkpoint, pipelined (negative: compression makes the wait longer)."""
    saved_serial_s: float
    checkpoints_per_month: float
    idle_saved_gpu_s: float
    """GPU-seconds saved per checkpoint: ``saved_s × gpus``."""
    idle_saved_gpu_s_month: float
    idle_raw_usd_month: float
    idle_compressed_usd_month: float
    idle_saved_usd_month: float
    idle_saved_serial_usd_month: float
    stored_raw_gb: float
    stored_compressed_gb: float
    storage_saved_gb: float
    storage_saved_usd_month: float
    written_raw_gb_month: float
    written_compressed_gb_month: float
    total_saved_usd_month: float
    """GPU idle (pipelined) plus storage."""
    formulas: tuple[str, ...]
    breakeven: tuple[str, ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, inputs included."""
        doc = asdict(self)
        doc["inputs"]["compress_gbps_aggregate"] = self.compress_gbps_aggregate
        for key in ("formulas", "breakeven", "notes"):
            doc[key] = list(doc[key])
        return doc


def _usd(x: float) -> str:
    return f"-${-x:,.2f}" if x < 0 else f"${x:,.2f}"


def checkpoint_cost(inputs: CostInputs) -> CostResult:
    """The money math for ``inputs``; every formula is returned with its numbers filled in.

    Inputs so extreme that a result overflows (a rate of 1e-320 GB/s, a 400-digit GPU count) raise
    ``ConfigError`` rather than report ``inf`` or ``nan``.

    >>> r = checkpoint_cost(CostInputs(782 * 10**9, 1.0, 10, 5, 8, 4.40, 1800, 1, 0.0))
    >>> round(r.idle_raw_usd_month, 2)       # 156.4 s × 1440 checkpoints × 8 GPUs / 3600 × $4.40
    2202.11
    """
    try:
        result = _checkpoint_cost(inputs)
    except OverflowError as e:
        raise ConfigError(f"the inputs are too large to compute with ({e}): {_inputs_line(inputs)}") from None
    bad = [
        f.name
        for f in fields(result)
        if isinstance(getattr(result, f.name), float) and not math.isfinite(getattr(result, f.name))
    ]
    if bad:
        raise ConfigError(
            f"the inputs give a non-finite {', '.join(bad)}: {_inputs_line(inputs)}; "
            "use values within a few orders of magnitude of real ones"
        )
    return result


def _inputs_line(i: CostInputs) -> str:
    return ", ".join(f"{f.name}={getattr(i, f.name)!r}" for f in fields(i))


def _checkpoint_cost(inputs: CostInputs) -> CostResult:
    i = inputs
    size_gb = i.checkpoint_bytes / GB
    comp_gb = size_gb / i.ratio
    c_agg = i.compress_gbps_aggregate
    write_raw = size_gb / i.write_gbps
    compress = size_gb / c_agg
    write_comp = comp_gb / i.write_gbps
    wait = max(compress, write_comp)
    bound = "compress" if compress >= write_comp else "write"
    serial = compress + write_comp
    saved, saved_serial = write_raw - wait, write_raw - serial
    n = i.month_s / i.interval_s
    per_gpu_s_usd = i.gpus * i.gpu_hour_usd / 3600  # dollars per wall second of the whole job idling
    idle_raw_usd = write_raw * n * per_gpu_s_usd
    idle_comp_usd = wait * n * per_gpu_s_usd
    stored_raw, stored_comp = i.retention * size_gb, i.retention * comp_gb
    storage_saved_usd = (stored_raw - stored_comp) * i.storage_usd_gb_month
    idle_saved_usd = idle_raw_usd - idle_comp_usd
    scope = (
        f"{i.compress_gbps:g} GB/s per GPU × {i.gpus} GPUs"
        if i.compress_scope == "per-gpu"
        else f"{i.compress_gbps:g} GB/s aggregate"
    )
    formulas = (
        f"compressed size = {size_gb:,.3f} GB / ratio {i.ratio:g} = {comp_gb:,.3f} GB",
        f"aggregate compress rate = {scope} = {c_agg:,.3f} GB/s",
        f"write raw = {size_gb:,.3f} GB / {i.write_gbps:g} GB/s = {write_raw:,.3f} s",
        f"compress = {size_gb:,.3f} GB / {c_agg:,.3f} GB/s = {compress:,.3f} s",
        f"write compressed = {comp_gb:,.3f} GB / {i.write_gbps:g} GB/s = {write_comp:,.3f} s",
        f"wait pipelined = max({compress:,.3f}, {write_comp:,.3f}) = {wait:,.3f} s ({bound}-bound)",
        f"wait unpipelined = {compress:,.3f} + {write_comp:,.3f} = {serial:,.3f} s",
        f"saved per checkpoint = {write_raw:,.3f} - {wait:,.3f} = {saved:,.3f} s wall = {saved * i.gpus:,.1f} GPU-s",
        f"checkpoints per month = {i.month_s:,.0f} s / {i.interval_s:,.0f} s = {n:,.2f}",
        f"GPU idle saved per month = {saved * i.gpus:,.1f} GPU-s × {n:,.2f} = {saved * i.gpus * n:,.0f} GPU-s "
        f"= {saved * i.gpus * n / 3600:,.2f} GPU-h",
        f"idle $ per month raw = {write_raw:,.3f} s × {n:,.2f} × {i.gpus} GPUs / 3600 × ${i.gpu_hour_usd:g} "
        f"= {_usd(idle_raw_usd)}",
        f"idle $ per month compressed = {wait:,.3f} s × {n:,.2f} × {i.gpus} GPUs / 3600 × ${i.gpu_hour_usd:g} "
        f"= {_usd(idle_comp_usd)}",
        f"stored = {i.retention} kept × {size_gb:,.3f} GB = {stored_raw:,.1f} GB raw, "
        f"× {comp_gb:,.3f} GB = {stored_comp:,.1f} GB compressed",
        f"storage $ saved per month = {stored_raw - stored_comp:,.1f} GB × ${i.storage_usd_gb_month:g}/GB-month "
        f"= {_usd(storage_saved_usd)}",
    )
    be_pipe_per_gpu = i.write_gbps / i.gpus
    serial_need = i.write_gbps * i.ratio / (i.ratio - 1) if i.ratio > 1 else math.inf
    breakeven = [
        f"pipelined, compression shortens the wait only while the aggregate compress rate exceeds the storage "
        f"write rate: {c_agg:,.2f} GB/s {'>' if c_agg > i.write_gbps else '<='} {i.write_gbps:g} GB/s"
        + (f" (per GPU: needs > {be_pipe_per_gpu:,.3f} GB/s)" if i.compress_scope == "per-gpu" else "")
        + f" -> {'saves' if saved > 0 else 'does not save'} time",
        (
            f"unpipelined, it needs compress rate > write rate × r/(r-1) = {serial_need:,.2f} GB/s; "
            f"have {c_agg:,.2f} -> {'saves' if saved_serial > 0 else 'does not save'} time"
        )
        if i.ratio > 1
        else "unpipelined, ratio 1.0 never saves time",
        f"storage faster than {c_agg:,.2f} GB/s (pipelined) or {c_agg * (1 - 1 / i.ratio):,.2f} GB/s "
        "(unpipelined) would make compression cost time",
        f"pipelined wait is {bound}-bound; a ratio above "
        f"{c_agg / i.write_gbps:,.2f} (compress rate / write rate) saves no more time, only storage",
        f"storage: every ratio > 1 saves {1 - 1 / i.ratio:.1%} of the {i.retention} retained checkpoints "
        f"({stored_raw - stored_comp:,.1f} GB)",
    ]
    notes = []
    if max(write_raw, wait) >= i.interval_s:
        notes.append(
            f"a checkpoint takes {max(write_raw, wait):,.0f} s, not less than the {i.interval_s:,.0f} s "
            "interval: the job would do nothing but checkpoint"
        )
    if i.gpu_hour_usd == 0:
        notes.append("--gpu-hour-usd is 0: GPU idle dollars are 0")
    if i.storage_usd_gb_month == 0:
        notes.append("--storage-usd-gb-month is 0: storage dollars are 0")
    return CostResult(
        inputs=i,
        compressed_bytes=i.checkpoint_bytes / i.ratio,
        compress_gbps_aggregate=c_agg,
        write_raw_s=write_raw,
        compress_s=compress,
        write_compressed_s=write_comp,
        wait_pipelined_s=wait,
        wait_serial_s=serial,
        bound=bound,
        saved_s=saved,
        saved_serial_s=saved_serial,
        checkpoints_per_month=n,
        idle_saved_gpu_s=saved * i.gpus,
        idle_saved_gpu_s_month=saved * i.gpus * n,
        idle_raw_usd_month=idle_raw_usd,
        idle_compressed_usd_month=idle_comp_usd,
        idle_saved_usd_month=idle_saved_usd,
        idle_saved_serial_usd_month=saved_serial * n * per_gpu_s_usd,
        stored_raw_gb=stored_raw,
        stored_compressed_gb=stored_comp,
        storage_saved_gb=stored_raw - stored_comp,
        storage_saved_usd_month=storage_saved_usd,
        written_raw_gb_month=size_gb * n,
        written_compressed_gb_month=comp_gb * n,
        total_saved_usd_month=idle_saved_usd + storage_saved_usd,
        formulas=formulas,
        breakeven=tuple(breakeven),
        notes=tuple(notes),
    )
