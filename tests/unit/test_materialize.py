"""A built-in family's model built on the meta device and materialized (`runtime.models.build_meta_model`,
`materialize`: what `plandsl run`'s ranks do, tests/distributed/test_meta_init.py over layouts) holds bit for bit the
values of the full model `build_model` gives from the same seed, in the plan's weights dtype, a tied head tied."""
from __future__ import annotations

import pytest

from tests.distributed.ranks import load
from tests.support import lazy

torch = lazy("torch")

_PLAN = """import "clusters/local"
import "local/tiny"
plan p {{
  model   = {model}
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = {train}
  data    = ddp over dp
}}
"""
_BF16 = "{ global_batch: 8, micro_batch: 2, precision: bf16, master_dtype: bf16, lr: 1e-3, seed: 7 }"


@pytest.mark.parametrize("model,train", [
    ("gpt(layers=2, hidden=32, heads=4, seq=16, vocab=128, tied=true)", "tiny_train"),
    ("llama(layers=4, hidden=32, heads=4, kv_heads=2, seq=16, vocab=128, ffn=64, mtp=2, experts=4, top_k=2, "
     "shared_experts=1, dense_layers=1, dense_ffn=48)", _BF16),
    ("mlp(layers=3, input=8, hidden=16, output=4)", "tiny_train"),
], ids=["gpt_tied", "llama_moe_mtp_bf16", "mlp"])
def test_materialized_meta_model_equals_build_model(model, train):
    from plandsl.runtime.models import build_meta_model, build_model, is_meta, materialize
    from plandsl.runtime.precision import keep_weights
    plan = load(_PLAN.format(model=model, train=train))
    meta = keep_weights(plan, build_meta_model(plan.model))
    assert is_meta(meta) and all(p.is_meta for p in meta.parameters())
    materialize(meta, plan.model, plan.train.seed, "cpu")
    full = keep_weights(plan, build_model(plan.model, plan.train.seed))
    assert not is_meta(meta)
    built = dict(meta.named_parameters(remove_duplicate=False))
    expected = dict(full.named_parameters(remove_duplicate=False))
    assert list(built) == list(expected)
    for name, param in expected.items():
        assert built[name].dtype == param.dtype and torch.equal(built[name], param), name
    if getattr(plan.model, "tied_embeddings", False):
        assert meta.head.weight is meta.embed.tok.weight


def test_models_from_torch_and_factories_are_not_built_on_meta():
    from plandsl import ir
    from plandsl.runtime.models import build_meta_model
    assert build_meta_model(ir.CustomModel.model_construct(name="m", factory="pkg.mod:f")) is None
