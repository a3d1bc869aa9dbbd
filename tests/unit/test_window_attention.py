"""`plandsl run`'s banded attention and sinks (`runtime.models.attend`) against a hand-written reference and against
transformers' GPT-OSS and Mistral attention (their eager cores under transformers' own sliding-window mask), and the
block pattern against transformers' `layer_types` for GPT-OSS and Gemma 3; tiny configs, nothing downloaded."""
from __future__ import annotations

import math

import pytest

from tests.support import lazy

torch = lazy("torch")

_SHAPE = dict(batch=2, heads=4, kv_heads=2, seq=12, dim=8)


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    b, h, kv, s, d = (_SHAPE[k] for k in ("batch", "heads", "kv_heads", "seq", "dim"))
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return make(b, h, s, d), make(b, kv, s, d), make(b, kv, s, d), make(h)


def _reference(q, k, v, sinks, window):
    """softmax over [q kᵀ/√d masked to keys i - window < j <= i, sink] with the sink's share dropped, times v."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2])
    allowed = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)), dim=-1)
    probs = scores.softmax(-1)
    return (probs[..., :-1] if sinks is not None else probs) @ v


@pytest.mark.parametrize("window, with_sinks", [(0, True), (3, False), (3, True), (1, True)])
def test_banded_attention_with_sinks_is_the_reference_forward_and_backward(window, with_sinks):
    from plandsl.runtime.models import AttentionCore
    q, k, v, sinks = _inputs()
    core = AttentionCore(window)
    out = core(q, k, v, sinks) if with_sinks else core(q, k, v)
    expected = _reference(q, k, v, sinks if with_sinks else None, window)
    assert torch.allclose(out, expected, atol=1e-12)
    grad = torch.randn_like(out)
    inputs = (q, k, v, sinks) if with_sinks else (q, k, v)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        assert torch.allclose(got, want, atol=1e-12)


def _hf_mask(window: int, seq: int):
    from transformers.masking_utils import sliding_window_causal_mask_function
    mask = sliding_window_causal_mask_function(window)
    i = torch.arange(seq)
    allowed = mask(0, 0, i[:, None], i[None, :])
    return torch.zeros(seq, seq, dtype=torch.float64).masked_fill(~allowed, float("-inf"))[None, None]


@pytest.mark.parametrize("family", ["gpt_oss", "mistral"])
def test_the_core_is_transformers_eager_attention_under_its_sliding_window_mask(family):
    import importlib
    from torch import nn
    from plandsl.runtime.models import AttentionCore
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    q, k, v, sinks = _inputs(1)
    window = 4
    module = nn.Module()
    module.num_key_value_groups, module.training = q.shape[1] // k.shape[1], False
    if family == "gpt_oss":
        module.sinks = sinks
    expected, _ = modeling.eager_attention_forward(module, q, k, v, _hf_mask(window, q.shape[2]),
                                                   scaling=q.shape[-1] ** -0.5)
    out = AttentionCore(window)(q, k, v, sinks) if family == "gpt_oss" else AttentionCore(window)(q, k, v)
    tolerance = 1e-12 if family == "gpt_oss" else 1e-6  # Mistral's eager softmax runs in fp32
    assert torch.allclose(out.transpose(1, 2), expected, atol=tolerance)


def test_full_every_is_transformers_layer_types():
    from transformers import Gemma3TextConfig, GptOssConfig
    from plandsl import api
    for config, window, every, layers in ((GptOssConfig(num_hidden_layers=6), 128, 2, 6),
                                          (Gemma3TextConfig(num_hidden_layers=14), 512, 6, 14)):
        model = api.loads(f"model m = llama(layers={layers}, hidden=64, heads=4, seq=1024, vocab=256, "
                          f"window={window}, full_every={every})").models[0]
        assert ["sliding_attention" if model.window_of(i) else "full_attention" for i in range(layers)] == \
            list(config.layer_types)
