"""Go to definition: a name to where it is defined (in this file or one it imports, as the lowering's scope
finds it), an `import "..."` to the file it reads (as the loader resolves it)."""
from __future__ import annotations

from lsprotocol import types

from plandsl import syntax as s
from plandsl.lsp.convert import Positions, uri_of
from plandsl.lsp.document import Snapshot

START = types.Range(start=types.Position(line=0, character=0), end=types.Position(line=0, character=0))


def definition(snapshot: Snapshot, offset: int, positions: Positions) -> types.Location | None:
    names = snapshot.names
    if names is None:
        return None
    for item in names.root.syntax.items:
        if isinstance(item, s.Import) and item.span.start <= offset <= item.span.end:
            found = names.loader.resolve(names.root.path, item.path)
            return types.Location(uri=found.resolve().as_uri(), range=START) if found else None
    word = snapshot.word_at(offset)
    if word is None:
        return None
    found = names.find(word[2])
    if found is None:
        axis = snapshot.axis(offset, word[2])  # `over dp` -> `dp = 16` in the plan's mesh
        return positions.location(axis.span) if axis is not None and axis.span is not None else None
    scope, node = found
    span = getattr(node, "name_span", None) or node.span
    positions.sources.setdefault(scope.file, scope.source)
    return types.Location(uri=uri_of(span.file), range=positions.range(span))
