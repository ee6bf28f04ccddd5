"""``gdsload shard``: the thin command around :mod:`gdsload.loader.prepare.shard` (parse, call, show progress)."""

from __future__ import annotations

import dataclasses
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
from gdsload.loader.config import format_bytes
from gdsload.loader.devices import start_primary_context
from gdsload.loader.format.digests import ALGORITHMS, DEFAULT
from gdsload.loader.format.manifest import redigest
from gdsload.loader.prepare.gpu_shard import GpuShardWriter, compression_totals, gpu_for
from gdsload.loader.prepare.shard import PARTIAL_DIR, ShardOptions, execute_plan, plan_shard

from .cli import SIZE

__all__ = ["shard"]


def _digest_option(digest: bool, algorithm: str) -> bool | str:
    """``ShardOptions.digest`` for the flags: True for the default algorithm, its name for another, False for none."""
    return False if not digest else True if algorithm == DEFAULT else algorithm


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
              help="Compress the files (ans/gdeflate need a GPU; zstd also loads on CPU hosts). ANS without "
                   "--quantize is built and compressed on the GPU, without torch.")
@click.option("--digest/--no-digest", default=True, show_default=True,
              help="Record each file's digest in gdsload.json (hashed on the way to disk).")
@click.option("--digest-algorithm", type=click.Choice(ALGORITHMS), default=DEFAULT, show_default=True,
              help="blake3 (fast, on every core), or sha256: the id Hugging Face's LFS would record for these files.")
@click.option("--progress/--no-progress", "show_progress", default=None,
              help="Progress bar on stderr (default: when stderr is a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def shard(src: str, out: str, tp: int, layout: str, quantize: str | None, max_file_bytes: int, codec: str | None,
          digest: bool, digest_algorithm: str, show_progress: bool | None, as_json: bool) -> None:
    """Pre-shard the Hugging Face checkpoint SRC (Llama, Mistral, Qwen2) into OUT by TP rank.

    Streams tensor by tensor; rerunning after an interruption resumes.

    \b
        gdsload shard /models/Llama-3-8B /models/llama3-tp2-fp8 --tp 2 --quantize fp8
    """
    if codec == "ans":  # the GPU's context is made while the headers are read and cupy imports
        start_primary_context(0)
    options = ShardOptions(tp=tp, layout=layout, quantize=quantize, max_file_bytes=max_file_bytes,
                           digest=_digest_option(digest, digest_algorithm), compress=codec)
    plan = plan_shard(src, options)
    uncompressed = Path(out).with_name(f".{Path(out).name}.uncompressed")
    # A rerun continues the way its run began: shards beside OUT (through torch), or files built on the GPU.
    gpu = gpu_for(plan) if codec is not None and not uncompressed.exists() else None
    if codec is not None and gpu is None and _unfinished_fingerprint(Path(out)) == plan.fingerprint:
        raise click.UsageError(
            f"OUT {out!r} holds an unfinished run of this command that built its files on a GPU, and that cannot "
            "run here now (GPU memory, cupy, kvikio or GDSLOAD_BACKEND: run with -v to see which); rerun where it "
            f"can, or delete {out!r} to start over")
    if codec is not None and gpu is None:
        # Sharded through torch, then compressed: what would stop the compression is checked first.
        compress_device(codec, None)  # CodecError: a GPU-only codec on a host without nvCOMP
        # The digests are of the compressed files; the shards on the way to them are not hashed.
        plan.options = dataclasses.replace(options, digest=False)
        if Path(out).exists():
            if not _is_this_compressed_output(Path(out), plan.fingerprint, codec):
                raise click.UsageError(f"OUT {out!r} already exists; with --compress it must be a new directory")
            # A run stopped after its compressed output appeared, before it removed the uncompressed shards.
            shutil.rmtree(uncompressed, ignore_errors=True)
            redigest(Path(out), options.digest)  # the same files, the digests this run asks for
            click.echo(f"{out!r} already holds this command's compressed output; nothing to do")
            return
    console = Console(stderr=True)
    enabled = console.is_terminal if show_progress is None else show_progress
    columns = (TextColumn("[bold]shard[/] tp={task.fields[tp]}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    # On a GPU, ANS files are built and compressed there and written into OUT (resumable as usual).
    # Otherwise the shards are written beside OUT first (resumable), then compressed into OUT, which
    # appears only when complete.
    two_step = codec is not None and gpu is None
    target = uncompressed if two_step else Path(out)
    writer = GpuShardWriter(plan, gpu) if gpu is not None else None
    with Progress(*columns, console=console, disable=not enabled, transient=False) as bar:
        task = bar.add_task("shard", total=plan.total_bytes, tp=tp)
        result = execute_plan(plan, target, progress=lambda n: bar.advance(task, n), files_writer=writer)
    compression = None
    if two_step:
        stats = compress_dir(target, out, codec=codec, digest=options.digest)
        shutil.rmtree(target)
        result.out = str(out)  # the uncompressed shards it reports were a step on the way
        compression = {"codec": codec, "ratio": stats.ratio, "stored_bytes": stats.stored_bytes,
                       "gpu_without_torch": False}
    elif writer is not None:
        logical, stored = compression_totals([Path(result.out) / f.relpath for f in plan.files])
        compression = {"codec": codec, "ratio": logical / stored if stored else 1.0, "stored_bytes": stored,
                       "gpu_without_torch": True}
    if as_json:
        doc = asdict(result)
        if compression is not None:
            doc["compression"] = compression
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        click.echo(result.summary())
        if compression is not None:
            where = f" on GPU {gpu}, without torch" if writer is not None else ""
            click.echo(f"compressed with {codec}{where}: {format_bytes(compression['stored_bytes'])} stored, "
                       f"ratio {compression['ratio']:.3f}")


def _unfinished_fingerprint(out: Path) -> str | None:
    """The fingerprint of the unfinished `gdsload shard` run in ``out``, if there is one."""
    try:
        return json.loads((out / PARTIAL_DIR / "state.json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


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
