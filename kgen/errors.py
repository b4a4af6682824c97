"""Errors kgen raises on purpose. Each message names what is wrong and how to fix it."""


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
