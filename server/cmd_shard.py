"""``gdsload shard``: the thin command around :mod:`gdsload.loader.prepare.shard` (parse, call, show progress)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import click

from ..loader.codecs.registry import codec_names
from ..loader.prepare.compress import compress_device, compress_dir
from ..loader.config import format_bytes
from ..loader.devices import start_primary_context
from ..loader.format.manifest import redigest
from ..loader.prepare.gpu_shard import GpuShardWriter, compression_totals, gpu_for
from ..loader.prepare.shard import LAYOUT_SOURCES, PARTIAL_DIR, ShardOptions, execute_plan, plan_shard

from .cli import SIZE
from .options import digest_choice, digest_options, json_option, progress_option
from .progress import progress_bar

__all__ = ["shard"]


@click.command("shard")
@click.argument("src", type=click.Path(file_okay=False, exists=True))
@click.argument("out", type=click.Path(dir_okay=True, file_okay=False))
@click.option(
    "--tp",
    "--tensor-parallel-size",
    "tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Tensor-parallel size.",
)
@click.option(
    "--pp",
    "--pipeline-parallel-size",
    "pp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Pipeline-parallel size (stages); files are named model-pp-P-tp-T-part-N as vLLM names them.",
)
@click.option(
    "--ep",
    "--expert-parallel-size",
    "ep",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Expert-parallel size: 1, or the tensor-parallel size (vLLM's --enable-expert-parallel).",
)
@click.option(
    "--enable-expert-parallel",
    "enable_ep",
    is_flag=True,
    help="Spread the experts over the tensor-parallel ranks (the same as --ep TP).",
)
@click.option(
    "--layout",
    type=click.Choice(["vllm", "hf"]),
    default="vllm",
    show_default=True,
    help="vllm: each rank's state dict as vLLM builds it (its sharded_state loader reads it too); "
    "hf: HF names, per-rank slices (Llama family, tensor parallel).",
)
@click.option(
    "--layout-source",
    type=click.Choice(LAYOUT_SOURCES),
    default="auto",
    show_default=True,
    help="Where a vllm layout comes from: vLLM's own model code when vLLM is installed (auto), vLLM "
    "(required), or gdsload's built-in Llama-family rules.",
)
@click.option(
    "--vllm-python",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="The python of an environment with vLLM, when vLLM is not installed next to gdsload.",
)
@click.option(
    "--quantize",
    "--quantization",
    "quantize",
    default=None,
    metavar="fp8[:per-tensor|per-channel]",
    help="Quantize the weights vLLM's fp8 method covers to float8_e4m3fn with fp32 scales.",
)
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    help="The parameters' dtype, as vLLM's --dtype (auto: as vLLM picks it for the checkpoint).",
)
@click.option("--trust-remote-code", is_flag=True, help="Let vLLM run the model repository's configuration code.")
@click.option(
    "--max-file-size",
    "max_file_bytes",
    type=SIZE,
    default="5GiB",
    show_default=True,
    help="Start a new part file before one would exceed this.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Files written at once, each by its own process (default: one per core, as memory allows).",
)
@click.option(
    "--codec",
    "--compress",
    "codec",
    type=click.Choice(codec_names()),
    default=None,
    help="Compress the files with this codec (ans/gdeflate need a GPU; zstd also loads on CPU hosts). ANS without "
    "--quantize is built and compressed on the GPU, without torch.",
)
@digest_options()
@progress_option
@json_option
def shard(
    src: str,
    out: str,
    tp: int,
    pp: int,
    ep: int,
    enable_ep: bool,
    layout: str,
    layout_source: str,
    vllm_python: str | None,
    quantize: str | None,
    dtype: str,
    trust_remote_code: bool,
    max_file_bytes: int,
    workers: int | None,
    codec: str | None,
    digest: bool,
    digest_algorithm: str,
    show_progress: bool | None,
    as_json: bool,
) -> None:
    """Pre-shard the Hugging Face checkpoint SRC into OUT, one set of files per rank.

    With vLLM installed, each rank holds exactly what vLLM's own model code places on it, for every
    architecture vLLM serves and any tensor x pipeline x expert layout; without it, Llama-family
    models shard by gdsload's built-in tensor-parallel rules. Reads each rank's regions of the
    source once, files in parallel; rerunning after an interruption resumes.

    \b
        gdsload shard /models/Mixtral-8x7B /models/mixtral-tp4-ep --tp 4 --enable-expert-parallel
        gdsload shard /models/Llama-3-8B /models/llama3-tp2-fp8 --tp 2 --quantize fp8
    """
    if enable_ep and ep not in (1, tp):
        raise click.UsageError(
            f"--enable-expert-parallel spreads the experts over the {tp} tensor-parallel ranks; "
            f"it cannot be combined with --ep {ep}"
        )
    ep = tp if enable_ep else ep
    if codec == "ans":  # the GPU's context is made while the headers are read and cupy imports
        start_primary_context(0)
    options = ShardOptions(
        tp=tp,
        pp=pp,
        ep=ep,
        layout=layout,
        layout_source=layout_source,
        quantize=quantize,
        max_file_bytes=max_file_bytes,
        digest=digest_choice(digest, digest_algorithm),
        compress=codec,
        dtype=dtype,
        vllm_python=vllm_python,
        trust_remote_code=trust_remote_code,
        workers=workers,
    )
    plan = plan_shard(src, options)
    uncompressed = Path(out).with_name(f".{Path(out).name}.uncompressed")
    # A rerun continues the way its run began: shards beside OUT (through torch), or files built on the GPU.
    gpu = gpu_for(plan) if codec is not None and not uncompressed.exists() else None
    if codec is not None and gpu is None and _unfinished_fingerprint(Path(out)) == plan.fingerprint:
        raise click.UsageError(
            f"OUT {out!r} holds an unfinished run of this command that built its files on a GPU, and that cannot "
            "run here now (GPU memory, cupy, kvikio or GDSLOAD_BACKEND: run with -v to see which); rerun where it "
            f"can, or delete {out!r} to start over"
        )
    if codec is not None and gpu is None:
        # Sharded through torch, then compressed: what would stop the compression is checked first.
        compress_device(codec, None)  # CodecError: a GPU-only codec on a host without nvCOMP
        # The digests are of the compressed files; the shards on the way to them are not hashed.
        plan.options = dataclasses.replace(options, digest=False)
        if Path(out).exists():
            if not _is_this_compressed_output(Path(out), plan.fingerprint, codec):
                raise click.UsageError(f"OUT {out!r} already exists; with --codec it must be a new directory")
            # A run stopped after its compressed output appeared, before it removed the uncompressed shards.
            shutil.rmtree(uncompressed, ignore_errors=True)
            redigest(Path(out), options.digest)  # the same files, the digests this run asks for
            click.echo(f"{out!r} already holds this command's compressed output; nothing to do")
            return
    # On a GPU, ANS files are built and compressed there and written into OUT (resumable as usual).
    # Otherwise the shards are written beside OUT first (resumable), then compressed into OUT, which
    # appears only when complete.
    two_step = codec is not None and gpu is None
    target = uncompressed if two_step else Path(out)
    writer = GpuShardWriter(plan, gpu) if gpu is not None else None
    with progress_bar(f"shard ({options.parallel})", plan.total_bytes, enabled=show_progress) as step:
        result = execute_plan(plan, target, progress=step, files_writer=writer)
    compression = None
    if two_step:
        with progress_bar(f"compress ({codec})", plan.total_bytes, enabled=show_progress) as step:
            stats = compress_dir(target, out, codec=codec, digest=options.digest, progress=step)
        shutil.rmtree(target)
        result.out = str(out)  # the uncompressed shards it reports were a step on the way
        compression = {
            "codec": codec,
            "ratio": stats.ratio,
            "stored_bytes": stats.stored_bytes,
            "gpu_without_torch": False,
        }
    elif writer is not None:
        logical, stored = compression_totals([Path(result.out) / f.relpath for f in plan.files])
        compression = {
            "codec": codec,
            "ratio": logical / stored if stored else 1.0,
            "stored_bytes": stored,
            "gpu_without_torch": True,
        }
    if as_json:
        doc = asdict(result)
        if compression is not None:
            doc["compression"] = compression
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        click.echo(result.summary())
        if compression is not None:
            where = f" on GPU {gpu}, without torch" if writer is not None else ""
            click.echo(
                f"compressed with {codec}{where}: {format_bytes(compression['stored_bytes'])} stored, "
                f"ratio {compression['ratio']:.3f}"
            )


def _unfinished_fingerprint(out: Path) -> str | None:
    """The fingerprint of the unfinished `gdsload shard` run in ``out``, if there is one."""
    try:
        return json.loads((out / PARTIAL_DIR / "state.json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def _is_this_compressed_output(out: Path, fingerprint: str, codec: str) -> bool:
    """Whether ``out`` is the finished output of this very ``shard --compress`` command."""
    from ..loader.errors import GdsloadError
    from ..loader.format.manifest import Manifest

    try:
        extra = Manifest.read(out).extra
    except (GdsloadError, OSError):
        return False
    return (
        extra.get("shard", {}).get("fingerprint") == fingerprint and extra.get("compression", {}).get("codec") == codec
    )
