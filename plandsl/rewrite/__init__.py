"""Rewrites of whole plans: `shrink` (a cluster plan scaled down to one machine) and `generate --from`
(a partial plan completed in place by the search); and `diff`, two plans compared (what changed, and the
cost model's prediction for both)."""
