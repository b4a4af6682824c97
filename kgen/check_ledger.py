"""The check's ledger: a committed record of what ``kgen check`` finds for every program.

One line a program, keyed by ``kgen check``'s program key (the kernel's content hash, its
constexprs, signature, divisibility, compile options, the target and the Triton version), with
what the check judges: the verdict, shared memory / LDS, registers, spills, stack and the
matrix instructions. ``kgen check --update-ledger`` compiles the programs whose lines are missing
and rewrites the file; ``kgen check --ci`` compiles only the programs the ledger lacks and a
sample of the ones it holds (seeded by the commit), fails on any line the sample contradicts,
and judges every program, from the ledger or fresh, against its target's limits. docs/check.md,
"The ledger", says what that proves.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import subprocess
from pathlib import Path
from typing import Any

from kgen import check
from kgen.check import CheckError, CheckReport, Enumeration, ResultCache, Variant

LEDGER_FORMAT = 1
LEDGER_DIR = "ledger"  # at the repository root, beside generated/: the results of its programs
# The wall seconds `kgen check --ci` may spend compiling (docs/check.md, "The budget").
BUDGET_S = 1200
SAMPLE_FRACTION = 0.05  # of each target's programs, at least SAMPLE_MIN of them
SAMPLE_MIN = 20
PROBE_PER_WORKER = 4  # programs a worker compiles before the budget is projected
# What a line says beside its numbers; every other field is a number the compile gives.
_INFO = ("target", "kernel", "modules", "program", "verdict", "key")
_NOT_NUMBERS = frozenset({"error", "compile_s", "cached", "ledger"})
# The numbers in a line's order (NVIDIA's and AMD's), others after them by name.
_ORDER = ("shared", "registers", "vgprs", "agprs", "sgprs", "spill_stores", "spill_loads", "vgpr_spills",
          "sgpr_spills", "stack_bytes", "scratch_bytes", "mma")


def default_path() -> Path:
    """ledger/check-triton<version>.jsonl of the source checkout: one file per Triton version,
    as every key holds the version."""
    import triton

    from kgen.locations import source_root

    root = source_root()
    if root is None:
        raise CheckError("no source checkout to find the ledger in: pass --ledger FILE")
    return root / LEDGER_DIR / f"check-triton{triton.__version__}.jsonl"


@dataclasses.dataclass(frozen=True)
class Scope:
    """The programs of one run: the targets, the module selection and the narrowing flags."""

    archs: tuple[str, ...]
    selection: dict[str, Any]  # select_variants' keywords
    largest_rows: bool = False

    def flags(self) -> str:
        """The scope as `kgen check` flags, in one canonical spelling (the ledger's header)."""
        from kgen.spec import KV_DTYPES, Q_DTYPES, canonical_dtype

        s = self.selection
        entries, index_dtypes = set(s.get("entries") or check.ENTRIES), set(s.get("index_dtypes") or check.INDEX_DTYPES)
        picks = (("--layout", s.get("layouts") or ()),
                 ("--kv-dtype", [canonical_dtype(d, KV_DTYPES, "KV") for d in s.get("kv_dtypes") or ()]),
                 ("--q-dtype", [canonical_dtype(d, Q_DTYPES, "query") for d in s.get("q_dtypes") or ()]),
                 ("--variant", s.get("variants") or ()),
                 ("--entry", entries if entries != set(check.ENTRIES) else ()),
                 ("--index-dtype", index_dtypes if index_dtypes != set(check.INDEX_DTYPES) else ()))
        parts = ["--arch " + ",".join(a for a in check.ARCHS if a in self.archs)]
        parts += [f"{flag} {','.join(sorted(set(values)))}" for flag, values in picks if values]
        return " ".join(parts + (["--largest-rows"] if self.largest_rows else []))

    @functools.cached_property
    def programs(self) -> Enumeration:
        """The scope's distinct programs (enumerated once)."""
        return check.select_scope(list(self.archs), self.largest_rows, **self.selection)


@dataclasses.dataclass
class Ledger:
    """A ledger file: its header's scope (None: no file yet) and its lines by key."""

    path: Path
    scope: str | None
    lines: dict[str, dict]

    @classmethod
    def read(cls, path: Path) -> Ledger:
        import triton

        path = Path(path)
        if not path.exists():
            return cls(path, None, {})
        rows = path.read_text().splitlines()
        header = _parse(path, 1, rows[0]) if rows else {}
        if header.get("kgen check ledger") != LEDGER_FORMAT or header.get("triton") != triton.__version__:
            raise CheckError(f"{path}:1 is not the header of a format-{LEDGER_FORMAT} ledger of Triton "
                             f"{triton.__version__}: pass this Triton's ledger (--ledger), or delete the file and run "
                             "`kgen check --update-ledger` with CI's flags")
        lines: dict[str, dict] = {}
        for number, text in enumerate(rows[1:], start=2):
            line = _parse(path, number, text)
            if any(name not in line for name in _INFO) or line["key"] in lines:
                raise CheckError(f"{path}:{number}: a line needs {', '.join(_INFO)} and a key no other line has; "
                                 f"restore the file (`git checkout -- {path.name}`) or delete the line and run "
                                 "`kgen check --update-ledger`")
            lines[line["key"]] = line
        return cls(path, header.get("scope"), lines)

    def write(self) -> None:
        import triton

        order = {arch: i for i, arch in enumerate(check.ARCHS)}
        rows = sorted(self.lines.values(), key=lambda line: (order.get(line["target"], len(order)), line["target"],
                                                             line["kernel"], line["modules"], line["program"],
                                                             line["key"]))
        header = {"kgen check ledger": LEDGER_FORMAT, "triton": triton.__version__, "scope": self.scope}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in [header, *rows]))
        tmp.replace(self.path)

    def result(self, key: str) -> dict:
        """A line as a compile result (verdict() reads it as it reads a fresh one)."""
        return {**numbers(self.lines[key]), "error": None, "compile_s": 0.0, "ledger": True}


