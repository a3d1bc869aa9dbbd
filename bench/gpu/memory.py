"""What a CUDA process holds outside torch's caching allocator, the part of a device's `reserve` that no
tensor accounts for: the CUDA context and cuBLAS's workspace after a first matmul, then NCCL's
communicator after a first all-reduce (one rank). `python3 bench/gpu/memory.py` (docs/cost-model.md)."""
import os

import torch
import torch.distributed as dist


def outside() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


torch.cuda.init()
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
(a @ a).sum().item()
context = outside()
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
x = torch.ones(1 << 20, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
nccl = outside() - context
print(f"outside the allocator: CUDA context + cuBLAS {context / 2**30:.2f} GiB, NCCL (1 rank) {nccl / 2**30:.2f} GiB; "
      f"device {torch.cuda.get_device_name(0)}, {torch.cuda.mem_get_info()[1] / 2**30:.1f} GiB")
dist.destroy_process_group()
