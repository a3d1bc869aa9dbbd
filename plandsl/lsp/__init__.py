"""The language server (`plandsl lsp`): a plan's diagnostics, hovers, completions, definitions, formatting
and quick fixes for an editor, over LSP on stdio (pygls).

A front end beside the CLI: every answer comes from the stages (`plandsl.api`'s check and format, the
lowering's scopes, the cost model); nothing here checks, formats or evaluates a plan itself, and nothing
runs a user's code (a model written in torch is read from its `plandsl inspect` table, as `check` does).
`document` holds one version of an open file; `convert` maps spans to LSP ranges; `hover`, `complete`,
`navigate` and `actions` answer one request each; `server` wires them to pygls.
"""
from __future__ import annotations

from typing import Callable

from plandsl.diagnostics import PlanError, diag

NEEDS = ("pygls", "lsprotocol", "cattrs", "attrs")
"""What the language server imports beyond plandsl (the `lsp` extra): one of them missing is E815."""


def load_server() -> Callable[[], None]:
    """The language server's `serve` (`server.py`, imported with pygls); PlanError E815 where pygls, or a package it
    needs, is not installed (the command line's exit 2, as for a usage error). Any other ImportError is raised."""
    try:
        from plandsl.lsp.server import serve  # lazy: pygls only for the language server
    except ImportError as error:
        if (error.name or "").split(".")[0] not in NEEDS:
            raise
        raise PlanError([diag("E815", f"plandsl lsp needs pygls, which is not installed here ({error})",
                              hint="pip install 'plandsl[lsp]' where the editor starts `plandsl lsp`")]) from None
    return serve
