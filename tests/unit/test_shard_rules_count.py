"""The count places parameters as the plan's shard rules do (`ir.shard_rules.ruled_layers`): the cases a review of the
first version found wrong (the dry run's built states against the estimate: tests/distributed/
test_dry_run_matches_estimate.py)."""
from __future__ import annotations

import pytest

from plandsl import api
from plandsl.cost.memory import tied_embedding
from plandsl.ir.layers import TENSOR_SHARDED_DIMS, figures_key, layers_of
from plandsl.ir.placement import assign_stages
from plandsl.ir.shard_rules import rule_problems, ruled_layers

PLAN = """import "clusters/dgx_h100"
plan p {{
  model   = {model}
  cluster = dgx_h100
  mesh    = [dp = 2, tp = 4]
  train   = {{ global_batch: 16, micro_batch: 2 }}
  data    = zero1 over dp
  tensor  = megatron over tp
{rules}
}}
"""
LLAMA = "llama(layers=4, hidden=512, heads=8, seq=256, vocab=8192{extra})"
MLA = ", q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64"


def _plan(rules: str, extra: str = ""):
    return api.select_plan(api.loads(PLAN.format(model=LLAMA.format(extra=extra), rules=rules), path="p.plan"))


@pytest.mark.parametrize("rule, extra", [("layers.*.attn.wq_a = colwise over tp", MLA),
                                         ("layers.*.attn.wkv_a = rowwise over tp", MLA),
                                         ("mtp.*.eh_proj = colwise over tp", ", mtp=1")])
def test_a_rule_that_splits_a_linear_run_keeps_whole_is_refused(rule, extra):
    """`apply_tp` places no style on MLA's down-projections nor MTP's projection: a rule splitting them would be
    counted split and built whole, so `run` refuses it (E705) and the count keeps them whole."""
    plan = _plan(f"  shard {rule}", extra)
    assert any("keeps it whole on every rank" in problem for _, problem in rule_problems(plan))
    assert ruled_layers(plan, layers_of(plan.model)) == layers_of(plan.model)
    assert not rule_problems(_plan(f"  shard {rule.split('=')[0]}= replicate", extra))


@pytest.mark.parametrize("rule, extra", [("layers.*.attn.q_norm", MLA), ("mtp.*.enorm", ", mtp=1")])
def test_every_norm_takes_replicate_or_sequence_only(rule, extra):
    assert any("a norm's parameters stay whole" in problem
               for _, problem in rule_problems(_plan(f"  shard {rule} = colwise over tp", extra)))


@pytest.mark.parametrize("rule, split", [("", True), ("  shard layers.*.attn.wq = replicate", False),
                                         ("  shard layers.*.attn.wk = replicate", False),
                                         ("  shard layers.*.attn.wo = replicate", False),
                                         ("  shard layers.*.attn.wq = colwise over tp", True),
                                         ("  shard layers.*.attn = rowwise over tp", False)])
def test_attention_sinks_split_as_an_intact_pair_splits_the_heads(rule, split):
    """`_block_tp` splits the sinks, one logit per head, only where the attention pair is intact; a rule that breaks
    it (`wk` or `wo` replicated too, with `wq` colwise) runs every head on every rank, and split sinks there stopped
    `run` at its first forward ("shape '[1, 4, 1, 1]' is invalid for input of size 2")."""
    plan = _plan(rule, ", sinks=true")
    layers, _ = assign_stages(plan)
    sinks = [p for layer in layers.stage_layers[0] for p in layer.params if p.name.endswith(".attn.sinks")]
    assert sinks and all(any(role in TENSOR_SHARDED_DIMS for role in p.dims) == split for p in sinks)


def test_multi_token_predictions_copy_of_a_ruled_embedding_is_found_by_name():
    """The head's stage keeps a copy of the embedding for MTP's depths; a rule that moves the embedding's split off the
    vocabulary (its role) must not lose the copy (the count held 53.5 MiB of the 117.5 built on a pipeline's last
    rank)."""
    plan = _plan("  shard embed.tok = replicate", ", mtp=1")
    ruled = ruled_layers(plan, layers_of(plan.model))
    copy = tied_embedding(plan, ruled)
    assert copy is not None and copy.module == "embed.tok" and not any(r in TENSOR_SHARDED_DIMS for r in copy.dims)


def test_blocks_placed_alike_share_their_figures():
    """Ruled blocks keep one template per placement, so a 20,000-block model's figures are computed once per kind."""
    plan = _plan("  shard layers[0:2].mlp = replicate")
    layers = [layer for layer in ruled_layers(plan, layers_of(plan.model)) if layer.kind == "block"]
    keys = [figures_key(layer) for layer in layers]
    assert keys[0] == keys[1] != keys[2] == keys[3]
    assert ruled_layers(plan, layers_of(plan.model)) is ruled_layers(plan, layers_of(plan.model))  # memoised
