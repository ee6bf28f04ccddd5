"""``gdsload cost``: the thin command around :mod:`gdsload.loader.calc.cost` (parse, call, format)."""

from __future__ import annotations

import json
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..loader.calc.cost import (
    COMPRESS_SCOPES,
    MONTH_SECONDS,
    REPORT_KEYS,
    CostInputs,
    CostResult,
    checkpoint_cost,
)
from ..loader.calc.cost import parse_duration, read_report

from .cli import SIZE

__all__ = ["cost"]

_REQUIRED = (
    ("checkpoint_bytes", "--size"),
    ("ratio", "--ratio"),
    ("compress_gbps", "--compress-gbps"),
    ("write_gbps", "--write-gbps"),
    ("gpus", "--gpus"),
    ("gpu_hour_usd", "--gpu-hour-usd"),
    ("retention", "--retention"),
    ("storage_usd_gb_month", "--storage-usd-gb-month"),
)

_EPILOG = (
    "Units are decimal: GB = 10^9 bytes, GB/s = 10^9 bytes/s; a month is 30 days (1440 checkpoints at --interval "
    "30m). --size takes 782GB, 782000000000 or 728GiB.\n\n"
    '--from-report PATH reads a JSON object (flat, or under a "checkpoint" key) with any of these keys; flags '
    "given on the command line win:\n\n"
    "\b\n" + "\n".join(f"  {k:<17} {v}" for k, v in REPORT_KEYS.items()) + "\n\n"
    "Example: the figures of NVIDIA's nvCOMP checkpoint article (70B: 782 GB per checkpoint, 5 GB/s storage, "
    "8 GPUs at $4.40 per GPU-hour, every 30 minutes: $2,202 a month of idle GPUs without compression), with an "
    "illustrative ratio, codec rate, retention and storage price:\n\n"
    "\b\n"
    "  gdsload cost --size 782GB --ratio 1.27 --compress-gbps 50 --write-gbps 5 --gpus 8 \\\n"
    "      --gpu-hour-usd 4.40 --interval 30m --retention 10 --storage-usd-gb-month 0.10\n"
)