def _parse(path: Path, number: int, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise CheckError(f"{path}:{number}: not a JSON object ({exc}): restore the file from git or run "
                         "`kgen check --update-ledger`") from exc
    if not isinstance(value, dict):
        raise CheckError(f"{path}:{number}: not a JSON object")
    return value


def numbers(result: dict) -> dict:
    """What a compile result or a line holds that the compile gives, the resources then the MMAs,
    in one order whichever way the result was read."""
    found = {k: v for k, v in result.items() if k not in _NOT_NUMBERS and k not in _INFO}
    return {k: found[k] for k in sorted(found, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER), k))}


def verdict_text(variant: Variant, result: dict) -> str:
    return "; ".join(check.verdict(variant, result)) or "ok"


def ledger_line(variant: Variant, result: dict) -> dict:
    """The ledger's line of a compiled (or ledger-read) program."""
    modules = sorted(variant.modules) or [variant.module]
    return {"target": variant.arch, "kernel": variant.kernel.strip("_"),
            "modules": modules[0] + (f" +{len(modules) - 1}" if len(modules) > 1 else ""),
            "program": check._config_text(variant), "verdict": verdict_text(variant, result), **numbers(result),
            "key": variant.key}


def differences(variant: Variant, line: dict, result: dict) -> list[str]:
    """How a line differs from a result (fresh, or read from it): each number, and the verdict."""
    if result.get("error"):
        return [f"compile error now: {result['error']}"]
    have, fresh = numbers(line), numbers(result)
    out = [f"{name} {json.dumps(have.get(name))} in the ledger, {json.dumps(fresh.get(name))} compiled"
           for name in sorted(set(have) | set(fresh)) if have.get(name) != fresh.get(name)]
    judged = verdict_text(variant, result)
    if judged != line["verdict"]:
        out.append(f"verdict {line['verdict']!r} in the ledger, {judged!r} from the numbers")
    return out


