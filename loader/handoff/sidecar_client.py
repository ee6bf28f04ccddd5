"""The engine-side half of the sidecar hand-off: fetch a rank's IPC document, map it, release it.

The sidecar (``gdsload serve``) holds each rank's arena and serves, for a local engine process:

- ``GET  /v1/ipc/{rank}``          the document :func:`gdsload.loader.handoff.ipc.export_rank` made for that rank;
- ``POST /v1/ipc/{rank}/release``  the engine is done with the mapping (the sidecar may unload it);
- ``GET  /v1/ipc/{rank}/hold``     the engine holds the lease: the answer streams while the lease holds, and
  the sidecar releases the lease when the connection closes — when the engine releases it, or its process
  exits, however it exits. :meth:`SidecarClient.map_rank` opens it as soon as it has the lease (the
  sidecar releases a lease no engine holds within seconds), and :meth:`MappedRank.hold` keeps it for the
  life of the process (the engine's parameters adopted the memory).

Both need ``Authorization: Bearer <token>``. The client maps the arena with
:func:`gdsload.loader.handoff.ipc.import_rank` (CUDA IPC, or shared memory for CPU arenas): every tensor
is a view of the sidecar's memory, on the GPU whose UUID the document names — no bytes move.
Only the standard library talks HTTP here, so engines need no extra dependency.

>>> client = SidecarClient("http://127.0.0.1:8471", token=token)   # doctest: +SKIP
>>> with client.map_rank(0) as mapped:                               # doctest: +SKIP
...     engine_copy_weights(mapped.tensors)  # then the sidecar is told we're done

An engine that keeps the mapped memory as its weights (``inject_module(model, mapped.tensors)``
binds them without a copy) holds the lease instead, for as long as it runs:

>>> mapped = client.map_rank(0, private=True)                        # doctest: +SKIP
>>> inject_module(model, mapped.tensors); mapped.hold()              # doctest: +SKIP
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import GdsloadError
from .ipc import IpcError, import_rank

__all__ = [
    "DEFAULT_SIDECAR_URL",
    "SidecarClient",
    "MappedRank",
    "SidecarError",
    "SidecarUnavailableError",
    "SidecarAuthError",
    "SidecarNotReadyError",
    "SidecarProtocolError",
]

log = logging.getLogger(__name__)

DEFAULT_SIDECAR_URL = "http://127.0.0.1:8471"
_BODY_LIMIT = 300


class SidecarError(GdsloadError):
    """Root of the errors talking to the sidecar."""


class SidecarUnavailableError(SidecarError, ConnectionError):
    """Nothing answers at the sidecar URL (not started, wrong port, or timed out)."""


class SidecarAuthError(SidecarError, PermissionError):
    """The sidecar refused the bearer token (HTTP 401/403)."""


class SidecarNotReadyError(SidecarError, RuntimeError):
    """The sidecar has not loaded the rank (yet), or no longer holds it (HTTP 404/409/503)."""


class SidecarProtocolError(SidecarError, ValueError):
    """The sidecar answered something this client does not understand."""


class _HoldConnection:
    """The open ``GET /v1/ipc/{rank}/hold`` of one mapping: the sidecar keeps the lease while it stays open, and
    releases it when it closes (this process exited, or :meth:`close`). A thread reads it: the sidecar ends it
    with ``released`` (it voided the lease) or ``stopping``."""

    def __init__(
        self,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        sock: socket.socket,
        rank: int,
        on_end: Callable[[str], None],
    ):
        self._conn, self._response, self._sock = conn, response, sock
        self.ended: str | None = None
        """Why the sidecar ended the hold (None while it holds)."""
        self._closing = False
        self._on_end = on_end
        threading.Thread(target=self._watch, name=f"gdsload-hold-rank{rank}", daemon=True).start()

    def _watch(self) -> None:
        why = "the sidecar closed the connection (it stopped, or restarted)"
        try:
            while True:
                line = self._response.readline()
                if not line:
                    break
                if line.strip() == b"released":
                    why = "the sidecar voided the lease (a forced reload or unload, or its worker restarted)"
                    break
                if line.strip() == b"stopping":
                    why = "the sidecar is shutting down"
                    break
        except (OSError, ValueError, http.client.HTTPException) as e:  # closed mid-chunk: IncompleteRead
            why = f"the connection to the sidecar failed ({type(e).__name__}: {e})"
        finally:  # only this thread touches the response
            _forget_hold_socket(self._sock)
            self._response.close()
            self._conn.close()
            self._sock.close()
        if self._closing:
            return
        self.ended = why
        self._on_end(why)

    def close(self) -> None:
        """End the hold from this side (the sidecar then releases the lease, if it still holds it)."""
        self._closing = True
        try:
            # Wakes the reading thread, which closes the rest; close() alone would not end the connection while
            # the response's file object refers to the socket.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@dataclass
class MappedRank:
    """A rank's tensors mapped from the sidecar. Call :meth:`release` (or leave the ``with`` block) when done.

    While the mapping exists this process holds its lease (an open ``GET /v1/ipc/{rank}/hold``), so the
    sidecar neither unloads the memory under it nor keeps the lease once this process is gone, however it
    ends; :meth:`hold` keeps it for the life of the process.
    """

    rank: int
    tensors: dict[str, torch.Tensor]
    device: torch.device
    nbytes: int
    client: SidecarClient = field(repr=False)
    released: bool = False
    lease: str | None = None
    """The sidecar's lease for this mapping: releasing it leaves other engines' mappings of the rank alone."""
    held: bool = False
    """Held for the life of the process (:meth:`hold`)."""
    _hold: _HoldConnection | None = field(default=None, repr=False)
    _hold_error: SidecarError | None = field(default=None, repr=False)
    _on_lost: Callable[[MappedRank, str], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Tell the sidecar this process is done with the rank; idempotent. Drops this object's references.

        Tensors the engine bound without copying keep the mapping open in this process; release
        only once the engine has copied the weights, or when it shuts down.
        """
        if self.released:
            return
        hold, self._hold = self._hold, None
        self.held = False
        self.released = True
        self.tensors = {}
        try:
            self.client.release(self.rank, lease=self.lease)
        except SidecarNotReadyError as e:
            if hold is None:
                raise
            # The sidecar voided the lease meanwhile (a forced reload or unload), or ended the hold.
            log.debug("rank %d: lease %s was released already: %s", self.rank, self.lease, e)
        finally:
            if hold is not None:
                hold.close()

    def hold(self, on_lost: Callable[[MappedRank, str], None] | None = None) -> None:
        """Keep this mapping, and the sidecar's lease on it, for the rest of this process.

        For an engine whose parameters adopted the mapped memory: the sidecar keeps the rank (a
        reload or unload is refused while the lease is out, unless forced) until this process
        exits, when the kernel closes the hold connection and the sidecar releases the lease. If the
        sidecar drops the lease first (a forced reload or unload, a worker crash, the sidecar
        stopping), ``on_lost(mapped, why)`` runs on a background thread; by default a warning is
        logged. A CPU mapping made ``private`` stays valid after that (the pages stay with this
        process); CUDA IPC memory may not, and an engine should stop using it. Raises a
        :class:`SidecarError` where the lease cannot be held (a sidecar without held leases, or a
        lease it voided already): the caller copies the tensors instead.
        """
        if self.released or self.held or self.lease is None:
            raise SidecarProtocolError(f"rank {self.rank}: the mapping is released or has no lease; it cannot be held")
        if self._hold is None:
            if self._hold_error is not None:
                raise self._hold_error
            self._hold = self.client._hold_lease(self.rank, self.lease, self._hold_ended)
        if self._hold.ended is not None:
            raise SidecarNotReadyError(f"rank {self.rank}: lease {self.lease} cannot be held: {self._hold.ended}")
        self._on_lost = on_lost or _warn_lost
        self.held = True
        _HELD.append(self)  # the mapping lives as long as the process: nothing may collect it
        log.info(
            "rank %d: holding lease %s of %s for the life of this process", self.rank, self.lease, self.client.base_url
        )

    def _hold_ended(self, why: str) -> None:
        if self.held and self._on_lost is not None:
            self._on_lost(self, why)

    def __enter__(self) -> MappedRank:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.held:
            self.release()


