"""render: the plan becomes source text through the templates of its lowering.

The plan is the templates' context: they read its sections (``plan.specialization.has_pe``,
``plan.tiles.block_d``, ...). Besides the plan they see only the kgen version. StrictUndefined
makes a name the templates use but the plan lacks a build error.
"""

from __future__ import annotations

import functools
import pprint
import textwrap
from pathlib import Path

import jinja2

from kgen.errors import BuildError
from kgen.passes.context import REPO_ROOT, BuildContext
from kgen.plan import Decision, Output, Plan

NAME = "render"
TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "templates"


def repo_relative(text: str) -> str:
    """Paths under the repository without its root (a module names its sources portably)."""
    return str(text).replace(str(REPO_ROOT) + "/", "")


# Generated lines stay within ruff's limit (pyproject.toml's line-length).
LINE_LENGTH = 120


def py_literal(value: object, indent: int = 0) -> str:
    """A Python value as a literal that wraps to the line limit: ``indent`` is the column the
    literal starts at; continuation lines keep that indent."""
    text = pprint.pformat(value, width=LINE_LENGTH - indent, sort_dicts=False, compact=True)
    return text.replace("\n", "\n" + " " * indent)


def py_comment(text: str, indent: int = 0) -> str:
    """Prose (a decision's reason) as ``#`` comment lines within the line limit."""
    prefix = " " * indent + "# "
    return "\n".join(textwrap.wrap(str(text), LINE_LENGTH - len(prefix), initial_indent=prefix,
                                    subsequent_indent=prefix, break_on_hyphens=False))


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["repo_relative"] = repo_relative
    env.filters["py_literal"] = py_literal
    env.filters["py_comment"] = py_comment
    return env


def render(plan: Plan, ctx: BuildContext) -> Plan:
    for section in ("specialization", "tiles", "config", "fit"):
        plan.need(section, NAME)
    template = plan.need("lowering", NAME).kernel_template
    try:
        source = environment().get_template(template).render(
            plan=plan, kgen_version=ctx.kgen_version)
    except jinja2.UndefinedError as exc:
        raise BuildError(f"{plan.uri}: template {template} uses something the plan lacks: {exc}") from None
    output = Output(source=source)
    return plan.with_([Decision(NAME, "source", f"{output.lines} lines", f"rendered {template}")], output=output)
