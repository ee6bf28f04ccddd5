"""The one interface every engine adapter shares: ``(name, tensor)`` pairs in, an :class:`InjectReport` out.

An adapter compares the checkpoint's names and shapes with what the model expects *before* it
writes anything, so a strict injection either fills every parameter or raises one
:class:`InjectError` that lists every missing and unexpected name and every shape mismatch.

Also here, shared by the engine adapters:

- :class:`AdapterOptions`: the options an engine passes through (vLLM/SGLang
  ``model_loader_extra_config``), validated with messages that name the key and the value;
- :func:`describe_checkpoint`: which layout (vllm, hf, trtllm) and tensor-parallel size a
  model directory holds;
- :func:`open_rank`: a rank's tensors, read from storage with ``load_rank`` or mapped from a
  running sidecar over IPC.

>>> report = inject_module(model, load_rank("/models/llama", 0))  # doctest: +SKIP
>>> print(report.summary())  # doctest: +SKIP
inject torch into LlamaForCausalLM: 291 tensors, 16.06 GB in 0.004 s zero-copy=291 missing=0 unexpected=0 mismatched=0
"""

from __future__ import annotations

import abc
import functools
import importlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Union

import torch

from ..config import format_bytes
from ..pipeline.config import LoadConfig
from ..format.discovery import scan_layout
from ..errors import BackendUnavailableError, ConfigError, GdsloadError
from ..pipeline.result import LoadReport, LoadResult

__all__ = [
    "Weights",
    "Target",
    "ShapeMismatch",
    "InjectReport",
    "InjectError",
    "LayoutError",
    "EngineNotInstalledError",
    "Injector",
    "StateDictInjector",
    "collect_weights",
    "compare",
    "AdapterOptions",
    "CheckpointLayout",
    "describe_checkpoint",
    "RankWeights",
    "open_rank",
    "hold_for_adoption",
    "inject_held",
    "import_engine",
]

log = logging.getLogger(__name__)

Weights = Union[LoadResult, Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
"""What an adapter accepts: a :class:`LoadResult`, a ``{name: tensor}`` mapping, or a stream of pairs."""

_LIST_LIMIT = 12


class InjectError(GdsloadError, ValueError):
    """The checkpoint does not fit the model: missing or unexpected names, or shapes that differ.

    ``report`` holds the complete lists; the message quotes the first few of each.
    """

    def __init__(self, message: str, report: InjectReport | None = None):
        super().__init__(message)
        self.report = report


class LayoutError(GdsloadError, ValueError):
    """The checkpoint's layout or tensor-parallel size cannot be fed to this engine path."""


class EngineNotInstalledError(GdsloadError, ImportError):
    """An engine adapter was asked for, but the engine's package is not importable here."""


def import_engine(module: str, package: str, what: str) -> ModuleType:
    """Import ``module`` of an engine, or raise :class:`EngineNotInstalledError` naming the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise EngineNotInstalledError(
            f"{what} needs {package!r}, but importing {module!r} failed ({e}); install {package} in this "
            "environment (gdsload does not depend on it)"
        ) from e


@dataclass(frozen=True)
class Target:
    """What the model expects under one name."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    aliases: tuple[str, ...] = ()
    """Other names of the same tensor (tied weights): providing any one of them satisfies all."""


@dataclass(frozen=True)
class ShapeMismatch:
    name: str
    checkpoint: tuple[int, ...]
    model: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.name!r} checkpoint {list(self.checkpoint)} vs model {list(self.model)}"


@dataclass
class InjectReport:
    """What one injection did. ``bytes`` counts the checkpoint tensors that went in."""

    engine: str
    model: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Expected by the model, absent from the checkpoint."""
    unexpected: list[str] = field(default_factory=list)
    """In the checkpoint, unknown to the model."""
    mismatched: list[ShapeMismatch] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    zero_copy: int = 0
    """Tensors bound to the model without a copy (they are views of the loaded arena)."""
    adopted: int = 0
    """Parameters whose storage became the sidecar's mapped memory (no copy; see ``AdapterOptions.adopt``)."""
    copied: int = 0
    """Tensors of a sidecar mapping copied into the parameters (shape, dtype or device differ, or adoption is off)."""
    direct: int = 0
    """Tensors read (or decoded) from the files straight into the model's own parameters: no arena, no copy."""
    narrowed: list[str] = field(default_factory=list)
    """Parameters larger than their checkpoint tensor (vLLM's LoRA padding rule): only the leading part was written."""
    source: str = ""
    """Where the tensors came from: the load report's summary line, or the sidecar mapping (set by the adapters)."""

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self) -> str:
        """``inject torch into LlamaForCausalLM: 21 tensors, 1.05 MB in 0.004 s zero-copy=21 missing=0 ...``"""
        line = (
            f"inject {self.engine} into {self.model}: {len(self.loaded)} tensors, {format_bytes(self.bytes)} "
            f"in {self.seconds:.3f} s"
        )
        if self.zero_copy:
            line += f" zero-copy={self.zero_copy}"
        if self.direct:
            line += f" direct={self.direct}"
        if self.adopted or self.copied:
            line += f" adopted={self.adopted} copied={self.copied}"
        if self.narrowed:
            line += f" narrowed={len(self.narrowed)}"
        return (
            line + f" missing={len(self.missing)} unexpected={len(self.unexpected)} mismatched={len(self.mismatched)}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mismatched"] = [asdict(m) for m in self.mismatched]
        d["ok"] = self.ok
        return d


