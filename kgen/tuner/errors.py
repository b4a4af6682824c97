"""The tuner's own error: a bad space file, workload file, name or option."""

from __future__ import annotations

from kgen.errors import KgenError


class TuneError(KgenError, ValueError):
    """`kgen tune` cannot start or go on; the message says what is wrong and how to fix it."""


def describe_validation(path: object, exc: object) -> str:
    """One line per pydantic error, naming the file and the field (dotted path)."""
    lines = []
    for item in exc.errors():  # type: ignore[attr-defined]
        field = ".".join(str(p) for p in item["loc"]) or "<top level>"
        msg = "unknown key (check the spelling)" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"{path}: field '{field}': {msg}")
    return "\n".join(lines)
