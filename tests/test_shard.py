"""`pytest --shard I/N` (tests/conftest.py): N disjoint parts whose union is the whole collection, an
xdist group never split (a part is a crc32 of a name: the same on every machine); a malformed I/N is
refused by name."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_table_variant.py", "tests/test_device_scripts.py"]


def _collected(*extra: str) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *FILES, *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, [line for line in proc.stdout.splitlines() if "::" in line]


def test_shards_partition_the_collection_and_keep_a_group_whole() -> None:
    status, every = _collected()
    assert status == 0 and len(every) > 10
    parts = [_collected("--shard", f"{i}/3")[1] for i in (1, 2, 3)]
    assert sorted(sum(parts, [])) == sorted(every)  # disjoint, and nothing lost
    assert all(parts)


class _Item:
    def __init__(self, nodeid: str, group: str | None) -> None:
        self.nodeid = nodeid
        self.marker = pytest.mark.xdist_group(group).mark if group else None

    def get_closest_marker(self, name: str):
        return self.marker if name == "xdist_group" else None


def test_a_group_lands_in_one_shard() -> None:
    from conftest import _shard_of

    for count in (2, 3, 5):
        grouped = {_shard_of(_Item(f"tests/t.py::test_{i}", "large_pool"), count) for i in range(40)}
        alone = {_shard_of(_Item(f"tests/t.py::test_{i}", None), count) for i in range(40)}
        assert len(grouped) == 1 and alone == set(range(1, count + 1))


def test_a_malformed_shard_is_refused_by_name() -> None:
    for bad in ("4/3", "a/b"):
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", FILES[0], "--shard", bad],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and f"--shard {bad!r}" in proc.stderr + proc.stdout