def _quote(names: Iterable[object], limit: int = _LIST_LIMIT) -> str:
    items = list(names)
    shown = ", ".join(repr(n) if isinstance(n, str) else str(n) for n in items[:limit])
    return shown + (f", ... and {len(items) - limit} more" if len(items) > limit else "")


def _error_message(report: InjectReport, fix: str) -> str:
    parts = []
    if report.missing:
        parts.append(f"{len(report.missing)} missing (in the model, not in the checkpoint): {_quote(report.missing)}")
    if report.unexpected:
        parts.append(
            f"{len(report.unexpected)} unexpected (in the checkpoint, not in the model): {_quote(report.unexpected)}"
        )
    if report.mismatched:
        parts.append(
            f"{len(report.mismatched)} shape mismatch{'es' if len(report.mismatched) > 1 else ''}: "
            f"{_quote(report.mismatched)}"
        )
    return f"strict inject ({report.engine}) into {report.model} failed: " + "; ".join(parts) + f" — {fix}"


def collect_weights(weights: Weights) -> dict[str, torch.Tensor]:
    """``weights`` as a ``{name: tensor}`` dict (no tensor is copied); a stream that repeats a name is an error.

    >>> collect_weights([("a", torch.ones(1)), ("b", torch.zeros(2))]).keys()
    dict_keys(['a', 'b'])
    """
    if isinstance(weights, LoadResult):
        weights = weights.tensors
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    out: dict[str, torch.Tensor] = {}
    for item in pairs:
        try:
            name, tensor = item
        except (TypeError, ValueError):
            raise TypeError(f"weights must yield (name, tensor) pairs, got {type(item).__name__}") from None
        if name in out:
            raise InjectError(f"tensor {name!r} appears twice in the weight stream; each name must come once")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        out[name] = tensor
    return out


def compare(
    tensors: Mapping[str, torch.Tensor],
    targets: Mapping[str, Target],
    *,
    engine: str,
    model: str,
    allow_narrow: bool = False,
) -> InjectReport:
    """Match checkpoint tensors to model targets by name and shape; nothing is written.

    Shapes must be equal, or with ``allow_narrow`` (vLLM's sharded-state rule) every checkpoint
    dimension may be smaller than the parameter's, which is then written only in its leading part.
    """
    report = InjectReport(engine=engine, model=model)
    provided = set(tensors)
    for name, tensor in tensors.items():
        # a tensor, or what a header says of one (gdsload.loader.plan.TensorMeta): a shape and a size
        target = targets.get(name)
        if target is None:
            report.unexpected.append(name)
            continue
        got, want = tuple(tensor.shape), target.shape
        if got == want:
            report.loaded.append(name)
        elif allow_narrow and len(got) == len(want) and all(g <= w for g, w in zip(got, want)):
            report.loaded.append(name)
            report.narrowed.append(name)
        else:
            report.mismatched.append(ShapeMismatch(name, got, want))
            continue
        report.bytes += tensor.nbytes
    for name, target in targets.items():
        if name not in provided and not any(a in provided for a in target.aliases):
            report.missing.append(name)
    return report


class Injector(abc.ABC):
    """Puts a stream of ``(name, tensor)`` pairs into one engine's model and reports what happened.

    >>> report = SomeInjector(model).inject(result.tensors, strict=True)  # doctest: +SKIP
    """

    engine: ClassVar[str]

    @abc.abstractmethod
    def inject(self, weights: Weights, *, strict: bool = True) -> InjectReport:
        """Inject ``weights``; with ``strict``, raise :class:`InjectError` unless every name and shape matches."""


