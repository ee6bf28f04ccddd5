"""``gdsload compress SRC OUT``: a thin shell over :func:`gdsload.loader.prepare.compress.compress_dir`."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from ..loader import format_bytes
from ..loader.codecs.registry import codec_names
from .cli import DEVICE

from .options import digest_choice, digest_options, json_option, progress_option
from .progress import progress_bar


def _total_bytes(src: Path) -> int:
    files = [src] if src.is_file() else sorted(src.rglob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


@click.command()
@click.argument("src", type=click.Path(exists=True))
@click.argument("out", type=click.Path())
@click.option(
    "--codec",
    type=click.Choice(["auto", *codec_names()]),
    default="auto",
    show_default=True,
    help="auto: ans where nvCOMP runs, else zstd. ans (GPU, best ratio and speed), gdeflate (GPU), "
    "zstd (GPU or CPU; CPU hosts can load it).",
)
@click.option(
    "--min-gain",
    type=float,
    default=0.02,
    show_default=True,
    help="Keep a tensor raw unless it shrinks by at least this fraction.",
)
@click.option(
    "--device", type=DEVICE, default=None, help="Where to compress: cuda[:N] or cpu (default: cuda when nvCOMP works)."
)
@digest_options("in gdsload.json when the output is a directory")
@progress_option
@json_option
def compress(
    src: str,
    out: str,
    codec: str,
    min_gain: float,
    device: str | None,
    digest: bool,
    digest_algorithm: str,
    show_progress: bool | None,
    as_json: bool,
) -> None:
    """Re-pack a safetensors directory (or file) as compressed, aligned safetensors with the same names.

    \b
        gdsload compress /models/llama3-tp2 /models/llama3-tp2-z            # ANS on a GPU, else Zstd
    """
    from ..loader.prepare.compress import compress_dir, compress_file, resolve_codec

    src_p = Path(src)
    if Path(out).exists():  # a file as well as a directory: nothing is overwritten, the source least of all
        raise click.UsageError(f"OUT {out!r} already exists; choose a new path (nothing was written)")
    codec = resolve_codec(codec, device)
    if codec == "ans" and device != "cpu":  # ANS's GPU context is made while the compressor's libraries import
        from ..loader.devices import start_primary_context

        start_primary_context(int(device.partition(":")[2] or 0) if device else 0)
    with progress_bar(f"compress ({codec})", _total_bytes(src_p), enabled=show_progress) as step:
        if src_p.is_file():
            # One file: no manifest records a digest, so none is computed.
            stats = compress_file(
                src_p, out, codec=codec, min_gain=min_gain, device=device, progress=step, digest=False
            )
        else:
            stats = compress_dir(
                src_p,
                out,
                codec=codec,
                min_gain=min_gain,
                device=device,
                digest=digest_choice(digest, digest_algorithm),
                progress=step,
            )
    if as_json:
        click.echo(json.dumps({"out": out, "codec": codec, **asdict(stats), "ratio": stats.ratio}, indent=2))
        return
    click.echo(
        f"{out}: {stats.compressed} of {stats.tensors} tensors compressed with {codec}; "
        f"{format_bytes(stats.logical_bytes)} -> {format_bytes(stats.stored_bytes)} "
        f"(ratio {stats.ratio:.3f}) in {stats.seconds:.1f} s"
    )
    for dtype, (logical, stored) in sorted(stats.per_dtype.items()):
        click.echo(f"  {dtype}: ratio {logical / stored:.3f} over {format_bytes(logical)}")
