"""One memory model, activations: what a block of `plandsl run` saves for its backward is what the memory model counts
for it (`cost.memory._layer_activations`), measured by autograd's saved-tensors hooks (the ones `offload_layers`
installs, `runtime.parallel.offload`) on the first block of one microbatch: the storages of the tensors it saves, each
once, parameters (and views of them) excluded, fp32 so that no autocast copy of a weight is among them.

Under sequence parallelism `plandsl run` splits a block as torch's DTensor styles do (`PrepareModuleInput` gathers
the attention's and the MLP's input, `ColwiseParallel` linears save that gathered input): the count of
`implementation = torch`, the tensor line's default, and not Megatron-LM's (its shards), which would miss a third of
it at tp = 4 (`cost.memory._gathered_terms`)."""
from __future__ import annotations

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.ranks import RANK_TIMEOUT_S, load

pytestmark = pytest.mark.dist

HIDDEN, SEQ, MICRO = 256, 64, 2
MODEL = f"llama(layers=2, hidden={HIDDEN}, heads=8, kv_heads=4, ffn=512, seq={SEQ}, vocab=512)"


def _plan(mesh: str, size: int, line: str, batch: int) -> str:
    return ('import "clusters/local"\n'
            f"plan p {{\n  model = {MODEL}\n  cluster = localhost\n  mesh = {mesh} over devices[0:{size}]\n"
            f"  train = {{ global_batch: {batch}, micro_batch: {MICRO}, precision: fp32, lr: 1e-3, seed: 0, "
            f"offload_layers: 1 }}\n  {line}\n}}\n")


def _saved(rank: int, text: str) -> int:
    """Bytes the first block's forward saved on this rank: its offload hook's tensors, each storage once."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    from plandsl.runtime.parallel import offload
    from plandsl.runtime.train import RunConfig, run

    storages: dict[int, int] = {}
    kept: list[torch.Tensor] = []  # held, so that no freed storage's address is taken by a later one
    pack = offload.Offload.pack

    def counting(self, tensor):
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if not isinstance(tensor, nn.Parameter) and type(local) is torch.Tensor and local.numel():
            kept.append(local)
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return pack(self, tensor)

    offload.Offload.pack = counting
    status, job = run(load(text), RunConfig(steps=1, quiet=True, timeout_s=RANK_TIMEOUT_S))
    assert status == 0
    weights = set()
    for part in job.parts:
        for param in part.parameters():
            local = param._local_tensor if isinstance(param, DTensor) else param
            weights.add(local.untyped_storage().data_ptr())
    return sum(size for pointer, size in storages.items() if pointer not in weights)


def _counted(text: str) -> float:
    from plandsl.cost.memory import _layer_activations
    from plandsl.ir.layers import layers_of
    plan = load(text)
    block = next(layer for layer in layers_of(plan.model) if layer.kind == "block")
    return _layer_activations(plan, block, plan.train.recompute, False)


@pytest.mark.parametrize("mesh, size, line, batch, low, high", [
    # one microbatch a rank each: dp 2 runs 2 x 2 sequences, tp 4 one of 2
    ("[dp = 2]", 2, "data = replicate over dp", 2 * MICRO, 0.98, 1.03),
    ("[tp = 4]", 4, "tensor = megatron over tp with sequence_parallel", MICRO, 0.95, 1.02),
    # without sequence parallelism the count is 14 % above what the run saves (Korthikanti's terms for the llama
    # block; not read further), a bound that holds it there
    ("[tp = 4]", 4, "tensor = megatron over tp", MICRO, 0.83, 0.90),
])
def test_a_blocks_saved_bytes_are_what_the_memory_model_counts(mesh, size, line, batch, low, high):
    text = _plan(mesh, size, line, batch)
    measured = run_ranks(size, _saved, text, deadline_s=100)
    counted = _counted(text)
    assert all(m == measured[0] for m in measured), measured  # every tensor rank saves the same
    assert low <= measured[0] / counted <= high, (measured[0], counted)


def test_megatron_lms_count_misses_the_gathered_inputs_plandsl_run_saves():
    """The same run counted as Megatron-LM's tensor parallelism (`implementation = megatron`: shards saved) is a
    third short: the difference is the two gathered inputs' 3/4 that the shards leave out."""
    torch_line = "tensor = megatron over tp with sequence_parallel"
    text = _plan("[tp = 4]", 4, torch_line, MICRO)
    megatron = _counted(_plan("[tp = 4]", 4, torch_line + ", implementation = megatron", MICRO))
    counted = _counted(text)
    tokens = MICRO * SEQ
    assert counted - megatron == pytest.approx(4 * tokens * HIDDEN * 4 * (1 - 1 / 4) / 2)  # fp32: 2x the 16-bit bytes
    measured = run_ranks(4, _saved, text, deadline_s=100)[0]
    assert measured / megatron > 1.35


def test_an_mla_blocks_latents_are_saved_whole_under_torchs_sequence_parallelism(monkeypatch):
    """MLA's down-projections stay whole on every rank, on the gathered input (`tensor_parallel.PAIRS`): their latents
    are saved whole, not on sequence shards (`cost.memory._gathered_terms`). Counted 1/t, the run saved 1.38 of the
    count at tp = 4; whole, 1.04 (at tp = 1 the MLA block saves 1.12 of its count, not read further)."""
    monkeypatch.setattr(__import__(__name__, fromlist=["MODEL"]), "MODEL",
                        f"llama(layers=2, hidden={HIDDEN}, heads=8, ffn=512, seq={SEQ}, vocab=512, q_lora_rank=192, "
                        "kv_lora_rank=128, qk_rope_head_dim=16)")
    text = _plan("[tp = 4]", 4, "tensor = megatron over tp with sequence_parallel", MICRO)
    measured = run_ranks(4, _saved, text, deadline_s=100)
    assert all(m == measured[0] for m in measured), measured
    assert 1.0 <= measured[0] / _counted(text) <= 1.08, (measured[0], _counted(text))