class StateDictInjector(Injector):
    """An injector that knows the model's targets up front: compare everything, then write.

    Subclasses give :meth:`targets` and :meth:`apply`; in strict mode nothing is written
    unless the whole checkpoint fits. Without ``strict`` the matching tensors go in and the
    rest is reported (and logged as a warning).
    """

    allow_narrow: ClassVar[bool] = False
    fix: ClassVar[str] = (
        "check that the checkpoint was written for this model (same architecture, config and tensor-parallel "
        "size), or pass strict=False to load only what matches"
    )

    @property
    @abc.abstractmethod
    def model_name(self) -> str:
        """The model's name for reports and errors."""

    @abc.abstractmethod
    def targets(self) -> Mapping[str, Target]:
        """Every name the model expects, with its shape."""

    @abc.abstractmethod
    def apply(self, tensors: Mapping[str, torch.Tensor], report: InjectReport) -> int:
        """Write the matching ``tensors`` into the model; return how many were bound without a copy."""

    def inject(self, weights: Weights, *, strict: bool = True) -> InjectReport:
        start = time.perf_counter()
        tensors = collect_weights(weights)
        report = compare(
            tensors, self.targets(), engine=self.engine, model=self.model_name, allow_narrow=self.allow_narrow
        )
        if not report.ok:
            if strict:
                report.seconds = time.perf_counter() - start
                raise InjectError(_error_message(report, self.fix), report)
            log.warning("%s", _error_message(report, self.fix).replace("strict inject", "inject", 1))
        report.zero_copy = self.apply({n: tensors[n] for n in report.loaded}, report)
        report.seconds = time.perf_counter() - start
        log.info("%s", report.summary())
        return report


# ---------------------------------------------------------------------------------------------
# Options an engine passes through (vLLM/SGLang --model-loader-extra-config).


