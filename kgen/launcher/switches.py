"""On/off switches read from the environment, parsed one way everywhere.

``KGEN_DISABLE``, ``KGEN_CHECK_INDICES``, ``KGEN_NO_PDL``, ``KGEN_NO_GLUON``,
``KGEN_NO_CLUSTER_MERGE``...: a switch is on when its value is ``1``, ``true``, ``yes`` or ``on``
(any case, surrounding spaces ignored); unset, empty or anything else is off.

kgen's own code and the launcher every generated module runs (``kgen.launcher``) read them
through ``env_flag``; this file imports nothing but the standard library.

``TRITON_INTERPRET`` is Triton's switch, not kgen's: a generated module asks Triton whether it
interprets (``triton.knobs.runtime.interpret``, what ``@triton.jit`` decided with) instead of
parsing it, because Triton parses it its own way (3.6 also takes ``y`` and does not ignore
spaces). The dispatch gate reads it with ``env_flag`` for its report; ``1``, ``true``, ``yes``
and ``on`` mean the same to both.
"""

import os
from collections.abc import Mapping

TRUE_VALUES = ("1", "true", "yes", "on")


def env_flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """True when the switch ``name`` is on in ``env`` (``os.environ`` by default)."""
    env = os.environ if env is None else env
    return env.get(name, "").strip().lower() in TRUE_VALUES