_HELD: list[MappedRank] = []
"""Mappings held for the life of the process (:meth:`MappedRank.hold`)."""
_HOLD_SOCKETS: list[Any] = []
_AT_FORK: list[bool] = []


def _close_in_forked_children(sock: Any) -> None:
    """A child forked from the engine (a compile or data worker) must not keep the engine's hold
    connection open after the engine exits: it closes its copy right after the fork."""
    if not _AT_FORK and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_close_hold_sockets)
        _AT_FORK.append(True)
    _HOLD_SOCKETS.append(sock)


def _forget_hold_socket(sock: Any) -> None:
    try:
        _HOLD_SOCKETS.remove(sock)
    except ValueError:
        pass


def _close_hold_sockets() -> None:
    for sock in _HOLD_SOCKETS:
        # The child's descriptor only; the parent's connection stays. ``sock.close()`` would not close it: the
        # response's file object still refers to the socket, and a socket closes its descriptor only with the
        # last such reference. Detached, the descriptor is closed here and the child's socket object holds none.
        try:
            fd = sock.detach()
            if fd >= 0:
                os.close(fd)
        except OSError:
            pass
    _HOLD_SOCKETS.clear()


def _warn_lost(mapped: MappedRank, why: str) -> None:
    log.warning(
        "rank %d: the sidecar no longer holds this engine's lease %s: %s. Its memory is %s",
        mapped.rank,
        mapped.lease,
        why,
        "still mapped here, copy-on-write (the weights stay valid)"
        if mapped.device.type == "cpu"
        else "CUDA IPC memory the sidecar may free: restart this engine",
    )


