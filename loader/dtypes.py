"""The safetensors dtype table: header name <-> torch dtype and element size."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ITEMSIZE", "SAFETENSORS_DTYPES", "to_torch", "from_torch"]

# Header name -> (element size in bytes, torch attribute name). The names are the
# safetensors specification's; sizes are what ``shape x dtype`` byte ranges are checked against.
_TABLE: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F64": (8, "float64"),
    "C64": (8, "complex64"),
}

ITEMSIZE: dict[str, int] = {name: size for name, (size, _) in _TABLE.items()}
SAFETENSORS_DTYPES: tuple[str, ...] = tuple(sorted(_TABLE))


@cache
def _tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """Built on first use, so that reading headers does not import torch."""
    import torch

    to = {name: getattr(torch, attr) for name, (_, attr) in _TABLE.items() if hasattr(torch, attr)}
    return to, {dt: name for name, dt in to.items()}


def to_torch(name: str) -> torch.dtype:
    """Torch dtype for a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``)."""
    try:
        return _tables()[0][name]
    except KeyError:
        import torch

        raise KeyError(f"dtype {name!r} has no torch equivalent in torch {torch.__version__}") from None


def from_torch(dtype: torch.dtype) -> str:
    """Safetensors dtype name for a torch dtype (``torch.float8_e4m3fn`` -> ``"F8_E4M3"``)."""
    try:
        return _tables()[1][dtype]
    except KeyError:
        raise TypeError(
            f"torch dtype {dtype} cannot be stored in safetensors; supported: {', '.join(str(d) for d in _tables()[1])}"
        ) from None
