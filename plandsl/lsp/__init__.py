"""The language server (`plandsl lsp`): a plan's diagnostics, hovers, completions, definitions, formatting
and quick fixes for an editor, over LSP on stdio (pygls).

A front end beside the CLI: every answer comes from the stages (`plandsl.api`'s check and format, the
lowering's scopes, the cost model); nothing here checks, formats or evaluates a plan itself, and nothing
runs a user's code (a model written in torch is read from its `plandsl inspect` table, as `check` does).
`document` holds one version of an open file; `convert` maps spans to LSP ranges; `hover`, `complete`,
`navigate` and `actions` answer one request each; `server` wires them to pygls.
"""