def commit_seed(ledger: Ledger) -> str:
    """The sample's seed: the commit checked out (`git rev-parse HEAD`), so two runs of one commit
    sample the same programs; outside git, the ledger's own content."""
    where = next(p for p in (ledger.path.parent, *ledger.path.parents) if p.exists())
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        head = None
    if head is not None and head.returncode == 0 and head.stdout.strip():
        return head.stdout.strip()
    content = ledger.path.read_bytes() if ledger.path.exists() else b""
    return "ledger " + hashlib.sha256(content).hexdigest()


def rank(seed: str, key: str) -> str:
    """A program's place in the seeded draw: the smallest first."""
    return hashlib.sha256(f"{seed} {key}".encode()).hexdigest()


def draw_sample(variants: list[Variant], ledger: Ledger, seed: str, fraction: float = SAMPLE_FRACTION,
                minimum: int = SAMPLE_MIN) -> list[Variant]:
    """The programs to compile again of those the ledger holds: per target, ``fraction`` of its
    programs and at least ``minimum`` (all it holds, if fewer), first by the seeded rank."""
    sample = []
    for arch in dict.fromkeys(v.arch for v in variants):
        mine = [v for v in variants if v.arch == arch]
        held = sorted((v for v in mine if v.key in ledger.lines), key=lambda v: rank(seed, v.key))
        sample += held[:max(math.ceil(fraction * len(mine)), minimum)]
    return sample


class LedgerCache(ResultCache):
    """The ledger's lines as cached results, before the on-disk cache; ``fresh`` keys are
    always compiled (the sample, and `--recompile`)."""

    def __init__(self, ledger: Ledger, disk: ResultCache, fresh: set[str]) -> None:
        super().__init__(disk.root)
        self.ledger, self.fresh = ledger, fresh

    def get(self, key: str) -> dict | None:
        if key in self.fresh:
            return None
        if key in self.ledger.lines:
            return self.ledger.result(key)
        return super().get(key)


@dataclasses.dataclass
class LedgerRun:
    """What one `--ci` or `--update-ledger` run found."""

    report: CheckReport
    ledger: Ledger
    missing: list[str]  # keys of the scope's programs the ledger had no line for (compiled)
    sampled: list[str]  # keys compiled again to compare with their lines
    differ: dict[str, list[str]]  # key -> how its line differs from what this run finds
    stale: list[str]  # ledger keys that are no program of this scope (when the scope is the ledger's)

    def closing(self) -> str:
        return (f"ledger: {len(self.report.enumeration.variants)} programs, {len(self.missing)} compiled new, "
                f"{len(self.sampled)} sampled, {len(self.differ)} differ")


def _compile(scope: Scope, enumeration: Enumeration, cache: ResultCache, jobs: int, progress: bool,
             budget: check.Budget | None = None) -> CheckReport:
    results, timing = check.compile_all(enumeration.variants, list(scope.archs), jobs, cache, progress, budget)
    return CheckReport(enumeration, results, timing, list(scope.archs))


def _stale(scope: Scope, ledger: Ledger, enumeration: Enumeration) -> list[str]:
    if ledger.scope != scope.flags():
        return []  # another scope's lines: this run cannot tell which are stale
    keys = {v.key for v in enumeration.variants}
    return sorted(k for k in ledger.lines if k not in keys)


