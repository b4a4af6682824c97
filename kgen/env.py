"""On/off switches read from the environment, parsed one way everywhere.

``KGEN_DISABLE``, ``KGEN_CHECK_INDICES``, ``TRITON_INTERPRET``...: a switch is on when its
value is ``1``, ``true``, ``yes`` or ``on`` (any case, surrounding spaces ignored); unset,
empty or anything else is off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TRUE_VALUES = ("1", "true", "yes", "on")


def env_flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """True when the switch ``name`` is on in ``env`` (``os.environ`` by default)."""
    env = os.environ if env is None else env
    return env.get(name, "").strip().lower() in TRUE_VALUES
