"""``gdsload bench``: the benchmarks, one subcommand each; ``gdsload bench [run] MODEL_DIR`` is the cold-start one.

``run`` (the default: ``gdsload bench MODEL_DIR`` is ``gdsload bench run MODEL_DIR``) builds synthetic checkpoints,
times cold starts against every peer and the hardware limits, and draws the chart. The others each answer one
question (``gdsload bench SUBCOMMAND --help``); their modules keep their own argument parsers and run as
``python -m gdsload.bench.MODULE`` too.
"""

from __future__ import annotations

from pathlib import Path

import importlib
import sys

import click

from ..loader import parse_size
from ..loader.codecs.registry import codec_names
from ..server.cli import DEVICE_OR_AUTO
from ..server.options import progress_option


def _given(name: str) -> bool:
    """Whether the option ``name`` of the running command was given (not its default)."""
    return click.get_current_context().get_parameter_source(name) is not click.core.ParameterSource.DEFAULT


def _check_whole(path: str, what: str) -> None:
    """The bench loads one whole checkpoint on one device: refuse a tensor-parallel split."""
    from ..loader import GdsloadError
    from ..loader.format.discovery import list_ranks

    try:
        _, tp, ranks = list_ranks(path)
    except GdsloadError as e:
        raise click.UsageError(f"{what} {path!r}: {e}") from None
    if len(ranks) > 1:
        raise click.UsageError(
            f"{what} {path!r} holds {len(ranks)} ranks (tp={tp}); `gdsload bench` loads one whole "
            "checkpoint on one device: give it the unsharded copy, and time tensor-parallel loads "
            "with `python -m gdsload.bench.multi_gpu`"
        )


def _check_compressed(path: str) -> None:
    from ..loader import discover, read_header
    from ..loader.format.compression import parse_compression

    if not any(parse_compression(read_header(f)) for f in discover(path, 0).files):
        raise click.UsageError(
            f"--compressed {path!r} holds no compressed tensors; make the copy with "
            f"`gdsload compress {path} OUT` and pass OUT"
        )


