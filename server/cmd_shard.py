"""``gdsload shard``: the thin command around :mod:`gdsload.loader.prepare.shard` (parse, call, show progress)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from gdsload.loader.codecs.registry import codec_names
from gdsload.loader.prepare.compress import compress_device, compress_dir
from gdsload.loader.prepare.shard import ShardOptions, execute_plan, plan_shard

from .cli import SIZE

__all__ = ["shard"]


@click.command("shard")
@click.argument("src", type=click.Path(file_okay=False, exists=True))
@click.argument("out", type=click.Path(dir_okay=True, file_okay=False))
@click.option("--tp", type=int, required=True, help="Tensor-parallel size: write files for ranks 0..N-1.")
@click.option("--layout", type=click.Choice(["vllm", "hf"]), default="vllm", show_default=True,
              help="vllm: fused per-rank parameters for vLLM's sharded_state loader; hf: HF names, per-rank slices.")
@click.option("--quantize", default=None, metavar="fp8[:per-tensor|per-channel]",
              help="Quantize linear-layer weights to float8_e4m3fn with fp32 scales.")
@click.option("--max-file-size", "max_file_bytes", type=SIZE, default="5GiB", show_default=True,
              help="Start a new part file before one would exceed this.")
@click.option("--compress", "codec", type=click.Choice(codec_names()), default=None,
              help="Then compress the shards (ans/gdeflate need a GPU; zstd also loads on CPU hosts).")
@click.option("--digest/--no-digest", default=True, show_default=True,
              help="Record each file's sha256 in gdsload.json.")
@click.option("--progress/--no-progress", "show_progress", default=None,
              help="Progress bar on stderr (default: when stderr is a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def shard(src: str, out: str, tp: int, layout: str, quantize: str | None, max_file_bytes: int, codec: str | None,
          digest: bool, show_progress: bool | None, as_json: bool) -> None:
    """Pre-shard the Hugging Face checkpoint SRC (Llama, Mistral, Qwen2) into OUT by TP rank.

    Streams tensor by tensor; rerunning after an interruption resumes.

    \b
        gdsload shard /models/Llama-3-8B /models/llama3-tp2-fp8 --tp 2 --quantize fp8
    """
    # With --compress, the digests are of the compressed files; the shards on the way to them are not hashed.
    options = ShardOptions(tp=tp, layout=layout, quantize=quantize, max_file_bytes=max_file_bytes,
                           digest=digest and codec is None)
    if codec is not None:  # what would stop the compression is checked before the sharding work
        compress_device(codec, None)  # CodecError: a GPU-only codec on a host without nvCOMP
    plan = plan_shard(src, options)
    if codec is not None and Path(out).exists():
        uncompressed = Path(out).with_name(f".{Path(out).name}.uncompressed")
        if not _is_this_compressed_output(Path(out), plan.fingerprint, codec):
            raise click.UsageError(f"OUT {out!r} already exists; with --compress it must be a new directory")
        # A run stopped after its compressed output appeared, before it removed the uncompressed shards.
        shutil.rmtree(uncompressed, ignore_errors=True)
        click.echo(f"{out!r} already holds this command's compressed output; nothing to do")
        return
    console = Console(stderr=True)
    enabled = console.is_terminal if show_progress is None else show_progress
    columns = (TextColumn("[bold]shard[/] tp={task.fields[tp]}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    # With --compress the shards are written beside OUT first (resumable as usual), then compressed
    # into OUT, which appears only when complete.
    target = Path(out) if codec is None else Path(out).with_name(f".{Path(out).name}.uncompressed")
    with Progress(*columns, console=console, disable=not enabled, transient=False) as bar:
        task = bar.add_task("shard", total=plan.total_bytes, tp=tp)
        result = execute_plan(plan, target, progress=lambda n: bar.advance(task, n))
    if codec is not None:
        stats = compress_dir(target, out, codec=codec, digest=digest)
        shutil.rmtree(target)
        result.out = str(out)  # the uncompressed shards it reports were a step on the way
    if as_json:
        doc = asdict(result)
        if codec is not None:
            doc["compression"] = {"codec": codec, "ratio": stats.ratio, "stored_bytes": stats.stored_bytes}
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        click.echo(result.summary())
        if codec is not None:
            click.echo(f"compressed with {codec}: {stats.compressed} of {stats.tensors} tensors, ratio {stats.ratio:.3f}")


def _is_this_compressed_output(out: Path, fingerprint: str, codec: str) -> bool:
    """Whether ``out`` is the finished output of this very ``shard --compress`` command."""
    from gdsload.loader.errors import GdsloadError
    from gdsload.loader.format.manifest import Manifest

    try:
        extra = Manifest.read(out).extra
    except (GdsloadError, OSError):
        return False
    return (extra.get("shard", {}).get("fingerprint") == fingerprint
            and extra.get("compression", {}).get("codec") == codec)