@dataclass(frozen=True)
class AdapterOptions:
    """Options of the engine adapters, e.g. vLLM ``--model-loader-extra-config '{"backend": "cpu"}'``.

    >>> AdapterOptions.from_mapping({"sidecar_url": "http://127.0.0.1:8471", "token_file": "/run/gdsload/token"})
    ... # doctest: +SKIP
    """

    backend: str | None = None
    """Reader backend for ``load_rank`` (``auto`` or a backend name); None: ``GDSLOAD_BACKEND``, then ``auto``."""
    sidecar_url: str | None = None
    """Base URL of a running ``gdsload serve``: map the rank's tensors from it over IPC instead of reading storage."""
    token: str | None = None
    """Bearer token for the sidecar. Prefer ``token_file``: a command line is visible to every user of the host."""
    token_file: str | None = None
    """File holding the sidecar's bearer token (surrounding whitespace is ignored)."""
    layout: str | None = None
    """Override the checkpoint layout (``vllm`` or ``hf``) when the model path is not readable here (sidecar only)."""
    strict: bool = True
    """Raise unless every name and shape matches; False loads what matches and logs the rest."""
    timeout: float = 30.0
    """Seconds to wait for each sidecar HTTP request."""
    adopt: bool = True
    """With a sidecar: parameters whose shape, dtype and device match the mapped tensor take the sidecar's
    memory as their storage (copy-on-write on CPU) instead of a copy of it, and the engine holds the
    rank's lease until it exits. False: copy every tensor and release the lease after the load."""

    def __post_init__(self) -> None:
        if self.backend is not None:
            LoadConfig(backend=self.backend).check()  # raises ConfigError naming the allowed backends
        if self.sidecar_url is not None and not (
            isinstance(self.sidecar_url, str) and self.sidecar_url.startswith(("http://", "https://"))
        ):
            raise ConfigError(
                f"sidecar_url={self.sidecar_url!r} must be an http:// or https:// URL, e.g. 'http://127.0.0.1:8471'"
            )
        if self.token is not None and self.token_file is not None:
            raise ConfigError("give either token or token_file, not both")
        for name in ("token", "token_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be a non-empty string, got {type(value).__name__}")
        if self.layout is not None and self.layout not in ("vllm", "hf"):
            raise ConfigError(f"layout={self.layout!r} is not one of ('vllm', 'hf')")
        for name in ("strict", "adopt"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"timeout={self.timeout!r} must be a positive number of seconds")

    @classmethod
    def from_mapping(
        cls, config: Mapping[str, Any] | None, *, where: str = "model_loader_extra_config"
    ) -> AdapterOptions:
        """Build from an engine's extra-config dict; unknown keys are an error that lists the known ones."""
        if config is None:
            return cls()
        if not isinstance(config, Mapping):
            raise ConfigError(f"{where} must be a JSON object of gdsload options, got {type(config).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ConfigError(
                f"{where} has unknown key{'s' if len(unknown) > 1 else ''} {unknown}; gdsload accepts {known}"
            )
        return cls(**dict(config))

    def sidecar_token(self) -> str | None:
        """The bearer token, read from ``token_file`` when given."""
        if self.token_file is None:
            return self.token
        try:
            token = Path(self.token_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(
                f"token_file={self.token_file!r} cannot be read ({e.strerror or e}); "
                "point it at the file `gdsload serve` wrote its token to"
            ) from None
        if not token:
            raise ConfigError(f"token_file={self.token_file!r} is empty")
        return token


# ---------------------------------------------------------------------------------------------
# What a model directory holds, and a rank's tensors from storage or from the sidecar.


@dataclass(frozen=True)
class CheckpointLayout:
    layout: str
    """``vllm`` (engine parameter names, per-rank shapes), ``hf`` (HF names) or ``trtllm`` (TensorRT-LLM names)."""
    tp_size: int
    source: str
    """How discovery found the files: ``manifest``, ``vllm``, ``trtllm``, ``plain``, or ``option`` (given, not read)."""
    pp_size: int = 1
    ep_size: int | None = 1
    """1, ``tp_size`` (experts spread over each stage's ranks), or None: not recorded (vLLM's own files)."""


def describe_checkpoint(path: str | os.PathLike[str]) -> CheckpointLayout:
    """The layout and parallel sizes of a model directory (or one ``.safetensors`` file).

    The manifest's ``layout`` wins; without one, vLLM's ``model-rank-R-part-P`` (or ``model-pp-P-tp-T-part-N``)
    names mean ``vllm`` (what ``save_sharded_state`` writes), ``rankR.safetensors`` means ``trtllm``, and
    anything else is an ordinary TP=1 HF checkpoint.

    >>> describe_checkpoint("/models/llama-tp2")  # doctest: +SKIP
    CheckpointLayout(layout='vllm', tp_size=2, source='manifest', pp_size=1, ep_size=1)
    """
    scanned = scan_layout(path)
    if scanned.manifest is not None:
        manifest = scanned.manifest
        layout = "hf" if manifest.layout == "plain" else manifest.layout
        return CheckpointLayout(
            layout=layout,
            tp_size=manifest.tp_size,
            source=scanned.source,
            pp_size=manifest.pp_size,
            ep_size=manifest.ep_size,
        )
    layout = {"vllm": "vllm", "trtllm": "trtllm", "plain": "hf"}[scanned.source]
    tp = scanned.world_size if scanned.source == "trtllm" else scanned.tp_size
    return CheckpointLayout(
        layout=layout,
        tp_size=tp,
        source=scanned.source,
        pp_size=scanned.pp_size,
        ep_size=None if scanned.source == "vllm" else 1,
    )


@dataclass
class RankWeights:
    """One rank's tensors and where they came from; :meth:`close` releases them (and tells the sidecar)."""

    rank: int
    tensors: dict[str, torch.Tensor]
    origin: str
    """``storage`` (read with ``load_rank``) or ``sidecar`` (mapped over IPC)."""
    report: LoadReport | None = None
    """The load report when read from storage."""
    seconds: float = 0.0
    """Time to read (or map) the tensors."""
    _release: Any = None
    mapped: Any = None
    """The sidecar mapping (:class:`~gdsload.loader.handoff.sidecar_client.MappedRank`) when ``origin`` is ``sidecar``."""

    def describe(self) -> str:
        """One line: the load report's summary, or what was mapped from the sidecar (``backend=sidecar io=ipc``)."""
        if self.report is not None:
            return self.report.summary()
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return (
            f"rank {self.rank}: {format_bytes(nbytes)} mapped from the sidecar in {self.seconds:.3f} s "
            f"backend=sidecar io=ipc tensors={len(self.tensors)}"
        )

    def close(self) -> None:
        """Drop the tensors and release them (a sidecar mapping that :meth:`hold` kept stays)."""
        self.tensors = {}
        release, self._release = self._release, None
        if release is not None:
            release()

    def keep(self) -> None:
        """Leave the tensors' memory (and a held sidecar lease) alone at :meth:`close`: the engine adopted
        them (see :meth:`~gdsload.loader.handoff.sidecar_client.MappedRank.hold`)."""
        self._release = None

    def __enter__(self) -> RankWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_rank(
    path: str | os.PathLike[str] | None,
    rank: int,
    *,
    options: AdapterOptions | None = None,
    device: str | torch.device = "cpu",
    expect_device: bool = False,
    private: bool = False,
) -> RankWeights:
    """Rank ``rank``'s tensors: mapped from the sidecar when ``options.sidecar_url`` is set, else read from ``path``.

    Reading to a CUDA ``device`` falls back to host memory (the adapters then copy into the
    engine's parameters) when the backend is ``auto`` and no backend can read to the GPU here;
    a backend named explicitly fails instead. With ``expect_device``, a sidecar mapping that lands on
    another device than ``device`` is an error (the engine should run on the sidecar's GPU). ``private``
    maps a CPU sidecar's memory copy-on-write (what an engine that adopts the tensors wants).

    >>> with open_rank("/models/llama-tp2", 1, device="cuda:1") as w:  # doctest: +SKIP
    ...     report = inject_module(model, w.tensors)
    """
    options = options or AdapterOptions()
    if options.sidecar_url is not None:
        from ..handoff.sidecar_client import SidecarClient

        start = time.perf_counter()
        client = SidecarClient(options.sidecar_url, token=options.sidecar_token(), timeout=options.timeout)
        mapped = client.map_rank(rank, device=device if expect_device else None, private=private)
        return RankWeights(
            rank=rank,
            tensors=mapped.tensors,
            origin="sidecar",
            seconds=time.perf_counter() - start,
            _release=mapped.release,
            mapped=mapped,
        )
    if path is None:
        raise ConfigError("no model path and no sidecar_url: nothing to load the weights from")
    from ..pipeline.load import load_rank

    dev = torch.device(device)
    try:
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError(f"cannot load to {str(dev)!r}: this torch build or host has no CUDA device")
        result = load_rank(path, rank, device=dev, backend=options.backend)
    except BackendUnavailableError as e:
        if dev.type == "cpu" or LoadConfig.resolve(backend=options.backend).backend != "auto":
            raise
        log.info("rank %d: no backend reads to %s here (%s); reading to host memory and copying", rank, dev, e)
        result = load_rank(path, rank, device="cpu", backend=options.backend)
    return RankWeights(
        rank=rank, tensors=dict(result.tensors), origin="storage", report=result.report, _release=result.close
    )


def hold_for_adoption(
    weights: RankWeights, *, engine: str = "engine", on_lost: Callable[[Any, str], None] | None = None
) -> bool:
    """Hold the sidecar lease of ``weights`` before anything is adopted; False (copy instead) where it cannot be held.

    A sidecar that cannot hold leases (an older gdsload) is logged, and the caller copies. If the
    sidecar drops the lease later, ``on_lost(mapped, why)`` runs; the default logs a warning for a
    CPU mapping (private, so the adopted weights stay valid) and, for CUDA IPC memory the sidecar
    may free, logs why and sends this process SIGTERM rather than let it compute with memory that
    may be reused (an orchestrator restarts the engine, which adopts again).
    """
    from ..handoff.sidecar_client import SidecarError

    mapped = weights.mapped
    if on_lost is None:
        on_lost = functools.partial(_lost_cpu if mapped.device.type == "cpu" else _lost_cuda, engine=engine)
    try:
        mapped.hold(on_lost=on_lost)
    except SidecarError as e:
        log.warning("rank %d: copying the sidecar's tensors instead of adopting them: %s", weights.rank, e)
        return False
    return True


def inject_held(injector: Injector, weights: RankWeights, *, held: bool, strict: bool) -> InjectReport:
    """Inject ``weights``; where ``held`` (:func:`hold_for_adoption` succeeded), the lease goes back at once if
    the injection fails or adopts nothing, and stays for the life of the process once something was adopted."""
    try:
        report = injector.inject(weights.tensors, strict=strict)
    except BaseException:
        if held:
            weights.mapped.release()  # nothing adopted is kept: the lease goes back now
        raise
    report.source = weights.describe()
    if held and report.adopted:
        weights.keep()  # the parameters are the mapping: the lease stays until this process exits
    elif held:
        weights.mapped.release()
    return report


def _lost_cpu(mapped: Any, why: str, *, engine: str) -> None:
    log.warning(
        "rank %d: the sidecar dropped this %s's lease (%s); the adopted weights stay valid here "
        "(a private copy-on-write mapping)",
        mapped.rank,
        engine,
        why,
    )


def _lost_cuda(mapped: Any, why: str, *, engine: str) -> None:
    log.critical(
        "rank %d: the sidecar dropped this %s's lease (%s); its adopted parameters are the "
        "sidecar's GPU memory, which it may free: stopping this process (SIGTERM)",
        mapped.rank,
        engine,
        why,
    )
    os.kill(os.getpid(), signal.SIGTERM)
