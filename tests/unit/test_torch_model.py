"""`runtime.torch_model`: a user's module behind the trainer's calling convention, on one process. The
distributed runs (Hugging Face models split, sharded and pipelined) are tests/distributed/test_torch_models.py."""
from __future__ import annotations

import importlib.util
import os

import pytest

from plandsl import ir
from tests.support import lazy

torch = lazy("torch")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.syspath_prepend(HERE)
    from plandsl.runtime.torch_model import build
    model = ir.CustomModel(kind="custom", name="tiny", layers=(ir.CustomLayer(name="embed", params=0, flops=0,
                           activations=0, output=0),), source="inspect_models.tiny:build(depth=3, width=16)",
                           block_list="layers")
    return build(model, seed=0)


def test_the_modules_own_names_and_values_from_the_seed(tiny, monkeypatch):
    import inspect_models.tiny as module
    torch.manual_seed(0)
    direct = module.build(depth=3, width=16)
    assert [name for name, _ in tiny.named_parameters()] == [name for name, _ in direct.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), direct.parameters()))
    assert tiny.out.weight is tiny.tok.weight  # the tie survives: the wrapper's children are the module's
    assert tiny.vocab == 100 and tiny.training and tiny.inner.training


def test_batches_and_loss_of_a_token_model(tiny):
    inputs, targets = tiny.make_batch(4, 8, torch.Generator().manual_seed(1))
    assert inputs.shape == targets.shape == (4, 8) and torch.equal(inputs[:, 1:], targets[:, :-1])
    logits = tiny(inputs)
    assert logits.shape == (4, 8, 100)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert torch.allclose(tiny.loss(logits, targets), expected)


def test_blocks_are_the_block_list_and_recomputation_wraps_each(tiny):
    from plandsl.runtime.equivalence import clean_name
    from plandsl.runtime.parallel.recompute import apply_ac
    from plandsl.runtime.torch_model import blocks
    container, names = blocks(tiny)
    assert container is tiny.layers and names == ["0", "1", "2"]
    before = [name for name, _ in tiny.named_parameters()]
    apply_ac(tiny, ir.Recompute.full)
    wrapped = [type(block).__name__ for block in tiny.layers]
    assert wrapped == ["CheckpointWrapper"] * 3
    assert [clean_name(name) for name, _ in tiny.named_parameters()] == before
    inputs, targets = tiny.make_batch(2, 8, torch.Generator().manual_seed(1))
    tiny.loss(tiny(inputs), targets).backward()  # the wrapped blocks still run inside the module's own forward
    assert all(p.grad is not None for p in tiny.parameters())


@pytest.mark.parametrize("mode", ["full", "selective_op"])
def test_recomputation_leaves_batch_norm_statistics_as_one_forward_does(monkeypatch, mode):
    """A recomputed block reruns its BatchNorms in training mode: their running mean, variance and batch count are
    put back after it, so two steps with recomputation end with the buffers (and gradients) of two without (each
    BatchNorm counted 4 batches and moved its statistics twice as far)."""
    monkeypatch.syspath_prepend(HERE)
    from plandsl.runtime.equivalence import clean_name
    from plandsl.runtime.parallel.recompute import apply_ac
    from plandsl.runtime.torch_model import build
    blocks = tuple(f"layer{stage}.{index}" for stage in range(1, 5) for index in range(2))
    source = "inspect_models.resnet:resnet18(num_classes=10, width=8, input=image(3, 32, 32))"
    plain, recomputed = (build(ir.CustomModel(kind="custom", name="resnet", layers=(), source=source, blocks=blocks),
                               seed=0) for _ in range(2))
    apply_ac(recomputed, ir.Recompute(mode))
    assert type(recomputed.layer1[0]).__name__ == "CheckpointWrapper"
    for step in range(2):
        images, labels = plain.make_batch(4, 1, torch.Generator().manual_seed(step))
        for model in (plain, recomputed):
            model.zero_grad()
            model.loss(model(images), labels).backward()
    want = dict(plain.named_buffers())
    got = {clean_name(name): buffer for name, buffer in recomputed.named_buffers()}
    assert set(got) == set(want) and want["layer1.0.bn1.num_batches_tracked"] == 2
    assert [name for name in want if not torch.equal(got[name], want[name])] == []
    grads = {clean_name(name): p.grad for name, p in recomputed.named_parameters()}
    assert all(torch.allclose(grads[name], p.grad, atol=1e-6) for name, p in plain.named_parameters())


