"""FP8 (``float8_e4m3fn``) weight quantization with fp32 scales, as vLLM reads it.

Symmetric, round-to-nearest-even: ``q = e4m3(clamp(w / scale, -448, 448))`` and
``w ≈ q * scale`` with ``scale = amax / 448`` — one scale per tensor (``per-tensor``) or one per
output row (``per-channel``). Scales are always computed over the *whole* source tensor (or the
whole row), never over a tensor-parallel slice, so every rank holds the scale vLLM would compute
when it loads the unsharded FP8 checkpoint.

What config.json says (``quantization_config``), per granularity:

* ``per-tensor``: vLLM's ``fp8`` method (``Fp8Config``): ``{"quant_method": "fp8",
  "activation_scheme": "dynamic"}``. Weights ``weight`` (F8_E4M3) and ``weight_scale`` (F32).
* ``per-channel``: vLLM's ``fp8`` method reads only per-tensor (or block) weight scales, so
  per-channel uses the ``compressed-tensors`` method (``CompressedTensorsW8A8Fp8``, strategy
  ``channel``, dynamic per-token activations), whose ``weight_scale`` is ``[rows, 1]`` F32.

Error bound (e4m3 has 3 mantissa bits, min normal 2**-6, subnormal step 2**-9), for every element
``|dequantize(quantize(w)) - w| <= max(|w| * 2**-4, scale * 2**-10)`` up to fp32 rounding.

>>> import torch
>>> scheme = QuantScheme.parse("fp8:per-channel")
>>> w = torch.randn(4, 8)
>>> s = compute_scale(w.abs().amax(dim=1), scheme)          # [4, 1]
>>> q = quantize(w, s)                                      # float8_e4m3fn
>>> (dequantize(q, s) - w).abs().max() < 0.0625 * w.abs().max()
tensor(True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:  # torch is imported by the functions that quantize: planning a sharding needs none of it
    import torch

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "GRANULARITIES",
    "QuantScheme",
    "compute_scale",
    "quantize",
    "quantize_into",
    "dequantize",
    "quantization_config",
]

FP8_DTYPE: torch.dtype
"""The FP8 format of weights (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, no infinities."""

FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""

GRANULARITIES = ("per-tensor", "per-channel")

_MIN_AMAX = 2.0**-126 * 448.0
"""Floor of amax: the scale (amax / 448) stays a normal float32, so an all-zero tensor (or row) still gets a
positive scale and dequantization is finite, while tiny but nonzero weights keep their values."""


def __getattr__(name: str) -> Any:
    if name == "FP8_DTYPE":
        import torch

        return torch.float8_e4m3fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class QuantScheme:
    """Which quantization ``gdsload shard --quantize`` applies to linear-layer weights."""

    method: str = "fp8"
    """Only ``fp8`` (``float8_e4m3fn`` weights, fp32 scales, dynamic activation scales)."""
    granularity: str = "per-tensor"
    """``per-tensor`` (one scale per weight) or ``per-channel`` (one per output row)."""

    def __post_init__(self) -> None:
        if self.method != "fp8":
            raise ConfigError(f"quantize method {self.method!r} is not supported; the only method is 'fp8'")
        if self.granularity not in GRANULARITIES:
            raise ConfigError(
                f"fp8 granularity {self.granularity!r} is not known; choose one of {', '.join(GRANULARITIES)}"
            )

    @classmethod
    def parse(cls, text: str) -> QuantScheme:
        """``"fp8"`` / ``"fp8:per-tensor"`` / ``"fp8:per-channel"`` -> a scheme.

        >>> QuantScheme.parse("fp8").granularity
        'per-tensor'
        """
        if not isinstance(text, str):
            raise ConfigError(f"quantize={text!r} must be a string: fp8, fp8:per-tensor or fp8:per-channel")
        method, _, granularity = text.strip().lower().partition(":")
        if method != "fp8":
            raise ConfigError(f"--quantize {text!r} is not supported; use fp8, fp8:per-tensor or fp8:per-channel")
        return cls(method=method, granularity=granularity or "per-tensor")

    def __str__(self) -> str:
        return f"{self.method}:{self.granularity}"

    @property
    def per_channel(self) -> bool:
        return self.granularity == "per-channel"


def compute_scale(amax: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """fp32 scale(s) from absolute maxima: ``amax / 448``.

    ``amax`` is a 0-d tensor for ``per-tensor`` (result 0-d) or one value per row for
    ``per-channel`` (result ``[rows, 1]``, ready to broadcast against a ``[rows, cols]`` weight).

    >>> import torch
    >>> compute_scale(torch.tensor(448.0), QuantScheme())
    tensor(1.)
    """
    import torch

    scale = amax.detach().to(torch.float32).clamp_min(_MIN_AMAX) / FP8_MAX
    if scheme.per_channel:
        return scale.reshape(-1, 1)
    if scale.numel() != 1:
        raise ValueError(f"per-tensor quantization takes one amax, got shape {tuple(amax.shape)}")
    return scale.reshape(())


def quantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` values of ``weight / scale``, saturated at ±448 (never NaN).

    ``scale`` is 0-d, or ``[rows, 1]`` for a 2-D ``weight`` of ``rows`` rows.

    >>> import torch
    >>> quantize(torch.tensor([1.0, 1000.0]), torch.tensor(0.5)).float()
    tensor([  2., 448.])
    """
    import torch

    x = weight.to(torch.float32, copy=True)
    x.div_(scale.to(torch.float32))
    return x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_into(dst: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, work: torch.Tensor) -> None:
    """Like :func:`quantize`, writing into the FP8 tensor ``dst`` through ``work``, a flat fp32
    buffer of at least ``weight.numel()`` elements: no allocation proportional to ``weight``
    (a long streaming run stays free of heap churn). Same values as :func:`quantize`.
    """
    import torch

    if work.dtype != torch.float32 or work.numel() < weight.numel():
        raise ValueError(
            f"work buffer must be fp32 with >= {weight.numel()} elements, got {work.dtype}[{work.numel()}]"
        )
    x = work[: weight.numel()].view(weight.shape)
    x.copy_(weight)
    x.div_(scale.to(torch.float32))
    x.clamp_(-FP8_MAX, FP8_MAX)
    dst.copy_(x)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (None: fp32, so no second rounding hides errors)."""
    import torch

    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype or torch.float32)


def quantization_config(scheme: QuantScheme, *, ignored: list[str] | None = None) -> dict[str, Any]:
    """The ``quantization_config`` block of config.json that makes vLLM read these FP8 weights.

    ``ignored`` names modules left unquantized (the lm_head; vLLM never quantizes embeddings).

    >>> quantization_config(QuantScheme("fp8", "per-tensor"))["quant_method"]
    'fp8'
    """
    ignored = list(ignored or [])
    if not scheme.per_channel:
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ignored}
    fp8_args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**fp8_args, "strategy": "channel", "dynamic": False, "observer": "minmax"},
                "input_activations": {**fp8_args, "strategy": "token", "dynamic": True, "observer": None},
                "output_activations": None,
            }
        },
        "ignore": ignored,
        "kv_cache_scheme": None,
    }
