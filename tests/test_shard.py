"""The gpu suite in parts (README, gpu_tests.sh): pytest-split's `--splits N --group I` gives N disjoint
parts whose union is the whole collection, so N device calls run every test once."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_table_variant.py", "tests/test_device_scripts.py"]


def _collected(*extra: str) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *FILES, *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, [line for line in proc.stdout.splitlines() if "::" in line]


def test_parts_partition_the_collection() -> None:
    status, every = _collected()
    assert status == 0 and len(every) > 10
    parts = [_collected("--splits", "3", "--group", str(i))[1] for i in (1, 2, 3)]
    assert sorted(sum(parts, [])) == sorted(every)  # disjoint, and nothing lost
    assert all(parts)
