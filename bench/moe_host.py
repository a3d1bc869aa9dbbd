"""Counts the ATen ops megatron-core's real `MoELayer` issues forward and backward, and times them, on CPU (run by
tests/unit/test_moe_host.py in a process of its own: megatron-core keeps its parallel state in globals).

`python bench/moe_host.py 2 4 8` prints, per number of experts, the forward and backward op counts and
the fastest forward + backward wall time of 200 runs on one thread: `cost.compute.HOST_SECONDS_PER_OP` is the slope
of that time over the op count. CUDA-only calls the alltoall dispatcher makes (its device-to-host stream, events, the
router's move of its weight to the current device, Transformer Engine's router GEMM) are replaced by no-ops or
torch's own; the ops counted are the layer's, views excluded."""
import contextlib
import json
import os
import sys
import tempfile
import time


def _cpu_only_cuda(torch):
    class Stream:
        def wait_stream(self, *args):
            pass

        def synchronize(self):
            pass

        def record_event(self, *args):
            return Event()

    class Event:
        def record(self, *args):
            pass

        def synchronize(self):
            pass

        def wait(self, *args):
            pass

    torch.cuda.Stream = lambda *args, **kwargs: Stream()
    torch.cuda.current_stream = lambda *args, **kwargs: Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.Event = lambda *args, **kwargs: Event()
    torch.cuda.current_device = lambda: "cpu"


def count(expert_counts, runs=200):
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    _cpu_only_cuda(torch)
    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="moe_host_")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig
    moe_utils.te_general_gemm = None  # Transformer Engine's GEMM for the router: torch's on CPU

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops += not func.is_view
            return out

    def once(layer, x):
        out = layer(x)
        return out[0] if isinstance(out, tuple) else out

    results = {}
    for experts in expert_counts:
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=experts,
                                   moe_router_topk=2, moe_ffn_hidden_size=32, gated_linear_unit=True,
                                   activation_func=torch.nn.functional.silu, moe_token_dispatcher_type="alltoall",
                                   moe_router_load_balancing_type="none", add_bias_linear=False,
                                   use_cpu_initialization=True, params_dtype=torch.float32, moe_grouped_gemm=False)
        spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
        layer = MoELayer(config, spec.submodules.mlp.submodules)
        x = torch.randn(16, 1, 64, requires_grad=True)
        once(layer, x).sum().backward()  # warm-up
        with Count() as forward:
            out = once(layer, x)
        loss = out.sum()
        with Count() as backward:
            loss.backward()
        fastest = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            once(layer, x).sum().backward()
            fastest = min(fastest, time.perf_counter() - start)
        results[experts] = {"forward": forward.ops, "backward": backward.ops, "seconds": fastest}
    dist.destroy_process_group()
    os.unlink(store) if os.path.exists(store) else None
    return results


if __name__ == "__main__":
    print(json.dumps(count([int(n) for n in sys.argv[1:] or (2, 4)], runs=int(os.environ.get("RUNS", "200")))))
