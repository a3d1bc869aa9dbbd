"""`head_dim` on llama: a width per head apart from hidden / heads (Qwen3: hidden 2048, 32 heads of 128; GPT-OSS:
hidden 2880, 64 heads of 64), Megatron-LM's --kv-channels. wq and wo are heads x head_dim wide, wk and wv
kv_heads x head_dim; the FLOPs, the parameters, the attention core and the activations follow."""
from __future__ import annotations

import pytest

from plandsl import api, ir
from plandsl.interop import export_plan, import_text
from plandsl.ir.layers import layers_of, param_count, transformer_block_flops
from plandsl.syntax.loader import stdlib_root
from tests.support import lazy

torch = lazy("torch")

PLAN = """\
import "clusters/dgx_h100"
plan p {{
  model    = llama(layers=4, hidden=2048, heads=32, kv_heads=4, seq=4096, vocab=151936, ffn=768, experts=128,
                   top_k=8{head_dim})
  cluster  = dgx_h100
  mesh     = [ep = 8]
  train    = {{ global_batch: 16, micro_batch: 1 }}
  experts  = alltoall over ep
}}
"""


def _plan(head_dim: str = ", head_dim=128") -> ir.Plan:
    return api.loads(PLAN.format(head_dim=head_dim)).plans[0]


def test_the_attention_is_heads_times_head_dim_wide():
    """Qwen3-30B-A3B's attention, counted by hand: wq 2048 -> 32 x 128, wk and wv 2048 -> 4 x 128, wo back."""
    model = _plan().model
    block = next(layer for layer in layers_of(model) if layer.kind == "block")
    shapes = {p.name.rpartition(".attn.")[2]: p.shape for p in block.params if ".attn." in p.name}
    assert shapes == {"wq.weight": (4096, 2048), "wk.weight": (512, 2048), "wv.weight": (512, 2048),
                      "wo.weight": (2048, 4096)}
    # per token: projections 2·(4096 + 512 + 512)·2048 + 2·2048·4096, the core 2·s·(4096 + 4096), the router
    # 2·2048·128 and top_k experts of three 2048 x 768 GEMMs
    expected = 2 * (4096 + 1024) * 2048 + 2 * 2048 * 4096 + 2 * 4096 * 8192 + 2 * 2048 * 128 + 8 * 6 * 2048 * 768
    assert transformer_block_flops(model) == expected
    default = _plan("").model  # hidden / heads = 64
    assert transformer_block_flops(default) < expected


def _codes(text: str) -> list[str]:
    return [d.code for d in api.checks(text).diagnostics]


def test_checked_even_and_refused_under_latent_attention():
    assert _codes(PLAN.format(head_dim=", head_dim=128")) == []
    assert _codes(PLAN.format(head_dim=", head_dim=127")) == ["E222"]
    # hidden need not divide by heads when head_dim is given (GPT-OSS: 2880 / 64 heads of 64)
    assert _codes(PLAN.format(head_dim=", head_dim=64").replace("hidden=2048, heads=32", "hidden=2880, heads=64")
                  .replace("kv_heads=4", "kv_heads=8")) == []
    assert _codes(PLAN.format(head_dim="").replace("hidden=2048, heads=32", "hidden=2880, heads=64")
                  .replace("kv_heads=4", "kv_heads=8")) == ["E222"]  # 2880 / 64 = 45
    assert "E226" in _codes(PLAN.format(head_dim=", head_dim=128, kv_lora_rank=512").replace("kv_heads=4, ", ""))


def test_megatron_export_and_import_carry_kv_channels():
    exported = export_plan(_plan(), "megatron")
    assert "--kv-channels 128" in exported.text
    assert "--kv-channels" not in export_plan(_plan(""), "megatron").text
    imported = import_text("megatron", exported.text, "plan.args", world_size=8)
    assert imported.ok and "head_dim=128" in imported.text


@pytest.mark.xdist_group("torch")
def test_the_interpreter_builds_those_widths():
    from plandsl.runtime.models import Attention
    attention = Attention(2048, 32, 4, bias=False, rope=True, head_dim=128)
    assert attention.wq.weight.shape == (4096, 2048) and attention.wo.weight.shape == (2048, 4096)
    x = torch.randn(2, 8, 2048)
    assert attention(x).shape == (2, 8, 2048)


@pytest.mark.parametrize(("path", "name", "total", "active"), [
    ("models/qwen3.plan", "qwen3_30b_a3b", 30.5e9, 3.3e9), ("models/qwen3.plan", "qwen3_235b_a22b", 235e9, 22e9),
    ("models/gpt_oss.plan", "gpt_oss_120b", 116.8e9, 5.1e9), ("models/gpt_oss.plan", "gpt_oss_20b", 20.9e9, 3.6e9)])
def test_stdlib_moe_models_have_their_published_sizes(path, name, total, active):
    """The stdlib's Qwen3 and gpt-oss mixtures (head_dim apart from hidden / heads) hold the parameters their
    reports give, within 2 %: all of them, and those a token runs through (top_k of the experts; gpt-oss counts
    its active ones without the embedding's table, Qwen3 with it)."""
    model = next(m for m in api.load(str(stdlib_root() / path)).models if m.name == name)
    counted = param_count(model)
    experts = sum(p.numel for layer in layers_of(model) for p in layer.params if ".experts." in p.name)
    embedding = model.vocab * model.hidden if name.startswith("gpt_oss") else 0
    assert counted == pytest.approx(total, rel=0.02)
    assert counted - experts + experts * model.top_k / model.experts - embedding == pytest.approx(active, rel=0.02)


def test_plans_without_the_new_keys_dump_and_hash_as_before():
    """Checkpoints name a plan by the sha256 of its JSON dump (`runtime.checkpoint.plan_hash`): a plan that writes
    no `head_dim` and no `with overlap` dumps without them (as before the keys existed); one that writes them
    dumps them."""
    plain = _plan("")
    assert "head_dim" not in plain.model.model_dump() and "overlap" not in plain.experts.model_dump()
    assert '"head_dim"' not in plain.model_dump_json() and '"overlap"' not in plain.model_dump_json()
    assert _plan().model.model_dump()["head_dim"] == 128
    overlapped = api.loads(PLAN.format(head_dim="").replace("over ep", "over ep with overlap")).plans[0]
    assert overlapped.experts.model_dump()["overlap"] is True
    assert ir.Plan.model_validate_json(plain.model_dump_json()).model_dump() == plain.model_dump()
