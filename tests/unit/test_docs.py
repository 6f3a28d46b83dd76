"""The docs site cannot drift: every page in the navigation exists, the generated configuration
reference lists every field of the settings model, and the README's agent is the docs' agent.

`make test` also builds the site with `mkdocs build --strict` (broken links, missing anchors).
"""

from __future__ import annotations

import importlib.util
import re
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from reach.config import ReachSettings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def mkdocs_config() -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def nav_pages(entries: Any) -> list[str]:
    """Every page path the navigation names, at any depth."""
    if isinstance(entries, str):
        return [entries]
    if isinstance(entries, list):
        return [page for entry in entries for page in nav_pages(entry)]
    if isinstance(entries, dict):
        return [page for value in entries.values() for page in nav_pages(value)]
    return []


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config", DOCS / "gen_config.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def reachable_models(annotation: Any, found: set[type[BaseModel]]) -> set[type[BaseModel]]:
    """Every settings model a type holds, however nested (optional, maps, lists)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation not in found:
            found.add(annotation)
            for info in annotation.model_fields.values():
                reachable_models(info.annotation, found)
        return found
    for arg in typing.get_args(annotation):
        reachable_models(arg, found)
    return found


def rendered_sections(markdown: str) -> dict[str, dict[str, str]]:
    """Heading path -> {field: description} from the generated tables."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in markdown.splitlines():
        heading = re.match(r"^## `(.+?)` \{#", line)
        if heading:
            current = sections.setdefault(heading.group(1), {})
            continue
        row = re.match(r"^\| `([a-z_0-9]+)` \|.*\| (.*) \|$", line)
        if row and current is not None:
            current[row.group(1)] = row.group(2).strip()
    return sections


def test_every_page_in_the_navigation_exists() -> None:
    pages = nav_pages(mkdocs_config()["nav"])
    assert "index.md" in pages
    assert "configuration-reference.md" in pages
    for protocol in ("http", "grpc", "websocket", "mqtt"):
        assert f"protocols/{protocol}.md" in pages
    missing = [page for page in pages if not (DOCS / page).is_file()]
    assert missing == []
    assert len(pages) == len(set(pages)), "a page is listed twice"


def test_the_reference_is_generated_by_the_sites_hook() -> None:
    generator = load_generator()
    assert "docs/gen_config.py" in mkdocs_config()["hooks"]
    page = (DOCS / "configuration-reference.md").read_text(encoding="utf-8")
    assert generator.MARKER in page
    built = generator.on_page_markdown(page)
    assert generator.MARKER not in built
    assert "## `reach`" in built


def test_the_reference_lists_every_field_of_every_section() -> None:
    generator = load_generator()
    sections = generator.sections()
    models = reachable_models(ReachSettings, set())
    assert {s.model for s in sections} == models, "each settings model has one section"
    rendered = rendered_sections(generator.render())
    for section in sections:
        assert section.path in rendered, section.path
        assert set(rendered[section.path]) == set(section.model.model_fields), section.path


@pytest.mark.parametrize("path", ["", "registry", "policy.retry", "security.encryption"])
def test_a_sections_rows_carry_the_fields_own_descriptions(path: str) -> None:
    generator = load_generator()
    rendered = rendered_sections(generator.render())
    section = next(s for s in generator.sections() if s.path == (path or "reach"))
    for name, info in section.model.model_fields.items():
        if info.description:
            assert rendered[section.path][name] == generator.cell(info.description)


def test_every_setting_is_described() -> None:
    """A new field without `description=` (or a section without a docstring) fails here."""
    rendered = rendered_sections(load_generator().render())
    blank = [
        f"{path}.{name}" for path, rows in rendered.items() for name, d in rows.items() if not d
    ]
    assert blank == []


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readmes_agent_is_the_docs_agent() -> None:
    """tests/integration/test_protocols.py runs the README's; the docs show the same one."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    smallest = python_blocks(readme.split("## Write an agent", 1)[1])[0]
    assert smallest in python_blocks((DOCS / "agents.md").read_text(encoding="utf-8"))
    assert smallest in python_blocks((DOCS / "quickstart.md").read_text(encoding="utf-8"))
    assert len([line for line in smallest.splitlines() if line.strip()]) == 6
