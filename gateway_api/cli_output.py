"""The CLI's output: tables (rich in a terminal, plain aligned columns when piped), JSON that
keeps agent-written text from reaching the terminal raw, ages, one-line checks, the spinner.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from gateway_api.cli_api import clean

HEALTH_STYLE = {"ok": "green", "degraded": "yellow", "unhealthy": "bold red"}
STATUS_STYLE = {
    "success": "green",
    "accepted": "cyan",
    "running": "cyan",
    "error": "bold red",
    "timeout": "bold red",
}


def _styled_console(stream: Any) -> Any:
    """A rich Console on `stream` when it is a terminal (None: plain output)."""
    if not stream.isatty():
        return None
    from rich.console import Console  # only when drawing for a person

    return Console(file=stream, highlight=False)


def print_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    styles: Sequence[dict[str, str] | None] | None = None,
    *,
    title: str | None = None,
    wrap: str | None = None,
    console: Any = None,
) -> None:
    """A table: rich in a terminal (colours from `styles`, per column: value -> style; only
    the column named `wrap` folds when the terminal is narrow, the others are clipped), plain
    aligned columns otherwise (stable for grep and awk)."""
    rows = [[clean(cell) for cell in row] for row in rows]
    console = console if console is not None else _styled_console(sys.stdout)
    if console is not None:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
        for header in headers:
            folds = header == wrap
            table.add_column(header, no_wrap=not folds, overflow="fold" if folds else "ellipsis")
        for row in rows:
            cells = []
            for i, cell in enumerate(row):
                style = (styles[i] or {}).get(cell, "") if styles and i < len(styles) else ""
                cells.append(Text(cell, style=style))  # Text: no markup read from the data
            table.add_row(*cells)
        console.print(table)
        return
    if title:
        print(title)
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    for row in [list(headers), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def print_json(data: Any) -> None:
    """JSON with every non-ASCII character escaped: agent-written text never reaches the
    terminal as control or bidi characters."""
    print(json.dumps(data, indent=2, ensure_ascii=True))


def age(seconds: float) -> str:
    """0.4s, 12s, 3m05s, 2h14m, 3d02h: how long ago."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def compact(value: Any, limit: int = 48) -> str:
    """`checks` on one line: k=v pairs, long values clipped."""
    if isinstance(value, dict):
        text = " ".join(
            f"{k}={json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v}"
            for k, v in value.items()
        )
    else:
        text = json.dumps(value, ensure_ascii=False)
    text = text or "-"
    return text if len(text) <= limit else text[: limit - 1] + "…"


@contextlib.contextmanager
def progress(message: str) -> Iterator[None]:
    """A spinner on stderr while something waits, only when stderr is a terminal."""
    console = _styled_console(sys.stderr)
    if console is None:
        yield
        return
    from rich.text import Text

    with console.status(Text(message), spinner="dots"):
        yield
