"""Which of the interpreter's torch imports this torch has: every plandsl.runtime module, and the torch
names the runtime imports lazily (only for some plans). `python3 bench/gpu/probe.py`; exit 1 if any fails."""
import importlib
import pkgutil
import sys

import torch

import plandsl.runtime

LAZY = [  # (module, names) the runtime imports inside functions
    ("torch.distributed._composable.replicate_with_fsdp", ["replicate"]),
    ("torch.distributed.tensor.experimental._context_parallel", ["_attention"]),
    ("torch.distributed.tensor", ["_redistribute"]),
    ("torch.distributed.tensor.debug", ["_clear_sharding_prop_cache"]),
    ("torch.distributed.pipelining.schedules", ["PipelineScheduleSingle", "_Action", "_PipelineScheduleRuntime"]),
    ("torch.distributed.pipelining", ["SplitPoint", "pipeline", "PipelineStage"]),
    ("torch.testing._internal.distributed.fake_pg", ["FakeStore"]),
    ("torch.distributed._functional_collectives", ["all_gather_tensor_autograd", "all_to_all_single_autograd"]),
]

failed = 0
print("torch", torch.__version__)
for info in pkgutil.walk_packages(plandsl.runtime.__path__, "plandsl.runtime."):
    try:
        importlib.import_module(info.name)
    except Exception as error:  # noqa: BLE001 - a probe: report and go on
        failed += 1
        print(f"FAIL import {info.name}: {type(error).__name__}: {error}")
for module, names in LAZY:
    try:
        loaded = importlib.import_module(module)
        missing = [name for name in names if not hasattr(loaded, name)]
    except Exception as error:  # noqa: BLE001
        missing = [f"(module: {type(error).__name__}: {error})"]
    failed += bool(missing)
    print(("FAIL " if missing else "ok   ") + module + (f": missing {missing}" if missing else ""))
sys.exit(1 if failed else 0)
