"""Options several commands share, declared once: the digest a manifest records, progress, JSON output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..loader.format.digests import ALGORITHMS, DEFAULT

__all__ = ["digest_options", "digest_choice", "progress_option", "json_option"]

F = TypeVar("F", bound=Callable[..., Any])


def digest_options(recorded: str = "in gdsload.json") -> Callable[[F], F]:
    """``--digest/--no-digest`` and ``--digest-algorithm``: what the manifest records for each file written."""

    def apply(f: F) -> F:
        f = click.option(
            "--digest-algorithm",
            type=click.Choice(ALGORITHMS),
            default=DEFAULT,
            show_default=True,
            help="blake3 (fast, on every core), or sha256: the id Hugging Face's LFS would record for these files.",
        )(f)
        return click.option(
            "--digest/--no-digest",
            default=True,
            show_default=True,
            help=f"Record each file's digest {recorded} (hashed on the way to disk).",
        )(f)

    return apply


def digest_choice(digest: bool, algorithm: str) -> bool | str:
    """What the writers take for the flags: True for the default algorithm, its name for another, False for none."""
    return False if not digest else True if algorithm == DEFAULT else algorithm


progress_option = click.option(
    "--progress/--no-progress",
    "show_progress",
    default=None,
    help="Progress on stderr (a bar on a terminal, a line every few seconds otherwise; default: on a terminal, "
    "or when the work takes a second or more).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
