"""Rewrites of whole plans: `shrink` (a cluster plan scaled down to one machine) and `generate --from`
(a partial plan completed in place by the search)."""
