"""The tuner's own error: a bad space file, workload file, name or option."""

from __future__ import annotations

from kgen.errors import KgenError


class TuneError(KgenError, ValueError):
    """`kgen tune` cannot start or go on; the message says what is wrong and how to fix it."""
