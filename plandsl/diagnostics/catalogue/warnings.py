"""W: warnings, a valid plan that is probably not what was meant.

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import GPT, Family

FAMILY = Family("W")
_entry = FAMILY.add


_entry("W201", """
    A `param` or `let` of the file is never used. Usually a leftover from an edit, or a
    sign that a plan refers to a literal where it meant the parameter, so that
    `--param` overrides do nothing. Only reported when the file has no errors.
    """, f"""
    import "clusters/dgx_a100"
    param batch = 32
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Use the parameter (or remove it).", ("global_batch: 16", "global_batch: batch"))

_entry("W202", """
    `top_k` says how many experts each token is routed to in a mixture of experts. A llama
    without `experts` is dense: every token goes through the one MLP of each block, and `top_k`
    changes nothing in the model, its cost or its memory. Usually `experts=` was forgotten,
    or the argument was copied from a MoE model.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=4, hidden=256, heads=8, seq=128, vocab=1024, top_k=2)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1 }
    }
    """, "Remove `top_k` (or add `experts=8` to make it a mixture of experts).", (", top_k=2)", ")"))

_entry("W203", """
    A sliding window lets each query attend to itself and the `window - 1` keys before it. With a
    window as long as the sequence trained on, or longer, every key before a query is inside it:
    the blocks attend as full causal attention does, compute and memory alike, and the window
    says nothing. Usually the model was written for a longer context than the plan trains on
    (Mistral 7B's 4,096-token window beside its 8,192 positions).
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=4, hidden=256, heads=8, seq=1024, vocab=1024, window=1024)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1 }
    }
    """, "Band the attention with a window shorter than the sequence.", ("window=1024", "window=256"))

_entry("W301", """
    The mesh covers fewer devices than the cluster has; the others stay idle for the
    whole run. Fine for a quick test, but on a reserved cluster it is paid-for
    hardware doing nothing.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Grow an axis to use every device.", ("dp = 2, tp", "dp = 4, tp"))

_entry("W302", """
    Tensor parallelism all-reduces activations twice per layer, forward and backward,
    so its axis should stay inside one node, on NVLink. Ranks are laid out with the
    last mesh axis innermost (contiguous devices); a tensor axis placed outer, or
    larger than a node, puts those all-reduces on the inter-node fabric, typically 10x
    slower.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 2
      mesh    = [tp = 4, dp = 4]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Make the tensor axis the last (innermost) one.", ("[tp = 4, dp = 4]", "[dp = 4, tp = 4]"))
