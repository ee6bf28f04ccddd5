"""Plain torch / transformers: inject a rank's tensors into an ``nn.Module``.

Two modes:

- ``assign=True`` (zero-copy): the module's parameters and buffers *become* the loaded tensors,
  through ``load_state_dict(assign=True)``; build the module with :func:`meta_init` so its
  parameters take no memory before that. The weights then live in the loader's arena (one
  allocation per rank), and the module keeps the arena alive.
- ``assign=False``: copy into the module's existing parameters (any device, dtype converted).

Tied parameters (e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``) stay tied: a
checkpoint that holds either name fills both.

>>> from transformers import AutoConfig, AutoModelForCausalLM
>>> with meta_init(dtype=torch.bfloat16):                                       # doctest: +SKIP
...     model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("/models/llama"))
>>> report = inject_module(model, load_rank("/models/llama", 0, device="cuda"))  # doctest: +SKIP
>>> report.zero_copy == len(report.loaded)  # doctest: +SKIP
True
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .base import (
    AdapterOptions,
    InjectError,
    InjectReport,
    StateDictInjector,
    Target,
    Weights,
    hold_for_adoption,
    inject_held,
    open_rank,
)

__all__ = ["ModuleInjector", "inject_from_sidecar", "inject_module", "meta_init"]

log = logging.getLogger(__name__)


@contextmanager
def meta_init(dtype: torch.dtype | None = None) -> Iterator[None]:
    """Build modules whose parameters are on the meta device (no memory) while buffers stay real.

    Non-persistent buffers (rotary ``inv_freq``, masks) are computed in ``__init__`` and are not in
    any checkpoint, so they must be real; parameters come from the checkpoint with
    :func:`inject_module` (``assign=True``). ``dtype`` is the default floating dtype while the
    module is built (what transformers' ``torch_dtype`` does). Not thread-safe: it patches
    ``nn.Module.register_parameter`` for the duration of the block.

    >>> with meta_init(dtype=torch.bfloat16):
    ...     layer = nn.Linear(4096, 4096)
    >>> layer.weight.device, layer.weight.dtype
    (device(type='meta'), torch.bfloat16)
    """
    original = nn.Module.register_parameter
    previous_dtype = torch.get_default_dtype()

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            meta = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
            meta.__dict__.update(p.__dict__)  # keep attributes engines hang on parameters
            module._parameters[name] = meta

    if dtype is not None:  # before patching: a bad dtype raises here with nothing to undo
        torch.set_default_dtype(dtype)
    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        torch.set_default_dtype(previous_dtype)


class ModuleInjector(StateDictInjector):
    """Inject into ``module.state_dict()`` names: bind (``assign=True``) or copy.

    >>> ModuleInjector(model, assign=False).inject(result.tensors)  # doctest: +SKIP
    """

    engine = "torch"
    adopt: bool | None = None
    """For tensors mapped from a sidecar (set by :func:`inject_from_sidecar`): True binds the parameters to the
    mapped memory (``report.adopted``) and copies buffers, which a model may update in place, unless the mapping is
    a private CPU one; False copies every tensor (``report.copied``); None (tensors of a load) binds or copies by
    ``assign``."""
    fix = (
        "check that the checkpoint was written for this model class and config (for a sharded checkpoint, "
        "load the TP=1 directory), or pass strict=False to load only what matches"
    )

    def __init__(self, module: nn.Module, *, assign: bool = True):
        self.module = module
        self.assign = assign
        self._state = module.state_dict(keep_vars=True)
        groups: dict[int, list[str]] = {}
        for name, t in self._state.items():
            groups.setdefault(id(t), []).append(name)
        self._aliases = {name: tuple(n for n in group if n != name) for group in groups.values() for name in group}

    @property
    def model_name(self) -> str:
        return type(self.module).__name__

    def targets(self) -> Mapping[str, Target]:
        return {name: Target(tuple(t.shape), t.dtype, self._aliases[name]) for name, t in self._state.items()}

    def inject(self, weights: Weights, *, strict: bool = True) -> InjectReport:
        self._check_meta()
        return super().inject(weights, strict=strict)

    def _check_meta(self) -> None:
        persistent = set(self._state)
        stuck = [n for n, b in self.module.named_buffers() if b.device.type == "meta" and n not in persistent]
        if stuck:
            raise InjectError(
                f"{self.model_name} has non-persistent buffers on the meta device ({', '.join(map(repr, stuck[:6]))}); "
                "no checkpoint holds them, so they would stay empty — build the module under "
                "gdsload.loader.adapters.meta_init() (parameters on meta, buffers real) instead of torch.device('meta')"
            )
        if not self.assign:
            on_meta = [n for n, t in self._state.items() if t.device.type == "meta"]
            if on_meta:
                raise InjectError(
                    f"{self.model_name} has tensors on the meta device ({', '.join(map(repr, on_meta[:6]))}) and "
                    "copying needs real memory; use assign=True to bind the loaded tensors instead"
                )

    def apply(self, tensors: Mapping[str, torch.Tensor], report: InjectReport) -> int:
        if not tensors:
            return 0
        mapped = tensors
        if self.adopt is not None:
            tensors = self._own_copies(tensors, report)
        if not self.assign:
            with torch.no_grad():
                for name, t in tensors.items():
                    self._state[name].copy_(t)
            return 0
        # One name per tied group is bound; its aliases then point at the same tensor.
        bound: dict[str, torch.Tensor] = {}
        tie: dict[str, str] = {}
        for name, t in tensors.items():
            head = next((a for a in self._aliases[name] if a in bound), None)
            if head is not None:
                tie[name] = head
                continue
            want = self._state[name].dtype
            if t.dtype != want:
                log.info(
                    "%s: %r is %s in the checkpoint, %s in the model; converting (a copy)",
                    self.model_name,
                    name,
                    t.dtype,
                    want,
                )
                t = t.to(want)
            bound[name] = t
        result = self.module.load_state_dict(bound, strict=False, assign=True)
        if result.unexpected_keys:  # compare() already filtered names; this would be a torch-side surprise
            raise InjectError(f"{self.model_name} refused {result.unexpected_keys[:6]} during load_state_dict")
        for name in bound:
            for alias in self._aliases[name]:
                tie.setdefault(alias, name)
        for alias, head in tie.items():
            _set_tensor(self.module, alias, _get_tensor(self.module, head))
        self._follow_device(bound)
        kept = sum(
            1
            for name, t in tensors.items()
            if name in bound and bound[name] is t and _get_tensor(self.module, name).data_ptr() == t.data_ptr()
        )
        if self.adopt is None:
            return kept
        # Every name counts once, a tied one as its group's head: adopted if that is the mapped tensor itself.
        for name in tensors:
            head = tie.get(name, name)
            if bound[head] is mapped[head]:
                report.adopted += 1
                held = _get_tensor(self.module, name)
                if isinstance(held, nn.Parameter):
                    held.requires_grad_(False)  # the sidecar's memory: an optimizer step must not write into it
            else:
                report.copied += 1
        return 0

    def _own_copies(self, mapped: Mapping[str, torch.Tensor], report: InjectReport) -> dict[str, torch.Tensor]:
        """Sidecar tensors as they go in: the mapped tensor itself where it is adopted, a copy (counted) elsewhere."""
        out: dict[str, torch.Tensor] = {}
        for name, t in mapped.items():
            if not self.assign:
                report.copied += 1  # apply() copies every name into the module's own tensors
            if any(a in out for a in self._aliases[name]):
                out[name] = t  # a tied name: bound to (or copied with) its group's head in apply()
                continue
            target = self._state[name]
            adoptable = (
                self.adopt
                and t.dtype == target.dtype
                and t.is_contiguous()
                and (isinstance(target, nn.Parameter) or t.device.type == "cpu")
            )
            if adoptable or not self.assign:  # copying into real parameters reads the mapped tensor once
                out[name] = t
            else:
                out[name] = t.to(target.dtype, copy=True)
        return out

    def _follow_device(self, bound: Mapping[str, torch.Tensor]) -> None:
        """Move the remaining real buffers to the device the weights landed on (rotary tables etc.)."""
        devices = {t.device for t in bound.values()}
        if len(devices) != 1:
            return
        (device,) = devices
        for name, buf in list(self.module.named_buffers()):
            if buf.device != device and buf.device.type != "meta" and name not in bound:
                _set_tensor(self.module, name, buf.to(device))


def _split(name: str) -> tuple[str, str]:
    prefix, _, leaf = name.rpartition(".")
    return prefix, leaf


def _get_tensor(module: nn.Module, name: str) -> torch.Tensor:
    prefix, leaf = _split(name)
    owner = module.get_submodule(prefix) if prefix else module
    if leaf in owner._parameters:
        return owner._parameters[leaf]  # type: ignore[return-value]
    return owner._buffers[leaf]  # type: ignore[return-value]


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    prefix, leaf = _split(name)
    owner = module.get_submodule(prefix) if prefix else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def inject_module(module: nn.Module, weights: Weights, *, assign: bool = True, strict: bool = True) -> InjectReport:
    """Inject ``weights`` into ``module`` by ``state_dict`` name; see :class:`ModuleInjector`.

    With ``assign=True`` the parameters become views of the loaded tensors (zero-copy; a dtype
    that differs from the module's is converted, which copies that tensor); with
    ``assign=False`` values are copied into the existing parameters. ``strict`` raises
    :class:`InjectError` listing every missing/unexpected name and shape mismatch before
    anything is written.

    >>> with meta_init(dtype=torch.bfloat16):                                             # doctest: +SKIP
    ...     model = LlamaForCausalLM(config)
    >>> print(inject_module(model, load_rank("/models/llama-8b", 0, device="cuda")).summary())  # doctest: +SKIP
    inject torch into LlamaForCausalLM: 291 tensors, 16.06 GB in 0.004 s zero-copy=291 missing=0 unexpected=0 mismatched=0
    """
    return ModuleInjector(module, assign=assign).inject(weights, strict=strict)


def inject_from_sidecar(
    module: nn.Module,
    sidecar_url: str,
    *,
    rank: int = 0,
    token: str | None = None,
    token_file: str | None = None,
    adopt: bool = True,
    strict: bool = True,
    timeout: float = 30.0,
    on_lost: Callable[[Any, str], None] | None = None,
) -> InjectReport:
    """Give ``module`` rank ``rank``'s weights from a running ``gdsload serve``, reading nothing from storage.

    With ``adopt`` (the default) the parameters *become* the sidecar's memory (CUDA IPC on a GPU,
    a private copy-on-write mapping of its shared memory on CPU): no copy, and no second copy of
    the model on the device. This process then holds the rank's lease until it exits, so the
    sidecar refuses to reload or unload it meanwhile (unless forced). If the sidecar drops the
    lease anyway, ``on_lost(mapped, why)`` runs; by default a CPU process logs a warning (its
    mapping stays valid) and a CUDA process is sent SIGTERM, since the memory it computes with
    may be freed. Adopted parameters do not require grad (an optimizer step would write into the
    sidecar's memory: train with ``adopt=False``). Buffers on a GPU, which a model may update in
    place, are copied; so is a tensor whose dtype differs from the module's. ``adopt=False`` copies everything and
    releases the lease before returning. Build the module under :func:`meta_init` (parameters
    take no memory until they are adopted); a module with real parameters must be on the
    sidecar's device.

    >>> with meta_init(dtype=torch.bfloat16):                                       # doctest: +SKIP
    ...     model = AutoModelForCausalLM.from_config(config)
    >>> report = inject_from_sidecar(model, "http://127.0.0.1:8471", token_file="/run/gdsload/token")
    ... # doctest: +SKIP
    >>> report.adopted == len(report.loaded)  # doctest: +SKIP
    True
    """
    options = AdapterOptions(
        sidecar_url=sidecar_url, token=token, token_file=token_file, adopt=adopt, strict=strict, timeout=timeout
    )
    # Where the parameters are (meta_init leaves buffers real on the CPU: they say nothing of the device).
    device = next((p.device for p in module.parameters() if p.device.type != "meta"), None)
    on_meta = any(t.device.type == "meta" for t in module.state_dict().values())
    with open_rank(
        None, rank, options=options, device=device or "cpu", expect_device=device is not None, private=adopt
    ) as weights:
        held = adopt and hold_for_adoption(weights, engine="process", on_lost=on_lost)
        injector = ModuleInjector(module, assign=held or on_meta)
        injector.adopt = held
        report = inject_held(injector, weights, held=held, strict=strict)
    log.info("rank %d: %s", rank, report.summary())
    return report