def _generator_device(device: str) -> str:
    """Draw synthetic values on the GPU when the bench targets one that torch can use."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return device
    return "cpu"


@click.command("run")
@click.argument("model_dir", required=False, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--compressed",
    "compressed_dir",
    type=click.Path(exists=True, file_okay=False),
    help="A compressed copy of MODEL_DIR (gdsload compress), for the :compressed methods.",
)
@click.option("--methods", default=None, help="Comma-separated methods (default: every one installed here).")
@click.option("--cold", "conditions", flag_value="cold", multiple=True, help="Page cache dropped before each run.")
@click.option("--warm", "conditions", flag_value="warm", multiple=True, help="Files in the page cache.")
@click.option("--tmpfs", "conditions", flag_value="tmpfs", multiple=True, help="A copy of the files in /dev/shm.")
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Runs per method and condition (median, min, max shown).",
)
@click.option(
    "--device",
    type=DEVICE_OR_AUTO,
    default="auto",
    show_default=True,
    help="Where the loads go: auto (cuda when torch sees a CUDA device, else cpu), cuda, cuda:N or cpu.",
)
@click.option(
    "--out",
    default="bench-out",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where results.json and chart.png go (with --make-model: where the model goes).",
)
@click.option(
    "--experts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="With --make-model: a Mixtral with this many experts per layer (0: a Llama).",
)
@click.option(
    "--make-model",
    "make_model",
    default=None,
    help="Instead of benchmarking, write a synthetic Llama-shaped bf16 checkpoint of this size to --out.",
)
@click.option(
    "--tp", type=click.IntRange(min=1), default=1, show_default=True, help="With --make-model: ranks to split it into."
)
@click.option(
    "--max-file-size",
    "max_file_bytes",
    default="5GiB",
    show_default=True,
    help="With --make-model: start a new part file before one would exceed this.",
)
@click.option(
    "--codec",
    "--compress",
    "compress_codec",
    type=click.Choice(codec_names()),
    default=None,
    help="With --make-model: also write OUT-CODEC, compressed with this codec.",
)
@click.option(
    "--writer",
    type=click.Choice(["gdsload", "safetensors"]),
    default="gdsload",
    show_default=True,
    help="With --make-model: gdsload's aligned files and manifest, or the safetensors library's "
    "save_file with Hugging Face's part names and index (the same values; tp=1).",
)
@click.option(
    "--ttr/--no-ttr",
    default=True,
    show_default=True,
    help="Also time `gdsload serve` from process start to /readyz 200 under each condition.",
)
@click.option(
    "--plot",
    "plot_json",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="Only draw chart.png from an existing results.json.",
)
@progress_option
def run(
    model_dir: str | None,
    compressed_dir: str | None,
    methods: str | None,
    conditions: tuple[str, ...],
    repeat: int,
    device: str,
    out: str,
    make_model: str | None,
    tp: int,
    max_file_bytes: str,
    compress_codec: str | None,
    writer: str,
    ttr: bool,
    plot_json: str | None,
    experts: int,
    show_progress: bool | None,
) -> None:
    """Time cold starts of every loader on the same checkpoint, next to the hardware limits."""
    if plot_json:
        import json

        from .plot import plot

        try:
            doc = json.loads(Path(plot_json).read_text())
            if not isinstance(doc, dict) or not {"config", "summary", "limits", "facts"} <= set(doc):
                raise ValueError("it has no config, summary, limits and facts")
            if (
                not isinstance(doc["config"], dict)
                or not {"conditions", "methods", "device", "repeat"} <= set(doc["config"])
                or not isinstance(doc["facts"], dict)
                or "date" not in doc["facts"]
            ):
                raise ValueError("its config or facts lack what the chart names")
            drawn = {"method", "condition", "median_gbps", "min_gbps", "max_gbps"}
            if not isinstance(doc["summary"], list) or not all(isinstance(r, dict) for r in doc["summary"]):
                raise ValueError("its summary is not a list of rows")
            if not any(drawn <= set(r) for r in doc["summary"]):
                raise ValueError("no method has a successful run to draw")
            if any("median_gbps" in r and not drawn <= set(r) for r in doc["summary"]):
                raise ValueError(f"a summary row lacks one of {sorted(drawn)}")
        except (ValueError, UnicodeDecodeError) as e:
            raise click.UsageError(f"--plot {plot_json!r} is not a results.json of `gdsload bench` ({e})") from None
        target = Path(out) if _given("out") else Path(plot_json).parent
        target.mkdir(parents=True, exist_ok=True)
        click.echo(plot(doc, target / "chart.png"))
        return
    if device.startswith("cuda") and not make_model:
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError(f"--device {device} but torch sees no CUDA device here; use --device cpu")
    if make_model:
        from ..loader.prepare.synthetic import make_checkpoint, make_hf_checkpoint, shape_for_size

        if writer == "safetensors" and tp != 1:
            raise click.UsageError(
                f"--writer safetensors writes a whole checkpoint, as published; --tp {tp} needs --writer gdsload"
            )

        for target in [Path(out)] + ([Path(f"{out.rstrip('/')}-{compress_codec}")] if compress_codec else []):
            if target.exists() and any(target.iterdir()):  # old part files would sit beside the new model
                raise click.UsageError(f"{str(target)!r} is not empty; --make-model writes into a new directory")
        if compress_codec:
            from ..loader.prepare.compress import compress_device

            compress_device(compress_codec, None)  # a GPU-only codec without nvCOMP: refused before the model is made
        shape = shape_for_size(parse_size(make_model), experts=experts)
        gen = _generator_device(device)
        click.echo(f"synthetic {'Mixtral' if experts else 'Llama'}: {shape} (values drawn on {gen})")
        from ..loader.prepare.synthetic import model_bytes
        from ..server.progress import progress_bar

        total = model_bytes(shape)
        with progress_bar("make model", total, enabled=show_progress) as step:
            if writer == "safetensors":
                make_hf_checkpoint(out, shape, max_file_bytes=parse_size(max_file_bytes), device=gen, progress=step)
            else:
                make_checkpoint(out, shape, tp=tp, max_file_bytes=parse_size(max_file_bytes), device=gen, progress=step)
        if compress_codec:
            from ..loader.prepare.compress import compress_dir

            with progress_bar(f"compress ({compress_codec})", total, enabled=show_progress) as step:
                stats = compress_dir(out, f"{out.rstrip('/')}-{compress_codec}", codec=compress_codec, progress=step)
            click.echo(f"compressed with {compress_codec}: ratio {stats.ratio:.3f}")
        return
    if not model_dir:
        raise click.UsageError("give MODEL_DIR, or --make-model SIZE, or --plot results.json")
    if not any(Path(model_dir).glob("*.safetensors")):
        raise click.UsageError(f"MODEL_DIR {model_dir!r} holds no .safetensors files")
    _check_whole(model_dir, "MODEL_DIR")
    names = methods.split(",") if methods else []
    if compressed_dir:
        _check_whole(compressed_dir, "--compressed")
        _check_compressed(compressed_dir)
    elif any(m.endswith(":compressed") for m in names):
        raise click.UsageError("a :compressed method needs --compressed DIR (a copy made by `gdsload compress`)")
    from .coldstart import BenchConfig, conditions_in_memory, format_table, run_bench

    conditions = tuple(dict.fromkeys(conditions)) or ("tmpfs", "warm", "cold")
    not_run = conditions_in_memory(conditions, model_dir, compressed_dir)
    if len(not_run) == len(conditions):
        raise click.UsageError(f"--{conditions[0]}: {not_run[conditions[0]]}")
    cfg = BenchConfig(
        model_dir=Path(model_dir),
        compressed_dir=Path(compressed_dir) if compressed_dir else None,
        methods=names,
        repeat=repeat,
        device=device,
        out=Path(out),
        conditions=conditions,
        ttr=ttr,
    )
    doc = run_bench(cfg, log=click.echo)
    click.echo(format_table(doc))
    for m, why in doc["skipped"].items():
        click.echo(f"skipped {m}: {why}")
    for c, why in doc["conditions_skipped"].items():
        click.echo(f"skipped condition {c}: {why}")
    try:
        from .plot import plot

        click.echo(f"chart: {plot(doc, cfg.out / 'chart.png')}")
    except ImportError:
        click.echo("chart: matplotlib is not installed (pip install matplotlib); draw it later with --plot")
    click.echo(f"results: {cfg.out / 'results.json'}")


# The benchmarks that answer one question each: subcommand -> (module, one line of help). Each module's ``main(argv)``
# parses its own arguments.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "shard": ("shard_bench", "gdsload shard against vLLM's save_sharded_state, per layout: wall time, peak memory"),
    "checkpoint": ("ckpt_bench", "training checkpoints: the loop's stall, save, restore (torch.save, DCP, gdsload)"),
    "ratio": ("ckpt_ratio", "how well trained state compresses, by part (weights, AdamW moments), per codec"),
    "cpu": ("cpu_load", "CPU loads: gdsload against safetensors' load_file, from tmpfs, the page cache and cold"),
    "verify": ("verify_cost", "what checking every load costs: the same load with verify off and at its default"),
    "multi-gpu": ("multi_gpu", "tensor parallel on one host: every rank in its own process on its own GPU"),
    "serve": ("ttr", "the sidecar's time to ready: gdsload serve started, /readyz polled"),
    "restart": ("restart", "an engine restarting against a warm sidecar: adopted, copied, or read again"),
    "vllm": ("vllm_load", "loads inside vLLM: gdsload's load format against vLLM's own"),
}


def _passthrough(name: str, module: str, summary: str) -> click.Command:
    def invoke(args: tuple[str, ...]) -> None:
        mod = importlib.import_module(f"gdsload.bench.{module}")
        code = mod.main(list(args)) if _takes_argv(mod.main) else _call_with_argv(mod.main, args, name)
        if code:
            sys.exit(code)

    return click.Command(
        name,
        callback=invoke,
        help=summary,
        short_help=summary,
        add_help_option=False,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
    )


def _takes_argv(fn: object) -> bool:
    import inspect

    return bool(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def _call_with_argv(fn: object, args: tuple[str, ...], name: str) -> int | None:
    """A ``main()`` that reads ``sys.argv`` itself: run it with the subcommand's arguments there."""
    saved = sys.argv
    sys.argv = [f"gdsload bench {name}", *args]
    try:
        return fn()  # type: ignore[operator]
    finally:
        sys.argv = saved


class _BenchGroup(click.Group):
    """``gdsload bench ARGS``: a subcommand's name first, else ``run`` (the cold-start bench) takes ARGS."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group("bench", cls=_BenchGroup)
def bench() -> None:
    """Benchmarks: cold starts against every peer (`run`, the default), and one question each in the others."""


bench.add_command(run)
for _name, (_module, _summary) in SUBCOMMANDS.items():
    bench.add_command(_passthrough(_name, _module, _summary))
