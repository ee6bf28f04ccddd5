"""The ``gdsload`` command line. A thin shell: parse, call the library, format.

Only this boundary turns a :class:`GdsloadError` (or an ``OSError``) into a one-line message and a
non-zero exit.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import click

# Only light modules here: subcommands import torch-backed parts of the library when they run,
# so `gdsload --help` and the sidecar's parent process start without importing torch.
from ..loader.version import __version__
from ..loader.config import format_bytes, parse_size
from ..loader.errors import GdsloadError

from .signals import stop_on_sigterm

__all__ = ["main", "cli"]


class _Size(click.ParamType):
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value, what=param.name if param else "size")
        except GdsloadError as e:
            self.fail(str(e), param, ctx)


SIZE = _Size()


class _Device(click.ParamType):
    """A device name a load can target: ``cpu``, ``cuda`` or ``cuda:N`` (and ``auto`` where allowed: cuda when torch
    sees a CUDA device, else cpu)."""

    name = "device"

    def __init__(self, auto: bool = False):
        self.auto = auto

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if self.auto and value == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", str(value)):
            self.fail(f"{value!r} is not a device; use {'auto, ' if self.auto else ''}cpu, cuda or cuda:N", param, ctx)
        return str(value)


DEVICE = _Device()
DEVICE_OR_AUTO = _Device(auto=True)


# Subcommands that live in their own modules: name -> "module:attr", imported when used.
_LAZY_COMMANDS: dict[str, str] = {
    "compress": "gdsload.server.cmd_compress:compress",
    "doctor": "gdsload.server.cmd_doctor:doctor",
    "shard": "gdsload.server.cmd_shard:shard",
    "plan": "gdsload.server.cmd_plan:plan",
    "serve": "gdsload.server.cmd_serve:serve",
    "demo": "gdsload.server.cmd_demo:demo",
    "cost": "gdsload.server.cmd_cost:cost",
    # The benchmark lives in gdsload.bench; the shell names it here and imports it only when run.
    "bench": "gdsload.bench.cli:bench",
}


class _LazyGroup(click.Group):
    """A group whose heavier subcommands are imported only when they run (or when help lists them)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in _LAZY_COMMANDS:
            module, attr = _LAZY_COMMANDS[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gdsload")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """gdsload: load model weights into GPU memory as fast as the hardware allows."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@cli.command()
@click.argument("path", type=click.Path(exists=True))
@click.option("--tensors", is_flag=True, help="List every tensor.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(path: str, tensors: bool, as_json: bool) -> None:
    """Show ranks, files, tensors, dtypes, bytes, alignment and compression of a checkpoint."""
    from ..loader import read_header
    from ..loader.format.compression import parse_compression
    from ..loader.format.discovery import scan_layout

    scanned = scan_layout(path)
    source, ranks = scanned.source, scanned.ranks
    doc: dict[str, Any] = {
        "path": str(Path(path).resolve()),
        "source": source,
        "tp_size": scanned.tp_size,
        "pp_size": scanned.pp_size,
        "ep_size": scanned.ep_size,
        "ranks": {},
    }
    for rank, files in sorted(ranks.items()):
        out = []
        for f in files:
            h = read_header(f)
            packed = parse_compression(h)
            entry: dict[str, Any] = {
                "file": Path(f).name,
                "bytes": h.file_size,
                "tensors": len(h.tensors),
                "dtypes": dict(Counter(packed[t.name].dtype if t.name in packed else t.dtype for t in h.tensors)),
                "data_offset": h.data_offset,
                "data_aligned_4k": h.data_aligned,
                "misaligned_tensors": len(h.misaligned()),
                "metadata": h.metadata,
            }
            if packed:
                stored = sum(e.stored_bytes for e in packed.values())
                logical = sum(e.nbytes for e in packed.values())
                entry["compression"] = {
                    "tensors": len(packed),
                    "codecs": dict(Counter(e.codec for e in packed.values())),
                    "stored_bytes": stored,
                    "logical_bytes": logical,
                    "ratio": round(logical / stored, 3) if stored else None,
                }
            if tensors:
                entry["tensor_list"] = []
                for t in h.tensors:
                    row = {
                        "name": t.name,
                        "dtype": t.dtype,
                        "shape": list(t.shape),
                        "offset": h.data_offset + t.start,
                        "bytes": t.nbytes,
                    }
                    if t.name in packed:  # what it decodes to
                        e = packed[t.name]
                        row.update(
                            dtype=e.dtype,
                            shape=list(e.shape),
                            codec=e.codec,
                            logical_bytes=e.nbytes,
                            stored_dtype=t.dtype,
                        )
                    entry["tensor_list"].append(row)
            out.append(entry)
        doc["ranks"][rank] = out
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(
        f"{doc['path']}: {source} layout, tp={scanned.tp_size} pp={scanned.pp_size} ep={scanned.ep_size}, "
        f"{len(ranks)} rank(s)"
    )
    for rank, files in doc["ranks"].items():
        for e in files:
            dtypes = ", ".join(f"{k}×{v}" for k, v in sorted(e["dtypes"].items()))
            align = "data@4K" if e["data_aligned_4k"] else f"data@{e['data_offset']} (unaligned)"
            mis = f", {e['misaligned_tensors']} misaligned" if e["misaligned_tensors"] else ""
            c = e.get("compression")
            packed_note = (
                (
                    f", {c['tensors']} compressed ({', '.join(f'{k}×{v}' for k, v in sorted(c['codecs'].items()))}:"
                    f" {format_bytes(c['stored_bytes'])} for {format_bytes(c['logical_bytes'])},"
                    f" ratio {c['ratio']})"
                )
                if c
                else ""
            )
            click.echo(
                f"  rank {rank}  {e['file']}: {format_bytes(e['bytes'])}, {e['tensors']} tensors ({dtypes}), "
                f"{align}{mis}{packed_note}"
            )
            for t in e.get("tensor_list", []):
                codec = f"  {t['codec']}: {format_bytes(t['bytes'])} stored" if "codec" in t else ""
                size = format_bytes(t.get("logical_bytes", t["bytes"]))
                click.echo(f"      {t['name']}  {t['dtype']}{t['shape']}  @{t['offset']}  {size}{codec}")


@cli.command()
@click.argument("path", type=click.Path(exists=True))
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="The rank to load (global: pipeline stage x tensor-parallel size + tensor-parallel rank).",
)
@click.option("--device", type=DEVICE, default="cpu", show_default=True, help="Target device: cpu, cuda, cuda:N.")
@click.option("--backend", default=None, help="auto (default) or a backend name; env GDSLOAD_BACKEND.")
@click.option("--threads", "num_threads", type=int, default=None, help="Reader threads; env GDSLOAD_NUM_THREADS.")
@click.option(
    "--chunk", "chunk_bytes", type=SIZE, default=None, help="Largest read, e.g. 16MiB; env GDSLOAD_CHUNK_BYTES."
)
@click.option(
    "--verify/--no-verify",
    default=None,
    help="--verify: also check the manifest digests, and fail on anything unchecked; --no-verify: check nothing (default: every tensor against its recorded checksum); env GDSLOAD_VERIFY.",
)
@click.option(
    "--progress/--no-progress",
    "show_progress",
    default=None,
    help="Progress on stderr (a bar on a terminal, a line every few seconds otherwise).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def load(
    path: str,
    rank: int,
    device: str,
    backend: str | None,
    num_threads: int | None,
    chunk_bytes: int | None,
    verify: bool | None,
    show_progress: bool | None,
    as_json: bool,
) -> None:
    """Load one rank and print the load report."""
    from ..loader import discover, load_rank

    from .progress import progress_bar

    total = sum(os.path.getsize(f) for f in discover(path, rank).files)
    with progress_bar(f"load rank {rank}", total, enabled=show_progress) as step:
        result = load_rank(
            path,
            rank,
            device=device,
            backend=backend,
            num_threads=num_threads,
            chunk_bytes=chunk_bytes,
            verify=verify,
            progress=step,
        )
    print_report(result.report, as_json)


def print_report(report: Any, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(report.summary())
    phases = "  ".join(f"{k}={v * 1000:.1f}ms" for k, v in report.phases.items())
    click.echo(f"  phases: {phases}")
    click.echo(
        f"  stored {format_bytes(report.stored_bytes)}, logical {format_bytes(report.logical_bytes)}, "
        f"source={report.source}, verified={report.verified}"
    )
    for f in report.files:
        extra = f", {f.copied_tensors} copied (misaligned)" if f.copied_tensors else ""
        click.echo(
            f"  {Path(f.path).name}: io={f.io_mode}, {f.tensors} tensors, {format_bytes(f.logical_bytes)}{extra}"
        )


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``gdsload`` command."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] != ["serve"]:  # serve stops its workers in order on SIGTERM; the rest unwind as on Ctrl-C
        stop_on_sigterm()
    as_json = "--json" in args
    try:
        cli.main(args=args, prog_name="gdsload", standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted", "Abort", 130, as_json)
    except click.ClickException as e:
        if as_json:
            _fail(e.format_message(), type(e).__name__, e.exit_code, True)
        e.show()
        sys.exit(e.exit_code)
    except (GdsloadError, OSError) as e:  # OSError: an unwritable output, a path that vanished, ...
        _fail(str(e), type(e).__name__, 1, as_json)


def _fail(message: str, kind: str, code: int, as_json: bool) -> None:
    """The one line a failed command leaves: on stderr, and with ``--json`` as a JSON object on stdout too."""
    if as_json:
        click.echo(json.dumps({"error": {"type": kind, "message": message, "exit_code": code}}))
    click.echo(f"error: {message}" if kind != "Abort" else message, err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
