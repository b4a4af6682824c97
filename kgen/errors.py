"""Errors kgen raises on purpose. Each message names what is wrong and how to fix it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class KgenError(Exception):
    """Base class: the CLI prints these without a traceback and exits non-zero."""


class SpecError(KgenError, ValueError):
    """A layout spec is invalid (the message names the file, the field and the reason)."""


class TableError(KgenError, ValueError):
    """A block-config table is corrupt or does not follow the schema."""


class BuildError(KgenError):
    """The generator could not produce a valid module."""


class UsageError(KgenError, ValueError):
    """An argument of a kgen command or function is not one of its valid values (the message lists them)."""


def describe_validation(path: object, exc: object, where: Callable[[tuple], str] | None = None,
                        fields_doc: str | None = None) -> str:
    """A pydantic ValidationError as one line per problem: the file, the field (dotted path),
    ``where(loc)`` (which row of a list, say) and what is wrong: an unknown key says to check
    the spelling (and where the fields are described), a wrong type or value names what was given."""
    lines = []
    for item in exc.errors():  # type: ignore[attr-defined]
        loc = tuple(item["loc"])
        field = ".".join(str(p) for p in loc) or "<top level>"
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling" + (f"; see {fields_doc} for the fields)" if fields_doc else ")")
        elif item["type"] == "missing":
            msg = "required field is missing"
        elif item["type"].endswith("_type") or item["type"] == "literal_error":
            given = item.get("input")
            if not isinstance(given, dict | list):
                msg += f" (got {given!r} of type {type(given).__name__})"
        lines.append(f"{path}: field '{field}'{where(loc) if where else ''}: {msg}")
    return "\n".join(lines)


def read_validated(
    path: Path | str,
    model: type[Model],
    error: type[KgenError],
    what: str = "file",
    parse: Callable[[str], object] = json.loads,
    syntax: str = "JSON",
    invalid: str | None = None,
) -> Model:
    """Read, parse (``parse``: JSON unless told) and validate one data file. Every failure is
    ``error`` naming the file: a missing file, bad ``syntax``, or (``describe_validation``)
    each field that does not follow ``model``, after ``invalid`` (what the file is not) when given."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    try:
        raw = parse(text)
    except ValueError as exc:  # json.JSONDecodeError and tomllib.TOMLDecodeError
        raise error(f"{path}: not valid {syntax}: {exc}") from None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        head = f"{path}: {invalid}:\n" if invalid else ""
        raise error(head + describe_validation(path, exc)) from None
