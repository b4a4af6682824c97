"""kgen's version (pyproject.toml holds the same string; tests/test_packaging.py keeps them equal)."""

__version__ = "0.1.0"
