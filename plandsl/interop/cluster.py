"""The cluster (and model) an import names on the command line: its devices, and the stdlib files it needs.

Stage: below the importers of `plandsl.interop`. Contract: `cluster_devices(text)` counts the devices of a cluster
expression (`dgx_a100 x 16`, a stdlib name) through the language itself, ValueError with its complaint;
`cluster_lines(cluster, world)` gives the plan's cluster expression, its imports and whether the mesh covers
part of it; `stdlib_imports(text)` the stdlib files that define the names of any expression.
"""
from __future__ import annotations

import functools
import re

from plandsl.check.analysis import analyze
from plandsl.syntax.loader import stdlib_files, stdlib_root

DEFAULT_NODE = "dgx_h100"   # the cluster of an import given only --world-size: nodes of 8 H100s


@functools.lru_cache(maxsize=1)
def stdlib_names() -> dict[str, str]:
    """Device, node, cluster and model name -> the stdlib file defining it (`clusters/dgx_a100`)."""
    names: dict[str, str] = {}
    for name in stdlib_files():
        if name.startswith(("clusters/", "models/")):
            text = (stdlib_root() / f"{name}.plan").read_text(encoding="utf-8")
            for word in re.findall(r"^(?:device|node|cluster|model)\s+([A-Za-z_][A-Za-z0-9_]*)", text, re.M):
                names.setdefault(word, name)
    return names


def stdlib_imports(text: str) -> list[str]:
    names = stdlib_names()
    return sorted({names[word] for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text) if word in names})


def cluster_devices(cluster: str | None) -> int | None:
    """The devices of a cluster expression (None for None); ValueError with the language's complaint."""
    if cluster is None:
        return None
    header = "".join(f'import "{i}"\n' for i in stdlib_imports(cluster))
    analysis = analyze("<cluster>", text=f"{header}cluster __cluster = {cluster.strip() or '_'}\n")
    found = next((c for c in analysis.document.clusters if c.name == "__cluster"), None) \
        if analysis.ok and analysis.document is not None else None
    if found is None:
        first = analysis.errors[0].message if analysis.errors else "not a cluster"
        raise ValueError(f"--cluster {cluster}: {first}")
    return found.num_devices


def cluster_lines(cluster: str | None, world: int | None) -> tuple[str, list[str], bool]:
    """The cluster expression, the stdlib files it needs, and whether the mesh covers only part of it."""
    if cluster is None:
        nodes = -(-(world or 1) // 8)
        text, part = f"{DEFAULT_NODE} x {nodes}", (world or 1) % 8 != 0
    else:
        text, part = cluster.strip(), False
    if cluster is not None and world is not None:
        part = cluster_devices(cluster) > world  # fewer devices: the checker's E301
    return text, stdlib_imports(text), part
