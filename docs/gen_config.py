"""The configuration reference, generated from the settings model itself (a MkDocs hook).

`docs/configuration-reference.md` holds `MARKER`; at build time `on_page_markdown` replaces it
with one table per section of `reach.config.ReachSettings`: each field's name, type, limits,
default and its own `description=` (or docstring), so the page cannot drift from the code.
`tests/unit/test_docs.py` checks that every field of every section is listed.

Run it alone to print the tables: `python docs/gen_config.py`.
"""

from __future__ import annotations

import enum
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

# The hook runs inside `mkdocs`, whose working directory is the repository root; a plain
# `python docs/gen_config.py` puts docs/ first on the path instead, so the root is added.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from reach.config import ReachSettings  # noqa: E402

MARKER = "<!-- reach-config-reference -->"

# What stands for a map's key in a dotted path (`policy.operations."<cap>:<op>".timeout_ms`).
KEY_NAMES = {
    "policy.capabilities": "<capability>",
    "policy.operations": '"<capability>:<operation>"',
    "capabilities": "<capability>",
}


@dataclass
class Row:
    name: str
    type: str
    default: str
    description: str


@dataclass
class Section:
    """One model's fields, documented at the first path that reaches it."""

    path: str
    model: type[BaseModel]
    rows: list[Row] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        slug = "".join(c if c.isalnum() else "-" for c in self.path)
        return "cfg-" + "-".join(part for part in slug.split("-") if part)

    @property
    def env_prefix(self) -> str | None:
        """`REACH_A__B__` for a path without map keys or list items (they take JSON)."""
        if "<" in self.path or "[" in self.path:
            return None
        if self.model is ReachSettings:
            return "REACH_"
        parts = [p.upper() for p in self.path.split(".") if p]
        return "REACH_" + "".join(p + "__" for p in parts)


def _models_in(annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """The settings models a field holds, with how the path goes on: '' (the model itself,
    or optional), '.{}' (a map's values), '[]' (a list's items)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    if origin is typing.Annotated:
        return _models_in(args[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in args for m in _models_in(a)]
    if origin is dict and len(args) == 2:
        return [(".{}" + how, m) for how, m in _models_in(args[1])]
    if origin is list and args:
        return [("[]" + how, m) for how, m in _models_in(args[0])]
    return []


def type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is typing.Annotated:
        said = [limits(a) for a in args[1:] if isinstance(a, FieldInfo)]
        return type_name(args[0]) + "".join(f" ({x})" for x in said if x)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}" if args else "map"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return "section"
        if issubclass(annotation, SecretStr):
            return "secret string"
        if issubclass(annotation, enum.Enum):
            return "one of " + ", ".join(f"`{m.value}`" for m in annotation)
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation)


def limits(info: FieldInfo) -> str:
    said = []
    for m in info.metadata:
        if isinstance(m, annotated_types.Gt):
            said.append(f"> {m.gt}")
        elif isinstance(m, annotated_types.Ge):
            said.append(f"≥ {m.ge}")
        elif isinstance(m, annotated_types.Lt):
            said.append(f"< {m.lt}")
        elif isinstance(m, annotated_types.Le):
            said.append(f"≤ {m.le}")
        elif isinstance(m, annotated_types.MinLen):
            said.append(f"length ≥ {m.min_length}")
        elif isinstance(m, annotated_types.MaxLen):
            said.append(f"length ≤ {m.max_length}")
        elif getattr(m, "pattern", None):
            said.append(f"matches `{m.pattern}`")
    return ", ".join(said)


def default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "`null`"
    return "`" + json.dumps(value, default=str, ensure_ascii=False) + "`"


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def cell(text: str) -> str:
    """Text for one table cell: a pipe splits cells, except inside a code span, where the
    table extension keeps it (and would show an escaping backslash)."""
    parts = text.replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _reach(model: type[BaseModel], path: str, found: dict[type[BaseModel], list[str]]) -> None:
    """Every path at which each model is reached, in the order met."""
    found.setdefault(model, []).append(path)
    for name, info in model.model_fields.items():
        dotted = f"{path}.{name}" if path else name
        for how, sub in _models_in(info.annotation):
            sub_path = dotted + how.replace("{}", KEY_NAMES.get(dotted, "<name>"))
            if sub_path not in found.get(sub, []):
                _reach(sub, sub_path, found)


def _home(paths: list[str]) -> str:
    """Where a model is documented: the path with the fewest map keys and list items, then the
    shortest (`policy.retry` rather than `policy.capabilities.<capability>.retry`)."""
    return min(paths, key=lambda p: (p.count("<") + p.count("["), p.count("."), paths.index(p)))


def sections(model: type[BaseModel] = ReachSettings) -> list[Section]:
    """Every section reachable from `model`, each model once, at its home path; a field holding
    a model links to that model's section."""
    reached: dict[type[BaseModel], list[str]] = {}
    _reach(model, "", reached)
    homes = {m: _home(paths) for m, paths in reached.items()}
    built = {m: Section(homes[m] or "reach", m) for m in reached}
    for m, section in built.items():
        for name, info in m.model_fields.items():
            description = info.description or ""
            links = []
            for _, sub in _models_in(info.annotation):
                links.append(f"[`{built[sub].path}`](#{built[sub].anchor})")
                if not description:
                    description = _first_paragraph(sub.__doc__)
            row_type = cell(type_name(info.annotation))
            said = limits(info)
            row_type += f"; {cell(said)}" if said else ""
            row_type += "; fields: " + ", ".join(links) if links else ""
            section.rows.append(Row(name, row_type, cell(default_text(info)), cell(description)))
    ordered: list[Section] = []
    _emit(model, "", homes, built, ordered)
    return ordered


def _emit(
    model: type[BaseModel],
    path: str,
    homes: dict[type[BaseModel], str],
    built: dict[type[BaseModel], Section],
    ordered: list[Section],
) -> None:
    """Depth first in the models' own field order, so a section follows its parent's."""
    if homes[model] == path and built[model] not in ordered:
        ordered.append(built[model])
    for name, info in model.model_fields.items():
        dotted = f"{path}.{name}" if path else name
        for how, sub in _models_in(info.annotation):
            _emit(
                sub,
                dotted + how.replace("{}", KEY_NAMES.get(dotted, "<name>")),
                homes,
                built,
                ordered,
            )


def render() -> str:
    out = []
    for section in sections():
        out.append(f"## `{section.path}` {{#{section.anchor}}}\n")
        doc = _first_paragraph(section.model.__doc__)
        if section.model is not ReachSettings and doc:
            out.append(doc + "\n")
        if section.env_prefix:
            out.append(f"Environment: `{section.env_prefix}<FIELD>`.\n")
        out.append("| field | type | default | description |")
        out.append("|---|---|---|---|")
        for row in section.rows:
            out.append(f"| `{row.name}` | {row.type} | {row.default} | {row.description} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, **_: object) -> str:
    """MkDocs hook: the marker becomes the tables."""
    return markdown.replace(MARKER, render()) if MARKER in markdown else markdown


if __name__ == "__main__":
    print(render())
