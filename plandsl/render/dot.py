"""DOT text, written deterministically: what every view builds its picture with.

Contract: `Graph.source()` depends only on the calls made on the graph, in order; numbers are
written in fixed formats (`num`, `pos`, `inches`), so the same plan gives byte-identical DOT
text on every machine and DOT files can be golden-tested. Also the colours the views share and
`NotApplicable`, raised when a view does not apply to a plan.
"""
from __future__ import annotations

import colorsys
import contextlib
import html
import re
from typing import Iterator

FONT = "Helvetica"


class NotApplicable(ValueError):
    """The view does not apply to this plan (a data-parallel plan has no schedule)."""


class Html(str):
    """An HTML-like label: written as <...>, not quoted. Build its text with `escape`."""


def escape(text: object) -> str:
    """Text for inside an HTML-like label."""
    return html.escape(str(text), quote=True)


def quote(value: object) -> str:
    """A DOT attribute value: HTML labels as <...>, numbers as written, the rest quoted.

    Backslashes are kept: `\\n`, `\\l` and `\\r` are graphviz's line breaks in labels."""
    if type(value) is str:  # the common case (ids, positions, colours, labels): a picture writes ~10^5
        return _quote_text(value)
    if isinstance(value, Html):
        return f"<{value}>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return num(value)
    return _quote_text(str(value))


def _quote_text(text: str) -> str:
    if _BARE(text) and text.lower() not in _KEYWORDS:
        return text
    text = text.replace('"', '\\"')
    if len(text) <= _CHUNK:
        return f'"{text}"'
    # graphviz's scanner refuses quoted strings over 16,384 characters: join pieces with +
    pieces, start = [], 0
    while start < len(text):
        end = min(start + _CHUNK, len(text))
        while end < len(text) and text[end - 1] == "\\":  # never split an escape
            end -= 1
        pieces.append(text[start:end])
        start = end
    return " + ".join(f'"{piece}"' for piece in pieces)


_CHUNK = 8000
_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|-?[0-9]*\.?[0-9]+").fullmatch
_KEYWORDS = {"node", "edge", "graph", "digraph", "subgraph", "strict"}


def num(value: float, digits: int = 2) -> str:
    """A fixed-point number without a negative zero: 12.50, 0.00."""
    text = f"{value:.{digits}f}"
    return text[1:] if text[0] == "-" and float(text) == 0 else text


def pos(x: float, y: float) -> str:
    """A pinned position in points (for `neato -n2`), to a tenth of a point."""
    return f"{num(x, 1)},{num(y, 1)}!"


def inches(points: float) -> str:
    return num(points / 72, 3)


def spline(points: list[tuple[float, float]], arrow: bool = False) -> str:
    """An edge's `pos` through `points` as straight segments (each a degenerate cubic Bézier)."""
    if len(points) < 2:
        raise ValueError("a spline needs at least two points")
    body = points[:-1] if arrow else points
    controls = [body[0]]
    for point in body[1:]:
        controls += [controls[-1], point, point]
    text = " ".join(f"{num(x, 1)},{num(y, 1)}" for x, y in controls)
    if arrow:
        x, y = points[-1]
        text = f"e,{num(x, 1)},{num(y, 1)} " + text
    return text


def attributes(values: dict[str, object]) -> str:
    """`[a=1, b="x"]`, in insertion order; None values are left out."""
    items = [f"{key}={_quote_text(value) if type(value) is str else quote(value)}"
             for key, value in values.items() if value is not None]
    return f" [{', '.join(items)}]" if items else ""


class Graph:
    """A DOT graph written line by line; subgraphs nest with `with graph.subgraph(...)`."""

    def __init__(self, name: str, *, comment: str | None = None, graph: dict | None = None,
                 node: dict | None = None, edge: dict | None = None, directed: bool = True):
        self._lines: list[str] = []
        self._indent = 1
        self.arrow = " -> " if directed else " -- "
        head = [f"// {line}".rstrip() for line in (comment or "").splitlines()]
        head.append(f"{'digraph' if directed else 'graph'} {quote(name)} {{")
        self._head = head
        for kind, values in (("graph", graph), ("node", node), ("edge", edge)):
            if values:
                self._lines.append(f"  {kind}{attributes(values)}")

    def node(self, node_id: str, **attrs: object) -> None:
        self._lines.append("  " * self._indent + quote(node_id) + attributes(attrs))

    def edge(self, tail: str, head: str, **attrs: object) -> None:
        self._lines.append("  " * self._indent + quote(tail) + self.arrow + quote(head) + attributes(attrs))

    def defaults(self, kind: str, **attrs: object) -> None:
        """`node [...]`, `edge [...]` or `graph [...]` at the current level."""
        self._lines.append("  " * self._indent + kind + attributes(attrs))

    def comment(self, text: str) -> None:
        self._lines.append("  " * self._indent + f"// {text}")

    @contextlib.contextmanager
    def subgraph(self, name: str, **attrs: object) -> Iterator[None]:
        pad = "  " * self._indent
        self._lines.append(f"{pad}subgraph {quote(name)} {{")
        if attrs:
            self._lines.append(f"{pad}  graph{attributes(attrs)}")
        self._indent += 1
        try:
            yield
        finally:
            self._indent -= 1
            self._lines.append(f"{pad}}}")

    def source(self) -> str:
        return "\n".join(self._head + self._lines + ["}"]) + "\n"


# ---- colours ------------------------------------------------------------------------------
# Tableau 10, lightened so that black text stays readable on every fill.
_LIGHT = ("#a6c8e8", "#ffc999", "#f4a6a7", "#b1dcd9", "#a8d8a0", "#f5e29a", "#d8b5d0", "#ffc4cc",
          "#d1bcae", "#d8d3d0")


def categorical(count: int) -> list[str]:
    """`count` light fills: Tableau 10 up to ten; past that, hues a golden angle apart in two
    lightnesses, so neighbouring coordinates (and the first and the last) never look alike."""
    if count <= len(_LIGHT):
        return list(_LIGHT[:count])
    fills = []
    for index in range(count):
        hue = (index * 0.381966) % 1.0
        red, green, blue = colorsys.hls_to_rgb(hue, 0.72 if index % 2 else 0.82, 0.6)
        fills.append(f"#{round(red * 255):02x}{round(green * 255):02x}{round(blue * 255):02x}")
    return fills


def text_width(text: str, size: float) -> float:
    """Rough width in points of `text` in Helvetica at `size` (generous: labels must fit)."""
    return len(text) * size * 0.6