def run_ci(scope: Scope, ledger: Ledger, jobs: int, budget_s: float = BUDGET_S, fraction: float = SAMPLE_FRACTION,
           minimum: int = SAMPLE_MIN, seed: str | None = None, progress: bool = True,
           use_cache: bool = True) -> LedgerRun:
    """`kgen check --ci`: compile the programs the ledger lacks and a seeded sample of those it
    holds, within ``budget_s`` wall seconds (0: no budget), and compare the sample with its lines."""
    enumeration = scope.programs
    seed = seed or commit_seed(ledger)
    missing = [v.key for v in enumeration.variants if v.key not in ledger.lines]
    sampled = [v.key for v in draw_sample(enumeration.variants, ledger, seed, fraction, minimum)]
    budget = check.Budget(budget_s, lambda key: rank(seed, key), PROBE_PER_WORKER * jobs) if budget_s else None
    cache = LedgerCache(ledger, ResultCache(check.cache_dir() if use_cache else None), set(sampled))
    try:
        report = _compile(scope, enumeration, cache, jobs, progress, budget)
    except check.BudgetExceeded as exc:
        raise LedgerOverBudget(exc, len(missing), len(sampled), scope, ledger) from exc
    by_key = {v.key: v for v in enumeration.variants}
    differ = {}
    for key in [k for k in by_key if k in ledger.lines]:
        found = differences(by_key[key], ledger.lines[key], report.results[key])
        if found:
            differ[key] = found
    return LedgerRun(report, ledger, missing, sampled, differ, _stale(scope, ledger, enumeration))


def update(scope: Scope, ledger: Ledger, jobs: int, recompile: set[str] = frozenset(), use_cache: bool = True,
           progress: bool = True) -> LedgerRun:
    """`kgen check --update-ledger`: compile the scope's programs the ledger lacks (and the
    ``recompile`` keys, "all" for every one), then rewrite the lines of the scope. Lines of
    programs no longer in it are dropped when the scope is the ledger's; another scope's lines
    are kept. A compile error gets no line (it is compiled, and fails, again)."""
    enumeration = scope.programs
    keys = {v.key for v in enumeration.variants}
    unknown = sorted(set(recompile) - keys - {"all"})
    if unknown:
        raise CheckError(f"--recompile {','.join(unknown)}: no program of this scope has that key (keys are the "
                         "ones `kgen check --ci` names, with the same scope flags)")
    fresh = keys if "all" in recompile else set(recompile)
    missing = [v.key for v in enumeration.variants if v.key not in ledger.lines]
    cache = LedgerCache(ledger, ResultCache(check.cache_dir() if use_cache else None), fresh)
    report = _compile(scope, enumeration, cache, jobs, progress)
    stale = _stale(scope, ledger, enumeration)
    if ledger.scope is None:
        ledger.scope = scope.flags()
    differ = {}
    for variant in enumeration.variants:
        result = report.results[variant.key]
        if result.get("error"):
            ledger.lines.pop(variant.key, None)
            continue
        line = ledger_line(variant, result)
        if variant.key in ledger.lines and ledger.lines[variant.key] != line:
            differ[variant.key] = differences(variant, ledger.lines[variant.key], result) or ["its description"]
        ledger.lines[variant.key] = line
    for key in stale:
        del ledger.lines[key]
    ledger.write()
    return LedgerRun(report, ledger, missing, sorted(fresh - set(missing)), differ, stale)


def mend_command(scope: Scope, ledger: Ledger) -> str:
    """The command that brings the ledger up to date for this scope."""
    try:
        default = ledger.path.resolve() == default_path().resolve()
    except CheckError:  # no source checkout
        default = False
    return f"kgen check --update-ledger {scope.flags()}" + ("" if default else f" --ledger {ledger.path}")


class LedgerOverBudget(CheckError):
    """`kgen check --ci` would take (or took) longer than its budget: the ledger is too far behind."""

    def __init__(self, exc: check.BudgetExceeded, missing: int, sampled: int, scope: Scope, ledger: Ledger) -> None:
        super().__init__(f"{missing} programs of this scope are missing from the ledger {ledger.path} (beside "
                         f"{sampled} sampled): {exc} (--budget-s; docs/check.md, \"The budget\"). Run "
                         f"`{mend_command(scope, ledger)}` (in the background: it compiles every missing program) "
                         "and commit the ledger")
