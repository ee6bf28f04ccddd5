"""kvikio's process-wide settings as the ``cufile`` and ``pinned`` backends set them: a ``KVIKIO_*`` variable
the user set wins.

kvikio takes its defaults from environment variables (``KVIKIO_NTHREADS=32`` asks for 32 reader threads,
``KVIKIO_COMPAT_MODE=ON`` for POSIX reads without cuFile). A backend that reads through kvikio picks values
of its own for the load (thread count, task and bounce-buffer sizes, O_DIRECT for cold files) and sets
them from ``open`` to ``close``; :func:`settings_to_apply` leaves out each setting whose variable is set,
so kvikio keeps the user's value.

>>> settings_to_apply({"num_threads": 16, "task_size": 4 << 20}, {"KVIKIO_NTHREADS": "32"})
{'task_size': 4194304}
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["ENV_VARS", "user_settings", "settings_to_apply", "value_in_force"]

log = logging.getLogger(__name__)

ENV_VARS: dict[str, str] = {
    "compat_mode": "KVIKIO_COMPAT_MODE",
    "num_threads": "KVIKIO_NTHREADS",
    "task_size": "KVIKIO_TASK_SIZE",
    "gds_threshold": "KVIKIO_GDS_THRESHOLD",
    "bounce_buffer_size": "KVIKIO_BOUNCE_BUFFER_SIZE",
    "auto_direct_io_read": "KVIKIO_AUTO_DIRECT_IO_READ",
    "auto_direct_io_write": "KVIKIO_AUTO_DIRECT_IO_WRITE",
}
"""kvikio's setting names (``kvikio.defaults.set``) and the environment variables kvikio reads them from."""


def user_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The kvikio settings the environment (default ``os.environ``) fixes: ``{setting: variable}``."""
    env = os.environ if env is None else env
    return {name: var for name, var in ENV_VARS.items() if env.get(var, "").strip()}


def settings_to_apply(wanted: Mapping[str, Any], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``wanted`` less every setting the user fixed with its ``KVIKIO_*`` variable (kvikio already holds the
    user's value); each one left out is logged once per load at debug level."""
    fixed = user_settings(env)
    kept = {k: v for k, v in wanted.items() if k not in fixed}
    for k in wanted:
        if k in fixed:
            log.debug("kvikio %s: %s is set, so gdsload leaves it (it would set %r)", k, fixed[k], wanted[k])
    return kept


def value_in_force(kvikio: Any, wanted: Mapping[str, Any], name: str, env: Mapping[str, str] | None = None) -> Any:
    """What kvikio uses for setting ``name`` once ``wanted`` is applied: the user's value (asked of kvikio)
    where a variable fixes it, else the one ``wanted`` gives."""
    if name in user_settings(env):
        return kvikio.defaults.get(name)
    return wanted[name]