@click.command("cost", epilog=_EPILOG)
@click.option(
    "--size",
    "checkpoint_bytes",
    type=SIZE,
    default=None,
    help="Uncompressed size of one checkpoint, all ranks together (e.g. 782GB).",
)
@click.option("--ratio", type=float, default=None, help="Compression ratio, uncompressed / compressed.")
@click.option("--compress-gbps", type=float, default=None, help="Compression throughput, GB/s of uncompressed input.")
@click.option(
    "--compress-scope",
    default=None,
    help=f"How --compress-gbps was measured: {' or '.join(COMPRESS_SCOPES)} (per-gpu: one GPU; every GPU "
    "compresses its equal share in parallel)  [default: per-gpu]",
)
@click.option("--write-gbps", type=float, default=None, help="Storage write throughput, aggregate GB/s.")
@click.option("--gpus", type=int, default=None, help="GPUs in the job (all idle during a synchronous checkpoint).")
@click.option("--gpu-hour-usd", type=float, default=None, help="Price of one GPU-hour, $.")
@click.option("--interval", default="30m", show_default=True, help="Time between checkpoints: 1800, 30m, 1.5h.")
@click.option("--retention", type=int, default=None, help="Checkpoints kept on storage.")
@click.option("--storage-usd-gb-month", type=float, default=None, help="Storage price, $ per GB-month.")
@click.option(
    "--from-report",
    "report",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON with measured ratio / GB/s (keys below).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def cost(
    checkpoint_bytes: int | None,
    ratio: float | None,
    compress_gbps: float | None,
    compress_scope: str | None,
    write_gbps: float | None,
    gpus: int | None,
    gpu_hour_usd: float | None,
    interval: str,
    retention: int | None,
    storage_usd_gb_month: float | None,
    report: str | None,
    as_json: bool,
) -> None:
    """GPU idle time and dollars saved per month by compressing synchronous checkpoints.

    Per checkpoint: write time raw vs compressed, where the pipelined wait is max(compress, write of the
    compressed bytes) and the unpipelined one their sum; then GPU idle seconds, $ per month, storage kept and
    break-even points. Every formula is printed with its inputs.
    """
    values: dict[str, Any] = {
        "checkpoint_bytes": checkpoint_bytes,
        "ratio": ratio,
        "compress_gbps": compress_gbps,
        "compress_scope": compress_scope,
        "write_gbps": write_gbps,
        "gpus": gpus,
        "gpu_hour_usd": gpu_hour_usd,
        "retention": retention,
        "storage_usd_gb_month": storage_usd_gb_month,
    }
    origin = {k: "flag" for k, v in values.items() if v is not None}
    if click.get_current_context().get_parameter_source("interval") is ParameterSource.COMMANDLINE:
        origin["interval"] = "flag"
    if report:
        for key, value in read_report(report).items():
            if values.get(key) is None:
                values[key], origin[key] = value, f"report {report}"
    missing = [flag for key, flag in _REQUIRED if values[key] is None]
    if missing:
        raise click.UsageError(
            f"missing {', '.join(missing)}"
            + (
                " (ratio, compress and write GB/s may come from --from-report)"
                if any(f in missing for f in ("--ratio", "--compress-gbps", "--write-gbps"))
                else ""
            )
        )
    if values["compress_scope"] is None:
        values["compress_scope"] = "per-gpu"
        origin["compress_scope"] = "default"
    result = checkpoint_cost(CostInputs(interval_s=parse_duration(interval), month_s=MONTH_SECONDS, **values))
    if as_json:
        doc = result.to_dict()
        doc["inputs_from"] = origin
        click.echo(json.dumps(doc, indent=2))
    else:
        _show(result, origin)


def _usd(x: float) -> str:
    return f"-${-x:,.2f}" if x < 0 else f"${x:,.2f}"


def _show(r: CostResult, origin: dict[str, str]) -> None:
    i = r.inputs
    con = Console(highlight=False)
    if not con.is_terminal:
        con.width = 140
    inp = Table(title="Inputs", title_justify="left")
    for col in ("input", "value", "from"):
        inp.add_column(col)
    rows = (
        ("checkpoint size (uncompressed)", "checkpoint_bytes", f"{i.checkpoint_bytes / 1e9:,.3f} GB"),
        ("compression ratio", "ratio", f"{i.ratio:g}"),
        ("compress throughput", "compress_gbps", f"{i.compress_gbps:g} GB/s {i.compress_scope}"),
        ("storage write throughput", "write_gbps", f"{i.write_gbps:g} GB/s aggregate"),
        ("GPUs idle during a checkpoint", "gpus", f"{i.gpus}"),
        ("GPU price", "gpu_hour_usd", f"${i.gpu_hour_usd:g} per GPU-hour"),
        ("checkpoint interval", "interval", f"{i.interval_s:,.0f} s"),
        ("retention", "retention", f"{i.retention} checkpoints"),
        ("storage price", "storage_usd_gb_month", f"${i.storage_usd_gb_month:g} per GB-month"),
        ("month", "month", f"{i.month_s / 86400:g} days"),
    )
    for label, key, value in rows:
        inp.add_row(label, value, escape(origin.get(key, "default")))
    con.print(inp)

    per = Table(title="Per checkpoint (wall seconds; every GPU waits)", title_justify="left")
    for col, just in (
        ("", "left"),
        ("raw", "right"),
        ("compressed, pipelined", "right"),
        ("compressed, unpipelined", "right"),
    ):
        per.add_column(col, justify=just)  # type: ignore[arg-type]
    per.add_row(
        "bytes written",
        f"{i.checkpoint_bytes / 1e9:,.2f} GB",
        f"{r.compressed_bytes / 1e9:,.2f} GB",
        f"{r.compressed_bytes / 1e9:,.2f} GB",
    )
    per.add_row("compress", "-", f"{r.compress_s:,.2f} s", f"{r.compress_s:,.2f} s")
    per.add_row("write", f"{r.write_raw_s:,.2f} s", f"{r.write_compressed_s:,.2f} s", f"{r.write_compressed_s:,.2f} s")
    per.add_row(
        "wait", f"{r.write_raw_s:,.2f} s", f"{r.wait_pipelined_s:,.2f} s ({r.bound}-bound)", f"{r.wait_serial_s:,.2f} s"
    )
    per.add_row(
        "saved",
        "",
        f"{r.saved_s:,.2f} s = {r.saved_s * i.gpus:,.0f} GPU-s",
        f"{r.saved_serial_s:,.2f} s = {r.saved_serial_s * i.gpus:,.0f} GPU-s",
    )
    con.print(per)

    month = Table(title=f"Per month ({r.checkpoints_per_month:,.2f} checkpoints)", title_justify="left")
    for col, just in (("", "left"), ("raw", "right"), ("compressed", "right"), ("saved", "right")):
        month.add_column(col, justify=just)  # type: ignore[arg-type]
    hours = r.checkpoints_per_month * i.gpus / 3600
    month.add_row(
        "GPU idle",
        f"{r.write_raw_s * hours:,.1f} GPU-h",
        f"{r.wait_pipelined_s * hours:,.1f} GPU-h",
        f"{r.idle_saved_gpu_s_month:,.0f} GPU-s = {r.idle_saved_gpu_s_month / 3600:,.1f} GPU-h",
    )
    month.add_row(
        "GPU idle $",
        _usd(r.idle_raw_usd_month),
        _usd(r.idle_compressed_usd_month),
        _usd(r.idle_saved_usd_month) + f" (unpipelined {_usd(r.idle_saved_serial_usd_month)})",
    )
    month.add_row(
        f"stored ({i.retention} kept)",
        f"{r.stored_raw_gb:,.1f} GB",
        f"{r.stored_compressed_gb:,.1f} GB",
        f"{r.storage_saved_gb:,.1f} GB",
    )
    month.add_row(
        "storage $",
        _usd(r.stored_raw_gb * i.storage_usd_gb_month),
        _usd(r.stored_compressed_gb * i.storage_usd_gb_month),
        _usd(r.storage_saved_usd_month),
    )
    month.add_row(
        "written",
        f"{r.written_raw_gb_month:,.0f} GB",
        f"{r.written_compressed_gb_month:,.0f} GB",
        f"{r.written_raw_gb_month - r.written_compressed_gb_month:,.0f} GB",
    )
    month.add_row("[bold]total $ saved[/]", "", "", f"[bold]{_usd(r.total_saved_usd_month)}[/]")
    con.print(month)
    for title, lines, style in (
        ("Formulas", r.formulas, None),
        ("Break-even", r.breakeven, None),
        ("Notes", r.notes, "yellow"),
    ):
        if lines:
            con.print(f"[bold]{title}[/]")
            for line in lines:
                con.print(f"  • {line}", style=style, markup=False)