def test_recomputation_of_a_traced_stage_leaves_its_batch_norm_statistics_alone(monkeypatch):
    """A stage torch's pipeline frontend traced holds its BatchNorms' buffers in modules of its own kind (no
    BatchNorm2d left): the buffers a recomputation updated are put back all the same."""
    monkeypatch.syspath_prepend(HERE)
    from plandsl.runtime.parallel.recompute import apply_ac
    from plandsl.runtime.torch_model import build
    blocks = tuple(f"layer{stage}.{index}" for stage in range(1, 5) for index in range(2))
    model = build(ir.CustomModel(kind="custom", name="resnet", layers=(), blocks=blocks,
                                 source="inspect_models.resnet:resnet18(num_classes=10, width=8, input=image(3, 32, 32))"),
                  seed=0)
    images, _ = model.make_batch(2, 1, torch.Generator().manual_seed(1))
    stage = model.stage_modules([{"embed", *blocks[:4]}, {*blocks[4:], "head"}], [0], images)[0]
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in stage.modules())
    apply_ac(stage, ir.Recompute.full)
    stage(images).sum().backward()
    counts = {name: int(t) for name, t in stage.named_buffers() if name.endswith("num_batches_tracked")}
    assert len(counts) == 10 and set(counts.values()) == {1}, counts


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_stages_whose_trace_lifted_a_weight_to_an_input_are_refused_before_a_step(monkeypatch):
    """torchtitan's Llama 3 with its fused `wqkv`: torch.export lifts that weight to an input of each stage, which
    torch's pipeline frontend feeds nothing (every rank failed at its first step: "forward() missing 2 required
    positional arguments"); a table from before `plandsl inspect` knew gets a ModelError naming it."""
    monkeypatch.syspath_prepend(HERE)
    from plandsl.runtime.torch_model import ModelError, build
    blocks = tuple(f"layers.{index}" for index in range(4))
    model = build(ir.CustomModel(kind="custom", name="titan", layers=(), block_list="layers", blocks=blocks,
                                 source="inspect_models.titan:llama3(n_layers=4)"), seed=0)
    tokens, _ = model.make_batch(2, 16, torch.Generator().manual_seed(1))
    with pytest.raises(ModelError, match="lifted layers_0_attention_qkv_linear_wqkv_weight, "
                                         "layers_1_attention_qkv_linear_wqkv_weight to inputs of stage 0"):
        model.stage_modules([{"embed", *blocks[:2]}, {*blocks[2:], "head"}], [0, 1], tokens)


def test_traced_stages_hold_the_persistent_buffers_the_forward_never_touches(monkeypatch):
    """torch.export keeps only the state a forward reads or writes: a buffer none touches (a format version) was in no
    stage, so a checkpoint of the stages was refused by another layout ("holds a different model") and
    --check-equivalence failed naming it missing. Each stage holds those of its layers, under their FQNs."""
    monkeypatch.syspath_prepend(HERE)
    from plandsl.runtime.reference import persistent_buffers
    from plandsl.runtime.torch_model import build
    blocks = tuple(f"layers.{index}" for index in range(4))
    model = build(ir.CustomModel(kind="custom", name="odd", layers=(), block_list="layers", blocks=blocks,
                                 source="inspect_models.odd:build(depth=4, tagged=True)"), seed=0)
    tokens, _ = model.make_batch(2, 8, torch.Generator().manual_seed(1))
    stages = model.stage_modules([{"embed", *blocks[:2]}, {*blocks[2:], "head"}], [0, 1], tokens)
    held = [{name for name, _ in persistent_buffers(stage)} for stage in (stages[0], stages[1])]
    assert held == [{"version", "layers.0.version", "layers.1.version"}, {"layers.2.version", "layers.3.version"}]
    assert int(stages[1].get_buffer("layers.3.version")) == 1
    outputs = stages[1](stages[0](tokens))  # the stages still compute the module's forward
    assert torch.allclose(outputs, model(tokens), atol=1e-6)


