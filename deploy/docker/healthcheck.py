"""Container HEALTHCHECK: exit 0 when the sidecar answers ``GET /healthz`` with 200, else 1.

Liveness only (``/healthz``): a sidecar that is still loading is healthy, just not ready; readiness
(``/readyz``) is for orchestrators that route traffic, not for restarting the container.

Standard library only (the image has no curl). It reads the same ``GDSLOAD_HOST``/``GDSLOAD_PORT``
as the server, so set the port through ``GDSLOAD_PORT`` rather than ``--port`` when you change it.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

DEFAULT_PORT = "8471"
# A wildcard bind is reached through loopback from inside the container.
_WILDCARD = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}


def healthz_url(env: Mapping[str, str]) -> str:
    """The URL the server answers on, from the server's own environment variables."""
    host = env.get("GDSLOAD_HOST", "127.0.0.1").strip()
    host = _WILDCARD.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = env.get("GDSLOAD_PORT", "").strip() or DEFAULT_PORT
    return f"http://{host}:{port}/healthz"


def main() -> int:
    url = healthz_url(os.environ)
    # No proxies: an http_proxy in the container's environment must not carry the probe elsewhere.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2.0) as response:
            status = response.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (urllib.error.URLError, OSError) as e:
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
