"""``gdsload doctor [PATH ...]``: what this host offers for fast loading, and what to fix."""

from __future__ import annotations

import json

import click

from ..loader.doctor import diagnose, format_report


@click.command()
@click.argument("paths", nargs=-1, type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(paths: tuple[str, ...], as_json: bool) -> None:
    """Check GPUs, PCIe, nvidia-fs, P2PDMA, cufile.json, kvikio, nvCOMP and O_DIRECT/Lustre on PATHs.

    Without PATHs: GDSLOAD_MODEL_DIR (where set), the current directory and /dev/shm.
    """
    report = diagnose(list(paths) or None)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else format_report(report))
