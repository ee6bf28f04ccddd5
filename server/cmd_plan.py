"""``gdsload plan``: the thin command around :mod:`gdsload.loader.calc.capacity` (parse, call, format)."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..loader.calc import capacity
from ..loader.calc.capacity import (
    GIB,
    KV_BITS,
    MIB,
    PRESETS,
    WEIGHT_FORMATS,
    HbmBudget,
    BudgetInputs,
)

from .cli import SIZE

__all__ = ["plan"]


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _epilog() -> str:
    """A worked example, computed (never typed in) so the help cannot drift from the code."""
    spec = PRESETS["llama-3.1-405b"]
    kv16 = capacity.plan(BudgetInputs(spec, tp=8, weights="fp8", kv_bits=16))
    kv3 = capacity.plan(BudgetInputs(spec, tp=8, weights="fp8", kv_bits=3))
    cmd = "gdsload plan llama-3.1-405b --tp 8 --weights fp8"
    return (
        "Sizes: MiB/GiB are binary (2^20, 2^30 bytes), MB/GB decimal (10^6, 10^9). --gpu-memory is the total "
        "nvidia-smi reports for one GPU; the default is an H200 (143771 MiB = 150.75 GB, sold as '141 GB').\n\n"
        "Worked example, Llama 3.1 405B on 8 GPUs of that size:\n\n"
        "\b\n"
        f"  {cmd} --kv-bits 16   -> {kv16.max_tokens:>10,} tokens\n"
        f"  {cmd} --kv-bits 3    -> {kv3.max_tokens:>10,} tokens "
        f"({kv3.max_tokens / kv16.max_tokens:.2f}x: 3 bits plus an fp16 scale per 128 values)\n"
    )


@click.command("plan", epilog=_epilog())
@click.argument("model", required=False)
@click.option(
    "--tp",
    "--tensor-parallel-size",
    "tp",
    type=int,
    default=1,
    show_default=True,
    help="Tensor-parallel size (GPUs per model copy).",
)
@click.option(
    "--gpu-memory",
    type=SIZE,
    default=f"{BudgetInputs.gpu_memory // MIB}MiB",
    show_default=True,
    help="Total memory of ONE GPU as nvidia-smi reports it, e.g. 143771MiB (H200), 81559MiB (H100 80GB).",
)
@click.option("--weights", default="bf16", show_default=True, help=f"Weight format: {', '.join(WEIGHT_FORMATS)}.")
@click.option(
    "--kv-bits",
    type=int,
    default=16,
    show_default=True,
    help=f"KV-cache bits per element: {', '.join(map(str, KV_BITS))}.",
)
@click.option(
    "--gpu-memory-utilization",
    type=float,
    default=BudgetInputs.gpu_memory_utilization,
    show_default=True,
    help="vLLM's share of GPU memory for weights + activations + KV cache.",
)
@click.option(
    "--activation-reserve",
    type=SIZE,
    default=f"{BudgetInputs.activation_reserve // GIB}GiB",
    show_default=True,
    help="Per GPU: peak activations + non-PyTorch memory (from vLLM's start-up log).",
)
@click.option(
    "--cuda-graph-reserve",
    type=SIZE,
    default=f"{BudgetInputs.cuda_graph_reserve // GIB}GiB",
    show_default=True,
    help="Per GPU: memory of captured CUDA graphs (0 with --enforce-eager).",
)
@click.option(
    "--context",
    "--max-model-len",
    "--max-seq-len",
    "context",
    type=int,
    default=None,
    help="Tokens per request for the concurrency figure [default: the model's max_position_embeddings].",
)
@click.option(
    "--kv-group-size",
    type=int,
    default=BudgetInputs.kv_group_size,
    show_default=True,
    help="Quantized KV: elements sharing one scale.",
)
@click.option(
    "--kv-scale-bits",
    type=int,
    default=None,
    help="Quantized KV: scale (+ zero-point) bits per group [default: 16 for 4/3-bit KV, 0 for 16/8-bit].",
)
@click.option(
    "--block-size",
    type=int,
    default=BudgetInputs.block_size,
    show_default=True,
    help="KV-cache block (page) size in tokens.",
)
@click.option(
    "--kv-heads",
    "kv_cache_heads",
    type=int,
    default=None,
    help="What-if: size the KV cache for this many KV heads (weights unchanged).",
)
@click.option(
    "--quantize-embeddings",
    is_flag=True,
    help="Also quantize embed_tokens and lm_head (default: they stay 16-bit, as in vLLM).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plan(
    model: str | None,
    tp: int,
    gpu_memory: int,
    weights: str,
    kv_bits: int,
    gpu_memory_utilization: float,
    activation_reserve: int,
    cuda_graph_reserve: int,
    context: int | None,
    kv_group_size: int,
    kv_scale_bits: int | None,
    block_size: int,
    kv_cache_heads: int | None,
    quantize_embeddings: bool,
    as_json: bool,
) -> None:
    """HBM budget per GPU: weights, free memory, KV-cache tokens, context per request and concurrency.

    MODEL is a preset (llama-3.1-8b, llama-3.1-70b, llama-3.1-405b) or a Hugging Face config.json (or the
    directory holding it) of a dense decoder with a gated MLP (model_type llama, mistral, qwen2, qwen3, gemma,
    gemma2, granite, cohere, internlm2, olmo2 or phi3; of a multimodal config, its text_config). A plan
    "fits" when at least one request of --context tokens fits in the KV cache. Every assumption is printed
    with the result.

    \b
        gdsload plan llama-3.1-70b --tp 4 --weights fp8 --kv-bits 8 --context 32768
        gdsload plan /models/Qwen2-7B --kv-bits 4 --json
    """
    common: dict[str, Any] = dict(
        gpu_memory=gpu_memory,
        gpu_memory_utilization=gpu_memory_utilization,
        activation_reserve=activation_reserve,
        cuda_graph_reserve=cuda_graph_reserve,
        context=context,
        kv_group_size=kv_group_size,
        kv_scale_bits=kv_scale_bits,
        block_size=block_size,
        quantize_embeddings=quantize_embeddings,
    )
    if model is None:
        raise click.UsageError(f"MODEL is missing: a preset ({', '.join(PRESETS)}) or a path to a config.json")
    result = capacity.plan(
        BudgetInputs(
            capacity.resolve_model(model),
            tp=tp,
            weights=weights,
            kv_bits=kv_bits,
            kv_cache_heads=kv_cache_heads,
            **common,
        )
    )
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _show_plan(result)


def _console() -> Console:
    con = Console(highlight=False)
    if not con.is_terminal:
        con.width = 160  # piped or captured: wide enough that the tables don't wrap
    return con


def _show_plan(p: HbmBudget) -> None:
    i, m = p.inputs, p.inputs.model
    con = _console()
    con.print(
        f"[bold]{escape(m.name)}[/]: {m.layers} layers, hidden {m.hidden}, {m.heads} heads / {m.kv_heads} KV heads × "
        f"{m.head_dim}, intermediate {m.intermediate}, vocab {m.vocab}"
        f"{', tied embeddings' if m.tied_embeddings else ''}; {p.params / 1e9:,.2f} B parameters"
    )
    con.print(f"  source: {m.source}", markup=False)
    con.print(f"  tp {i.tp} × {i.gpu_memory // MIB} MiB, {i.weights} weights, {i.kv_bits}-bit KV cache")
    t = Table(title="Per GPU", title_justify="left")
    t.add_column("item")
    t.add_column("size", justify="right")
    t.add_column("how")
    t.add_row("GPU memory", _gib(i.gpu_memory), f"{i.gpu_memory // MIB} MiB = {i.gpu_memory / 1e9:.2f} GB")
    t.add_row("usable", _gib(p.usable_bytes), f"× gpu_memory_utilization {i.gpu_memory_utilization:g}")
    t.add_row(
        "− weights",
        _gib(p.weights_bytes),
        f"{i.weights}; params × bytes / tp = {_gib(p.weights_naive_bytes)}, replicated {_gib(p.replicated_bytes)}",
    )
    t.add_row("− activation reserve", _gib(i.activation_reserve), "--activation-reserve")
    t.add_row("− CUDA-graph reserve", _gib(i.cuda_graph_reserve), "--cuda-graph-reserve")
    t.add_row("= KV-cache budget", _gib(p.kv_budget_bytes), "" if p.fits else "[red]does not fit[/]")
    t.add_row(
        "KV bytes per token",
        f"{p.kv_bytes_per_token_per_gpu:,} B",
        f"{p.kv_heads_per_gpu} KV head(s)/GPU, {p.kv_effective_bits:.3f} bits/element"
        + (f", each head on {p.kv_replication} GPUs" if p.kv_replication > 1 else ""),
    )
    con.print(t)
    c = Table(title=f"Capacity (the TP group of {i.tp})", title_justify="left")
    c.add_column("figure")
    c.add_column("value", justify="right")
    c.add_row("tokens in the KV cache", f"{p.max_tokens:,}")
    c.add_row("max context per request", f"{p.max_context_per_request:,}")
    c.add_row(f"concurrent sequences of {p.context:,} tokens", f"{p.concurrent_sequences:,}")
    con.print(c)
    _bullets(con, "Formulas", p.formulas)
    _bullets(con, "Assumptions", p.assumptions)
    _bullets(con, "Notes", p.notes, style="yellow")


def _bullets(con: Console, title: str, lines: tuple[str, ...] | list[str], style: str = "") -> None:
    if not lines:
        return
    con.print(f"[bold]{title}[/]")
    for line in lines:
        con.print(f"  • {line}", style=style or None, markup=False)