class SidecarClient:
    """HTTP client for one sidecar.

    ``base_url`` defaults to ``http://127.0.0.1:8471``; ``token`` is sent as a bearer token.

    >>> SidecarClient().ipc_document(0)["kind"]  # doctest: +SKIP
    'cuda'
    """

    def __init__(self, base_url: str = DEFAULT_SIDECAR_URL, *, token: str | None = None, timeout: float = 30.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"sidecar URL {base_url!r} must start with http:// or https://")
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"SidecarClient({self.base_url!r}, token={'<set>' if self._token else None})"

    def ipc_document(self, rank: int) -> dict[str, Any]:
        """``GET /v1/ipc/{rank}``: the IPC document of a loaded rank."""
        body = self._request("GET", f"/v1/ipc/{_check_rank(rank)}", rank)
        try:
            doc = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SidecarProtocolError(
                f"{self.base_url}/v1/ipc/{rank} did not return JSON ({e}); is that URL a gdsload sidecar?"
            ) from None
        if not isinstance(doc, dict) or "kind" not in doc or "tensors" not in doc:
            raise SidecarProtocolError(
                f"{self.base_url}/v1/ipc/{rank} returned JSON that is not an IPC document "
                f"(keys {sorted(doc)[:8] if isinstance(doc, dict) else type(doc).__name__}); "
                "upgrade gdsload on the sidecar or the engine side"
            )
        if doc.get("rank") != rank:
            raise SidecarProtocolError(
                f"asked the sidecar for rank {rank} and got the document of rank "
                f"{doc.get('rank')!r}; the sidecar is serving another model or mapping"
            )
        return doc

    def release(self, rank: int, *, lease: str | None = None) -> None:
        """``POST /v1/ipc/{rank}/release``: this process no longer needs the mapping.

        With ``lease`` (from the IPC document) only that mapping is released; without, every lease
        of the rank is.
        """
        body = json.dumps({"lease": lease}).encode() if lease else b"{}"
        self._request("POST", f"/v1/ipc/{_check_rank(rank)}/release", rank, body=body)
        log.debug("released rank %d at %s", rank, self.base_url)

    def map_rank(self, rank: int, *, device: str | torch.device | None = None, private: bool = False) -> MappedRank:
        """Fetch rank ``rank``'s document and map its arena here; the tensors are views of the sidecar's memory.

        ``device``, when given, is where the engine expects the tensors (e.g. ``"cuda:0"``); a
        mapping that lands elsewhere is an error rather than a silent cross-device copy.
        ``private`` maps a CPU arena copy-on-write (see :func:`~gdsload.loader.handoff.ipc.import_rank`).
        On any failure after the fetch, the sidecar is told the rank is released.
        """
        doc = self.ipc_document(rank)
        lease = doc.get("lease")
        holder: list[MappedRank] = []
        hold: _HoldConnection | None = None
        hold_error: SidecarError | None = None
        if lease:
            # Held from now on: the sidecar releases a lease no engine holds within seconds of its export.
            try:
                hold = self._hold_lease(rank, lease, lambda why: holder and holder[0]._hold_ended(why))
            except SidecarNotReadyError as e:  # a sidecar without held leases (an older gdsload)
                hold_error = e
            except SidecarError:
                self._release_quietly(rank, lease)
                raise
        try:
            tensors = import_rank(doc, private=private)
            mapped_device = _device_of(doc, tensors)
            if device is not None:
                want = torch.device(device)
                if want.type != mapped_device.type or (want.index is not None and want.index != mapped_device.index):
                    raise IpcError(
                        f"rank {rank} from the sidecar is mapped on {str(mapped_device)!r} but the engine runs on "
                        f"{str(want)!r}; run the engine on the sidecar's GPU for this rank (same GPU UUID), "
                        "or load the weights from storage instead of the sidecar"
                    )
        except BaseException:
            self._release_quietly(rank, lease)
            if hold is not None:
                hold.close()
            raise
        nbytes = int(doc.get("nbytes", 0))
        log.info(
            "rank %d: mapped %d tensors (%d bytes) from %s on %s",
            rank,
            len(tensors),
            nbytes,
            self.base_url,
            mapped_device,
        )
        mapped = MappedRank(
            rank=rank,
            tensors=tensors,
            device=mapped_device,
            nbytes=nbytes,
            client=self,
            lease=lease,
            _hold=hold,
            _hold_error=hold_error,
        )
        holder.append(mapped)
        return mapped

    def _release_quietly(self, rank: int, lease: str | None) -> None:
        try:
            self.release(rank, lease=lease)
        except SidecarError as e:
            log.warning("could not release rank %d after a failed mapping: %s", rank, e)

    def _hold_lease(self, rank: int, lease: str, on_end: Callable[[str], None]) -> _HoldConnection:
        """Open the hold of ``lease``; ``on_end(why)`` runs (on the hold's thread) if the sidecar ends it."""
        conn, response, sock = self._open_hold(rank, lease)
        return _HoldConnection(conn, response, sock, rank, on_end)

    def _open_hold(
        self, rank: int, lease: str
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, socket.socket]:
        """``GET /v1/ipc/{rank}/hold``: the open connection, its response past the first line, and its socket."""
        url = urllib.parse.urlsplit(self.base_url)
        cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = cls(url.hostname or "127.0.0.1", url.port, timeout=self.timeout)
        query = urllib.parse.urlencode({"lease": lease, "pid": os.getpid()})
        path = f"{url.path.rstrip('/')}/v1/ipc/{_check_rank(rank)}/hold?{query}"
        where = f"GET {self.base_url}{path.split('?')[0]}"
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        try:
            conn.connect()
            sock = conn.sock  # kept: the response may take it over (Connection: close) and leave conn.sock None
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            if response.status != 200:
                detail = response.read(_BODY_LIMIT).decode("utf-8", "replace").strip()
                if response.status in (401, 403):
                    raise SidecarAuthError(
                        f"{where}: HTTP {response.status} ({detail!r}); use the token `gdsload serve` was started with"
                    )
                if response.status in (404, 405):
                    raise SidecarNotReadyError(
                        f"{where}: HTTP {response.status} ({detail!r}): the sidecar no longer holds lease {lease} of "
                        f"rank {rank}, or is a gdsload without held leases; upgrade it, or pass "
                        '{"adopt": false} to copy the tensors instead'
                    )
                raise SidecarProtocolError(f"{where}: unexpected HTTP {response.status} ({detail!r})")
            if response.readline().strip() != b"held":
                raise SidecarProtocolError(
                    f"{where} did not answer 'held'; upgrade the sidecar, or pass {{\"adopt\": false}}"
                )
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise SidecarUnavailableError(f"{where}: {type(e).__name__}: {e}") from None
        except SidecarError:
            conn.close()
            raise
        sock.settimeout(None)  # it stays open, silent, for as long as the mapping lives
        _close_in_forked_children(sock)
        return conn, response, sock

    def _request(self, method: str, path: str, rank: int, body: bytes | None = None) -> bytes:
        url = self.base_url + path
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        request = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 (scheme checked)
                return response.read()
        except urllib.error.HTTPError as e:
            detail = _detail(e)
            if e.code in (401, 403):
                hint = (
                    "no token was sent; pass the token `gdsload serve` uses (token or token_file)"
                    if not self._token
                    else "the token was refused; use the token `gdsload serve` was started with"
                )
                raise SidecarAuthError(f"{method} {url}: HTTP {e.code} {detail}; {hint}") from None
            if e.code in (404, 409, 503):
                raise SidecarNotReadyError(
                    f"{method} {url}: HTTP {e.code} {detail}; the sidecar does not hold rank {rank} right now — "
                    "wait for GET /readyz to return 200, and check it serves this model with this tensor-parallel size"
                ) from None
            raise SidecarProtocolError(f"{method} {url}: unexpected HTTP {e.code} {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            raise SidecarUnavailableError(
                f"{method} {url}: no answer ({reason}); start `gdsload serve` on this host or fix sidecar_url "
                f"(default {DEFAULT_SIDECAR_URL})"
            ) from None
        except http.client.HTTPException as e:  # something answered, but not in HTTP (another service on the port)
            raise SidecarProtocolError(
                f"{method} {url}: the answer is not HTTP ({type(e).__name__}: {str(e)[:100]!r}); is sidecar_url the "
                "port `gdsload serve` listens on?"
            ) from None


def _check_rank(rank: int) -> int:
    if type(rank) is not int or rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
    return rank


def _detail(e: urllib.error.HTTPError) -> str:
    try:
        text = e.read().decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    text = text[:_BODY_LIMIT] + ("..." if len(text) > _BODY_LIMIT else "")
    return f"({text!r})" if text else f"({e.reason})"


def _device_of(doc: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.device:
    for t in tensors.values():
        if t.numel():
            return t.device
    return torch.device("cuda" if doc.get("kind") in ("cuda", "cuda-ipc") else "cpu")
