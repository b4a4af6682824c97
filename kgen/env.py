"""On/off switches read from the environment, parsed one way everywhere.

``KGEN_DISABLE``, ``KGEN_CHECK_INDICES``, ``KGEN_NO_PDL``, ``KGEN_NO_GLUON``...: a switch is on
when its value is ``1``, ``true``, ``yes`` or ``on`` (any case, surrounding spaces ignored);
unset, empty or anything else is off.

One text, two users: kgen's own code imports ``env_flag`` from here, and every generated module
carries the code below the imports verbatim (``kgen/passes/render.py``, ``env_source``), since a
module imports only torch, triton and the standard library. So this file imports nothing but
the standard library and nothing from kgen, and what follows its imports must run unchanged
inside a generated module (which imports ``os`` and ``Mapping`` itself).

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
