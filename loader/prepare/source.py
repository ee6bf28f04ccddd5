"""The checkpoint ``gdsload shard`` reads: a Hugging Face model directory (config.json plus safetensors files).

Every header is read and checked when the directory is opened (no tensor data): names unique across
files, the index (``model.safetensors.index.json``) complete. Data is read later, region by region, with
``pread`` on descriptors opened once per process: a region of a tensor is the span of elements one
:class:`~gdsload.loader.prepare.recipe.View` of it touches, so a rank reads its own rows and columns of
the source, not whole tensors.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..dtypes import ITEMSIZE, to_torch
from ..errors import GdsloadError
from ..format.safetensors import TensorInfo, read_header
from ..model_config import ModelConfig, ModelConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "SourceCheckpoint",
    "Located",
    "SourceNotFoundError",
    "UnsupportedSourceError",
    "SourceCheckpointError",
    "SourceReadError",
    "UnsupportedModelError",
    "inside_source",
]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf", ".h5", ".msgpack")


class SourceNotFoundError(GdsloadError, FileNotFoundError):
    """SRC, its config.json, or a shard file its index lists does not exist."""


class UnsupportedSourceError(GdsloadError, ValueError):
    """SRC holds weights in a format other than safetensors (pickle ``.bin``, GGUF, ...)."""


class UnsupportedModelError(GdsloadError, ValueError):
    """config.json describes an architecture (or a quantized checkpoint) this ``gdsload shard`` cannot shard."""


class SourceCheckpointError(GdsloadError, ValueError):
    """The source checkpoint lacks tensors, has unexpected ones, or has wrong shapes or dtypes."""


class SourceReadError(GdsloadError, OSError):
    """A source file became unreadable (or changed) after planning."""


def inside_source(root: Path, path: Path) -> Path:
    """``path`` resolved, when it stays inside ``root`` (or, for a Hugging Face cache snapshot, inside that
    repository's ``blobs``); else :class:`SourceCheckpointError`: ``gdsload shard`` never follows a link out of
    its source, so a link planted in a model directory cannot copy another file into OUT."""
    real = path.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":  # models--org--name/snapshots/REV/file -> ../../blobs/HASH
        allowed.append(root.parent.parent / "blobs")
    if not any(real == a or a in real.parents for a in allowed):
        raise SourceCheckpointError(
            f"{str(path)!r} is a link to {str(real)!r}, outside the source directory {str(root)!r}; gdsload shard does "
            "not follow links out of SRC — copy the file into SRC, or remove the link"
        )
    return real


class Located(NamedTuple):
    """Where one source tensor lies: its file, the file's data section offset, and its header entry."""

    path: str
    data_offset: int
    info: TensorInfo

    @property
    def file_range(self) -> tuple[int, int]:
        """Absolute byte range of the tensor in its file."""
        return self.data_offset + self.info.start, self.data_offset + self.info.end


class SourceCheckpoint:
    """A Hugging Face checkpoint directory, its headers read and checked (see the module docstring).

    >>> src = SourceCheckpoint("/models/Mixtral-8x7B")  # doctest: +SKIP
    >>> src.config.experts, len(src.tensors)
    (8, 995)
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = root = Path(root).resolve()
        if not root.is_dir():
            what = "is a file, not a model directory" if root.exists() else "does not exist"
            raise SourceNotFoundError(
                f"source {str(root)!r} {what}; pass the directory holding config.json and *.safetensors"
            )
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise SourceNotFoundError(
                f"{str(root)!r} has no config.json; gdsload shard needs the Hugging Face model directory "
                "(config.json, *.safetensors, tokenizer files)"
            )
        self.config_bytes = cfg_path.read_bytes()
        try:
            self.config = ModelConfig.from_dict(json.loads(self.config_bytes), where=str(cfg_path))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UnsupportedModelError(f"{str(cfg_path)!r} is not valid JSON ({e}); fetch it again") from None
        except ModelConfigError as e:
            raise UnsupportedModelError(str(e)) from None
        self.files = sorted(
            p for p in root.iterdir() if p.suffix == ".safetensors" and p.is_file() and not p.name.startswith(".")
        )
        for p in [cfg_path, *self.files]:
            inside_source(root, p)
        if not self.files:
            pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
            if pickles:
                raise UnsupportedSourceError(
                    f"{str(root)!r} holds weights as {', '.join(map(repr, pickles[:3]))}, not safetensors; "
                    "gdsload shard reads only safetensors (it never unpickles). Convert first, e.g. "
                    "`AutoModelForCausalLM.from_pretrained(SRC).save_pretrained(DST, safe_serialization=True)`"
                )
            raise SourceNotFoundError(f"no *.safetensors files under {str(root)!r}")
        indexed = self._check_index()
        if (
            indexed is not None
        ):  # the index names the weights; other files (e.g. Mistral's consolidated.safetensors) are not
            self.files = [p for p in self.files if p.name in indexed]
        self.tensors: dict[str, Located] = {}
        for path in self.files:
            header = read_header(path)
            for info in header.tensors:
                if info.name in self.tensors:
                    raise SourceCheckpointError(
                        f"tensor {info.name!r} is in both {self.tensors[info.name].path!r} and {str(path)!r}; "
                        "remove the stray file from the source directory"
                    )
                self.tensors[info.name] = Located(str(path), header.data_offset, info)
        self._fds: dict[str, int] = {}

    def _check_index(self) -> set[str] | None:
        """The file names ``model.safetensors.index.json`` maps tensors to (None without an index)."""
        index = self.root / "model.safetensors.index.json"
        if not index.is_file():
            return None
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise SourceCheckpointError(f"{str(index)!r} is not a valid safetensors index ({e!r})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v and "/" not in v for k, v in weight_map.items()
        ):
            raise SourceCheckpointError(
                f"{str(index)!r}: 'weight_map' must map tensor names to file names in the same directory; "
                "the index is damaged — fetch it again"
            )
        for name, fname in weight_map.items():
            if not (self.root / fname).is_file():
                raise SourceNotFoundError(
                    f"{str(index)!r} maps tensor {name!r} to {fname!r}, but that file is missing from "
                    f"{str(self.root)!r}; the download is incomplete — fetch the missing shard"
                )
        return set(weight_map.values())

    def fingerprint_parts(self) -> dict[str, Any]:
        """What identifies this source for a resumable run: config.json's hash and each file's name, size and mtime."""
        files = []
        for p in self.files:
            st = p.stat()
            files.append([p.name, st.st_size, st.st_mtime_ns])
        return {"config_sha256": hashlib.sha256(self.config_bytes).hexdigest(), "files": files}

    @property
    def mode(self) -> int:
        """Permission bits every weight file allows (their intersection): what OUT's files may allow at most."""
        mode = 0o777
        for p in self.files:
            mode &= p.stat().st_mode & 0o777
        return mode

    def dtype(self, name: str) -> str:
        return self.tensors[name].info.dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].info.shape

    # ---- reading

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of source tensor ``name`` (flat, row-major), as a 1-D CPU tensor of its dtype."""
        import torch

        loc = self.tensors[name]
        size = ITEMSIZE[loc.info.dtype]
        start = loc.data_offset + loc.info.start + lo * size
        nbytes = (hi - lo) * size
        buf = bytearray(nbytes)
        try:
            fd = self._fds.get(loc.path)
            if fd is None:
                fd = self._fds[loc.path] = os.open(loc.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            view, done = memoryview(buf), 0
            while done < nbytes:
                n = os.preadv(fd, [view[done:]], start + done)
                if n == 0:
                    raise OSError(errno.EIO, "the file ends before the tensor does")
                done += n
        except OSError as e:
            raise SourceReadError(
                e.errno or errno.EIO,
                f"reading tensor {name!r} from {loc.path!r} failed ({e.strerror or e}); the source changed or became "
                "unreadable since planning — restore it and rerun",
            ) from e
        if not nbytes:
            return torch.empty(0, dtype=to_torch(loc.info.dtype))
        return torch.frombuffer(buf, dtype=to_torch(loc.info.dtype))

    def close(self) -> None:
        """Close the descriptors :meth:`read` opened."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __getstate__(self) -> dict[str, Any]:  # sent to worker processes without open descriptors
        state = dict(self.__dict__)
        state["_fds"] = {}
        return state