def test_each_recomputation_of_a_split_backward_puts_the_buffers_back():
    """Zero-bubble schedules (zb_h1, zbv) take a stage's input gradients and its weight gradients in two backward
    passes (two graph tasks): checkpoint reruns the block once for each, entering the recomputation context twice
    (its single-use context raised AttributeError at the weight pass, every rank failing at its first W action);
    the BatchNorm counts one batch and the gradients are one backward's."""
    from torch import nn
    from plandsl.runtime.parallel.recompute import _wrap

    def block():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4))

    plain, wrapped = block(), block()
    recomputed = _wrap(wrapped)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    grads = {}
    for name, model, module in (("plain", plain, plain), ("recomputed", recomputed, wrapped)):
        inputs = x.clone().requires_grad_()
        y = model(inputs).sum()
        (grads[name, "input"],) = torch.autograd.grad(y, (inputs,), retain_graph=True)  # I, then W
        grads[name, "weights"] = torch.autograd.grad(y, tuple(module.parameters()))
    assert int(wrapped[1].num_batches_tracked) == 1
    assert torch.equal(wrapped[1].running_mean, plain[1].running_mean)
    assert torch.allclose(grads["recomputed", "input"], grads["plain", "input"], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads["recomputed", "weights"], grads["plain", "weights"]))


@pytest.mark.parametrize("kind", ["rebound", "non_persistent", "in_place"])
def test_recomputation_puts_back_a_counter_however_the_forward_changes_it(kind):
    """A forward that counts its calls in a buffer: by rebinding it (`self.calls = self.calls + 1`: the tensor put
    back before was no longer the buffer), in place in a non-persistent buffer (left out before) or in place; each
    counts one call per forward with recomputation too. A constant non-persistent table is not copied at each rerun."""
    from torch import nn
    from plandsl.runtime.parallel import recompute

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(()), persistent=kind != "non_persistent")
            self.register_buffer("table", torch.arange(4.0), persistent=False)

        def forward(self, x):
            if kind == "rebound":
                self.calls = self.calls + 1
            else:
                self.calls.add_(1)
            return torch.relu(self.linear(x) + self.table)

    module = Counting()
    wrapped = recompute._wrap(module)
    for _ in range(2):
        wrapped(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert float(module.calls) == 2
    watch, _ = recompute.state_kept(module)()
    with watch:
        module(torch.ones(1, 4))
    assert [entry.name for entry in recompute._kept(module, watch.changed)] == ["calls"]


def test_a_factory_module_is_split_into_stages_by_tracing(monkeypatch):
    """torch's pipeline frontend cuts the module at the stages' first blocks; the stages keep the module's
    names and, run one after the other, compute what the whole module computes."""
    monkeypatch.syspath_prepend(HERE)
    from plandsl.runtime.torch_model import build
    model = build(ir.CustomModel(kind="custom", name="tiny", layers=(), block_list="layers",
                                 source="inspect_models.tiny:build(depth=4, width=16, tied=False)"), seed=0)
    stages = [{"embed", "layers.0"}, {"layers.1", "layers.2"}, {"layers.3", "head"}]
    inputs, _ = model.make_batch(2, 8, torch.Generator().manual_seed(1))
    parts = model.stage_modules(stages, [0, 1, 2], inputs)
    names = [[name for name, _ in parts[index].named_parameters()] for index in range(3)]
    assert names[0] == ["tok.weight"] + [f"layers.0.{n}" for n, _ in model.layers[0].named_parameters()]
    assert names[2][-1] == "out.weight" and all(name.startswith(("layers.3.", "out.")) for name in names[2])
    assert (parts[0].first, parts[0].last, parts[2].first, parts[2].last) == (True, False, False, True)
    hidden = parts[1](parts[0](inputs))
    assert torch.allclose(parts[2](hidden), model(inputs), atol=1e-6)
    assert all(p.data_ptr() != q.data_ptr() for p in parts[0].parameters() for q in model.parameters())  # copies
