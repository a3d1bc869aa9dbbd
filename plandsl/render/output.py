"""DOT text -> SVG, PNG or PDF through graphviz's own programs (`dot`, `neato -n2`).

Contract: `to_image(dot_text, fmt, engine) -> bytes`; `GraphvizMissing` (a RuntimeError whose
message says how to install graphviz) when the binary is not on PATH, `GraphvizFailed` when it
exits non-zero. DOT text itself never needs graphviz: `--format dot` works without it.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import time

FORMATS = ("dot", "svg", "png", "pdf", "html")
IMAGE_FORMATS = ("svg", "png", "pdf")
MISSING = "graphviz's `dot` is not installed"
INSTALL = "apt-get install graphviz (Debian/Ubuntu) or brew install graphviz; `--format dot` writes DOT text without it"


def graphviz_hint() -> str:
    """E812's hint: how to install graphviz, or do without it."""
    return INSTALL


class GraphvizMissing(RuntimeError):
    """graphviz's program is not on PATH: its message says so (`MISSING`) and how to install it (`INSTALL`)."""

    def __init__(self) -> None:
        super().__init__(f"{MISSING}: {INSTALL}")


class GraphvizFailed(RuntimeError):
    pass


def format_of(path: str | None, given: str | None) -> str | None:
    """The output format: `given`, else the suffix of `path` (`.svg` -> svg), else None."""
    if given:
        return given
    if path is None:
        return None
    suffix = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    return {"htm": "html", "gv": "dot"}.get(suffix, suffix) if suffix in FORMATS + ("htm", "gv") else None


def graphviz_available() -> bool:
    return shutil.which("dot") is not None


def to_image(dot_text: str, fmt: str, engine: tuple[str, ...] = ("dot",), timings: dict | None = None) -> bytes:
    """Run graphviz (`engine` is the program and its flags) on `dot_text`; `timings["graphviz"]`
    gets the seconds it took."""
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"cannot render to '{fmt}': choose one of {', '.join(IMAGE_FORMATS)}")
    program = shutil.which(engine[0])
    if program is None or not graphviz_available():
        raise GraphvizMissing()
    start = time.perf_counter()
    result = subprocess.run([program, *engine[1:], "-q", f"-T{fmt}"], input=dot_text.encode("utf-8"),
                            capture_output=True, check=False)
    if timings is not None:
        timings["graphviz"] = timings.get("graphviz", 0.0) + time.perf_counter() - start
    if result.returncode != 0:
        message = result.stderr.decode("utf-8", "replace").strip().splitlines()
        raise GraphvizFailed(f"{engine[0]} failed (exit {result.returncode}): "
                             + (message[0] if message else "no message"))
    return result.stdout


_ELEMENT = re.compile(r'(<g id="[^"]*" class="(?:node|edge|cluster)">\n)<title>[^<]*</title>\n'
                      r'(<g id="a_[^"]*"><a xlink:title="([^"]*)">)?')
_COMMENT = re.compile(r"^<!-- .*? -->\n", flags=re.M)


def readable_titles(svg: str) -> str:
    """Graphviz's SVG with hover titles for people: each node's and edge's `<title>` (its DOT id, as
    `t0_0_a->t0_0_b`) becomes its tooltip (`rank 2 · stage 5 · forward · microbatch 0 · ...`), or goes
    where it has none; the `<!-- id -->` comments before each go too."""
    def title(match: re.Match) -> str:
        tooltip = match.group(3)
        return match.group(1) + (f"<title>{tooltip}</title>\n{match.group(2)}" if tooltip is not None else "")
    return _ELEMENT.sub(title, _COMMENT.sub("", svg))
