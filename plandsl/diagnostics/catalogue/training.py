"""E5xx: training and memory, the batch, the schedule's needs and the memory per device.

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import GPT, Family

FAMILY = Family("E5")
_entry = FAMILY.add


_entry("E501", """
    Each step, the global batch is split evenly over the data-parallel ranks (the
    data axes, and the expert axis), and each rank's share is cut into microbatches
    of `micro_batch` sequences. Every data-parallel rank must get the same whole
    number of microbatches, or the gradient all-reduce would average unequal
    batches, so global_batch must be a multiple of dp x micro_batch.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 4, tp = 2]
      train   = {{ global_batch: 30, micro_batch: 2 }}
    }}
    """, "Use a global batch that dp x micro_batch divides (here 24 or 32).", ("global_batch: 30", "global_batch: 32"))

_entry("E502", """
    A pipeline schedule cannot run every microbatch count: the zero-bubble schedules
    need at least one per pipeline rank, DualPipeV one per stage, chimera a multiple of
    the ranks, and torch's interleaved schedules (interleaved 1F1B, interleaved zero
    bubble) take them in max(1, m // pp) rounds, which must divide m (so 6 runs on 4
    ranks and 9 does not; a multiple of the ranks is not needed). The count m is
    global_batch / (dp x micro_batch); the hint names the nearest global batch that runs.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 4]
      train    = {{ global_batch: 4, micro_batch: 1 }}
      schedule = zb_h1
    }}
    """, "Raise the global batch (or lower micro_batch) so there are at least pp microbatches.",
       ("global_batch: 4", "global_batch: 8"))

_entry("E503", """
    The estimated peak memory of one device (parameters, gradients, optimizer states
    and activations, with the plan's sharding, pipeline split and schedule) exceeds
    the device's memory: the job would die with an out-of-memory error. The message
    breaks the total down; the hint says which part dominates and what shrinks it.
    Plain data parallelism keeps a full copy of the model states on every rank, about
    16 bytes per parameter with Adam in mixed precision. With `batch_shares` each data
    rank is counted on its own: its own microbatches in flight and, under ZeRO-2/3, every
    unit held gathered through the step, against its own devices; the message names the
    data rank, its share and its device.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = llama(layers=32, hidden=4096, heads=32, seq=4096, vocab=32000)
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 64, micro_batch: 1, recompute: full }
    }
    """, "Shard the model states over the data axis (ZeRO-3 / FSDP).",
       ("recompute: full }\n", "recompute: full }\n  data    = zero3 over dp\n"))

_entry("E504", """
    The plan trains in a precision the device has no peak throughput for, and usually
    no hardware support for either: a V100 has no bfloat16 units, a Hopper GPU (H100,
    H200) no MXFP8 or FP4 tensor cores (`mxfp8` and `nvfp4` need Blackwell; `fp8` runs
    on Hopper). `fp8`, `mxfp8` and `nvfp4` need the `bf16` peak too (the attention core, embedding and head stay
    16-bit). The cost model could not estimate the step, and the run would fall back
    to slow emulation or fail.
    """, """
    device v100 {
      memory    = 32 GiB
      bandwidth = 900 GB/s
      peak      = { fp32: 15.7 TFLOP/s, fp16: 125 TFLOP/s }
    }
    node dgx1 {
      devices = 8 x v100
      link    = { bandwidth: 150 GB/s, latency: 2 us }
    }
    plan p {
      model   = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
      cluster = dgx1 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1, precision: bf16 }
    }
    """, "Train in a precision the device supports (fp16 on a V100).", ("precision: bf16", "precision: fp16"))

_entry("E505", """
    Every count a plan writes has a cap far beyond today's largest runs (global_batch at
    most 2^32 sequences, micro_batch 2^20, seq 2^24 tokens, virtual 1,024 stages per rank,
    a model family's layers 100,000 and widths 2^20; the table is under Limits in
    docs/language.md). The caps keep the work of checking proportional to what was
    written, not to the numbers in it: a typo that adds six zeros is answered at once. Two
    numbers that are not counts are capped where `plandsl run` would fail on them: `seed`
    at 2^64 - 1 (torch's generators take 64 bits) and `lr` at 10,000 (torch's optimizers
    convert it, scaled, to the update's dtype, fp32 in `run`: Adam's first step raises past
    about 5e37, SGD's past fp32's 3.4e38). A model from torch is built with at most 200,000
    parameter tensors (`plandsl inspect`, `run`), so that its config's layer count cannot make
    the build unbounded.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 4]
      train    = {{ global_batch: 80000000000000, micro_batch: 1 }}
      schedule = 1f1b
    }}
    """, "Write the count the run needs; a global batch is thousands of sequences, not trillions.",
       ("global_batch: 80000000000000", "global_batch: 8"))

_entry("E506", """
    BatchNorm in training normalises each channel over the values a microbatch gives it: batch x height x
    width. Where a CNN's maps are smallest (a ResNet's last stage: 1 x 1 from a small image) one image per
    microbatch is one value per channel, whose variance torch refuses to divide by ("Expected more than 1
    value per channel when training"). `plandsl inspect` records the fewest values per channel per image
    any BatchNorm of the model sees (`norm_values`), and the microbatch must make it at least 2.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = hf("ResNetForImageClassification", layer_type="basic", num_labels=10, input=image(3, 8, 8))
      cluster = dgx_a100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 8, micro_batch: 1 }
    }
    """, "Give each microbatch two images or more.",
    ("global_batch: 8, micro_batch: 1", "global_batch: 16, micro_batch: 2"), inspect=True)

_MIXED = """
    device fast {
      memory = 80 GiB
      bandwidth = 3 TB/s
      peak = { bf16: 900 TFLOP/s }
    }
    device slow {
      memory = 80 GiB
      bandwidth = 2 TB/s
      peak = { bf16: 300 TFLOP/s }
    }
    node fast_node {
      devices = 8 x fast
      link    = { bandwidth: 300 GB/s, latency: 2 us }
      nic     = { bandwidth: 200 GB/s, latency: 5 us }
    }
    node slow_node {
      devices = 8 x slow
      link    = { bandwidth: 300 GB/s, latency: 2 us }
      nic     = { bandwidth: 200 GB/s, latency: 5 us }
    }
    cluster mixed {
      nodes = [fast_node x 1, slow_node x 1]
    }"""

_entry("E507", """
    `batch_shares` says how many sequences of the global batch each data rank trains on per
    step (faster replicas take more), one share per data rank in data-rank order: the
    batch axes' coordinates, outermost first. A list of another length leaves ranks
    without a share, or shares without a rank. `batch_shares: speed` derives them from the
    devices' peaks instead.
    """, f"""{_MIXED}
    plan p {{
      model   = {GPT}
      cluster = mixed
      mesh    = [dp = 2, tp = 8]
      train   = {{ global_batch: 64, micro_batch: 4, batch_shares: [48, 8, 8] }}
      data    = ddp over dp
      tensor  = megatron over tp
    }}
    """, "Give one share per data rank (dp = 2 here).", ("batch_shares: [48, 8, 8]", "batch_shares: [48, 16]"))

_entry("E508", """
    A step trains on the whole global batch, cut into the data ranks' shares, so the shares
    must add up to `global_batch`: fewer would silently train on a smaller batch than the
    plan says (and the learning rate was chosen for that batch), more would need sequences
    the step does not have.
    """, f"""{_MIXED}
    plan p {{
      model   = {GPT}
      cluster = mixed
      mesh    = [dp = 2, tp = 8]
      train   = {{ global_batch: 64, micro_batch: 4, batch_shares: [48, 32] }}
      data    = ddp over dp
      tensor  = megatron over tp
    }}
    """, "Make the shares sum to the global batch.", ("batch_shares: [48, 32]", "batch_shares: [48, 16]"))

_entry("E509", """
    Each data rank runs its share as whole microbatches of `micro_batch` sequences (a
    pipeline runs them through its schedule), and every rank runs at least one: a rank
    with no sequences would still join the gradient reduction, with nothing to add. So each
    share is a positive multiple of micro_batch; with `batch_shares: speed`, the global
    batch must be whole microbatches, at least one per data rank.
    """, f"""{_MIXED}
    plan p {{
      model   = {GPT}
      cluster = mixed
      mesh    = [dp = 2, tp = 8]
      train   = {{ global_batch: 64, micro_batch: 4, batch_shares: [50, 14] }}
      data    = ddp over dp
      tensor  = megatron over tp
    }}
    """, "Use multiples of micro_batch (here 4).", ("batch_shares: [50, 14]", "batch_shares: [48, 16]"))

_entry("E510", """
    `fp8_recipe` says how `precision: fp8` scales its tensors (Transformer Engine's delayed
    or current scaling, torchao's tensorwise dynamic scaling, blockwise scaling); another
    precision has no such choice: bf16, fp16 and fp32 quantize nothing, and `mxfp8` and
    `nvfp4` are block-scaling recipes of their own. Likewise `bf16_first_layers` and
    `bf16_last_layers` keep blocks in bf16 that a quantized precision (fp8, mxfp8, nvfp4)
    would run in FP8 or FP4; under bf16, fp16 or fp32 there is nothing to keep.
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=4, hidden=512, heads=8, kv_heads=8, seq=256, vocab=1024)
      cluster = dgx_h100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1, precision: bf16, fp8_recipe: current }
    }
    """, "Train in FP8 with that recipe, or drop the recipe.", ("precision: bf16", "precision: fp8"))

_entry("E511", """
    `data = ... with gather = fp8` all-gathers the weights of the linear layers that FP8
    training quantizes already cast to FP8, one byte per element with the recipe's
    scales (torchao's `enable_fsdp_float8_all_gather` for torchtitan's Float8,
    Megatron's `--fp8-param-gather`); the other parameters stay 16-bit. Only `precision:
    fp8` and `mxfp8` have such weights: under bf16, fp16 or fp32 nothing is cast to FP8,
    and `nvfp4`'s weights are FP4, which the language does not gather.
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=4, hidden=512, heads=8, kv_heads=8, seq=256, vocab=1024)
      cluster = dgx_h100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1, precision: bf16 }
      data    = fsdp over dp with gather = fp8
    }
    """, "Train in FP8, or gather the weights in bf16.", ("gather = fp8", "gather = bf16"))

_entry("E512", """
    `offload_layers: N` keeps the saved activations of each stage's first N blocks in
    host memory between their forward and their backward; recomputation keeps fewer of
    them to begin with and rebuilds the rest. The language does not combine the two:
    Megatron-LM's TransformerConfig refuses them together ("CPU offloading does not work
    when activation recomputation is enabled"), and which blocks would be offloaded and
    which recomputed is not a choice its recipes make. Offload, or recompute.
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=4, hidden=512, heads=8, kv_heads=8, seq=256, vocab=1024)
      cluster = dgx_h100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1, recompute: full, offload_layers: 2 }
      data    = fsdp over dp
    }
    """, "Keep the activations and offload them, without recomputation.", ("recompute: full", "recompute: none"))

_entry("E513", """
    Megatron-LM offloads activations to the CPU (Transformer Engine's offload handler,
    --cpu-offloading-num-layers) only without pipeline parallelism: megatron-core's
    TransformerConfig raises "Currently there is no support for Pipeline parallelism
    with CPU offloading". A plan whose stages run on Megatron-LM's pipeline (`stages =
    ... with implementation = megatron`) cannot offload; torch's pipeline stages can
    (`plandsl run` wraps their blocks in torch's save_on_cpu).
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=8, hidden=512, heads=8, kv_heads=8, seq=256, vocab=1024)
      cluster = dgx_h100 x 1
      mesh    = [pp = 2, dp = 4]
      train   = { global_batch: 32, micro_batch: 1, offload_layers: 2 }
      data    = replicate over dp
      stages  = evenly over pp with implementation = megatron
      schedule = 1f1b
    }
    """, "Run the stages on torch's pipeline, or offload nothing.",
    ("with implementation = megatron", "with implementation = torch"))

_entry("E514", """
    Offloaded activations do not vanish: they wait in the host's (CPU) memory until
    their backward, every microbatch in flight's, for every device of the machine.
    Where a node states `host_memory` (bytes per machine: a DGX H100's 2 TB, a GB200
    tray's two Grace CPUs' 960 GB), the checker counts what the plan's devices offload,
    each at the most any pipeline rank does, and refuses a plan that would need more.
    A node that does not state it is not checked. Offload fewer blocks, or make the
    microbatches smaller.
    """, """
    device gpu {
      memory    = 80 GB
      bandwidth = 2000 GB/s
      peak      = { bf16: 300 TFLOP/s }
    }
    node box {
      devices     = 8 x gpu
      link        = { bandwidth: 300 GB/s }
      host_memory = 8 GB
    }
    plan p {
      model   = llama(layers=8, hidden=2048, heads=16, kv_heads=8, seq=2048, vocab=32000)
      cluster = box x 1
      mesh    = [dp = 8]
      train   = { global_batch: 32, micro_batch: 4, offload_layers: 4 }
      data    = fsdp over dp
    }
    """, "Offload fewer blocks (or state the host's real memory).", ("offload_layers: 4", "offload_layers: 1"))

_entry("E515", """
    `data = ... with gather = DTYPE` names the dtype the parameters are all-gathered in.
    Under zero2, zero3 and hsdp that is FSDP2's `MixedPrecisionPolicy(param_dtype=...)`
    (torchtitan's `mixed_precision_param`), and the forward then computes with the
    gathered weights as they are: the dtype is the compute precision (or fp32, which
    autocast casts), so `gather = bf16` under `precision: fp32` would compute in bf16,
    and `gather = fp16` under bf16 in fp16. Under zero1 the optimizer's shards are
    all-gathered after each step as the weights are kept (torch's
    ZeroRedundancyOptimizer broadcasts them, Megatron-LM's distributed optimizer
    all-gathers its bf16 parameter buffer beside an fp32 master): 16-bit gathers of
    fp32 weights are `param_dtype: bf16`. `plandsl run` would gather no other way.
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=4, hidden=512, heads=8, kv_heads=8, seq=256, vocab=1024)
      cluster = dgx_h100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, micro_batch: 1, precision: bf16 }
      data    = fsdp over dp with gather = fp16
    }
    """, "Gather in the compute precision.", ("gather = fp16", "gather = bf16"))

_entry("E516", """
    `recompute_modules` names the parts of each block that `recompute: selective`
    reruns (Megatron-Core's --recompute-modules). A part the model does not have has
    nothing to rerun: `mla_up_proj` needs multi-head latent attention and `moe_act`
    grouped experts (megatron-core 0.16.1's TransformerConfig refuses both otherwise),
    `moe` a mixture of experts, `shared_experts` shared experts, and `mlp` a dense
    block (it reruns dense MLPs only; Megatron-Core skips it in MoE blocks).
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=4, hidden=512, heads=8, kv_heads=8, seq=256, vocab=1024)
      cluster = dgx_h100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, recompute: selective, recompute_modules: [core_attn, moe_act] }
      data    = fsdp over dp
    }
    """, "Name only parts the model has.", ("recompute_modules: [core_attn, moe_act]", "recompute_modules: [core_attn]"))

_entry("E517", """
    Rerunning the norms (`layernorm`) or the experts' activation (`moe_act`) drops
    their outputs and makes them again in the backward; under FP8 the linear layers
    after them then quantize the rebuilt input again. Megatron-Core refuses that under
    delayed scaling ("Delayed scaling does not support moe_act and layernorm recompute
    for fp8"), whose scales come from an amax history the step has since updated;
    current scaling and the block-scaled recipes recompute the same scales.
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=4, hidden=512, heads=8, kv_heads=8, seq=256, vocab=1024, experts=8, top_k=2)
      cluster = dgx_h100 x 1
      mesh    = [dp = 8]
      train   = { global_batch: 16, precision: fp8, recompute: selective, recompute_modules: [moe_act] }
      data    = fsdp over dp
    }
    """, "Scale FP8 by the current recipe, or keep the activation.",
    ("precision: fp8,", "precision: fp8, fp8_recipe: current,"))
