"""Layouts from the installed vLLM: every rank's :class:`~.recipe.Recipe`\\ s, traced from vLLM's own model code.

:mod:`.vllm_trace` runs in a child process (vLLM's import and its logging stay out of this one) with the
interpreter that has vLLM — this one, or another environment's (``--vllm-python``) — and prints each rank's
recipes; this module writes its request, reads its answer and turns a failure into a typed error that
quotes vLLM's own words.

>>> vllm_interpreter(None)  # this interpreter, if it can import vLLM  # doctest: +SKIP
'/usr/bin/python3'
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import GdsloadError
from ..format.ranks import ParallelLayout
from . import vllm_trace
from .layout_rules import ShardConfigError
from .quantize import QuantScheme, quantization_config
from .recipe import Recipe
from .source import SourceCheckpoint, UnsupportedModelError

__all__ = ["EngineLayout", "vllm_interpreter", "trace_layout", "VllmNotFoundError"]

log = logging.getLogger(__name__)


class VllmNotFoundError(GdsloadError, FileNotFoundError):
    """``--vllm-python`` names no interpreter, or one without vLLM."""


@dataclass(frozen=True)
class EngineLayout:
    """What vLLM places on each rank, and what it says about the model."""

    architecture: str
    """vLLM's model class name (``architectures[0]`` as vLLM resolved it)."""
    vllm_version: str
    dtype: str
    """The model dtype vLLM builds the parameters in (safetensors name)."""
    ranks: dict[int, list[Recipe]]
    seconds: float


def vllm_interpreter(given: str | os.PathLike[str] | None) -> str | None:
    """The interpreter that traces layouts: ``given``, else this one when it can import vLLM, else None."""
    if given is not None:
        path = Path(given)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise VllmNotFoundError(
                f"--vllm-python {str(given)!r} is not an executable file; give the python of an "
                "environment where vLLM is installed (e.g. /opt/vllm/bin/python)"
            )
        return str(path)
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    return sys.executable if found else None


def _request(
    source: SourceCheckpoint,
    layout: ParallelLayout,
    scheme: QuantScheme | None,
    dtype: str,
    trust_remote_code: bool,
    ranks: list[int] | None,
) -> dict[str, Any]:
    tensors = [
        [name, loc.info.dtype, list(loc.info.shape), loc.path, list(loc.file_range)]
        for name, loc in source.tensors.items()
    ]
    overrides = {"quantization_config": quantization_config(scheme, ignored=["lm_head"])} if scheme else {}
    return {
        "format": vllm_trace.FORMAT,
        "source": str(source.root),
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "dtype": dtype,
        "hf_overrides": overrides,
        "tensors": tensors,
        "ranks": ranks,
        "trust_remote_code": trust_remote_code,
        "fp8_scales": None if scheme is None else ("channel" if scheme.per_channel else "tensor"),
    }


def trace_layout(
    source: SourceCheckpoint,
    layout: ParallelLayout,
    *,
    python: str,
    scheme: QuantScheme | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    ranks: list[int] | None = None,
) -> EngineLayout:
    """Ask the vLLM of ``python`` what each rank of ``layout`` holds (every rank, or ``ranks``).

    Raises :class:`ShardConfigError` when vLLM refuses the layout for this model (its own message),
    :class:`UnsupportedModelError` when vLLM does not serve the architecture or its loaders do something a
    trace cannot record, :class:`VllmNotFoundError` when ``python`` cannot import vLLM.
    """
    what = f"{source.config.architecture or 'the model'} for {layout}"
    log.info("asking vLLM (%s) what each of the %d rank(s) of %s holds", python, layout.world, what)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gdsload-trace-") as tmp:
        request_path, out_path = os.path.join(tmp, "request.json"), os.path.join(tmp, "layout.json")
        with open(request_path, "w") as f:
            json.dump(_request(source, layout, scheme, dtype, trust_remote_code, ranks), f)
        env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(
            [python, vllm_trace.__file__, request_path, out_path],
            env=env,
            cwd=tmp,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
        )
        try:
            with open(out_path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-12:])
            raise UnsupportedModelError(
                f"vLLM's layout of {what} could not be traced: {python} exited with {proc.returncode} and wrote no "
                f"answer; its last output:\n{tail}"
            ) from None
    if "error" in doc:
        kind, message = doc.get("kind"), doc["error"]
        if kind == "import":
            raise VllmNotFoundError(
                f"{python} cannot import vLLM ({message}); give --vllm-python the interpreter of "
                "an environment where vLLM is installed"
            )
        if kind == "vllm":
            raise ShardConfigError(f"vLLM refuses {what} of {str(source.root)!r}: {message}")
        raise UnsupportedModelError(
            f"vLLM's layout of {what} could not be traced: {message}. Shard it with vLLM's own "
            "save_sharded_state instead (gdsload loads its output), or use --layout-source builtin for a Llama-family model"
        )
    ranks_out = {int(r): [Recipe.from_json(e) for e in d["entries"]] for r, d in doc["ranks"].items()}
    result = EngineLayout(
        architecture=doc["architecture"],
        vllm_version=doc["vllm_version"],
        dtype=doc["dtype"],
        ranks=ranks_out,
        seconds=time.perf_counter() - start,
    )
    log.info(
        "vLLM %s laid out %s (%d ranks) in %.1f s",
        result.vllm_version,
        result.architecture,
        len(ranks_out),
        result.seconds,
    )
    return result
