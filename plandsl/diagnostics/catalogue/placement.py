"""E4xx: placement and sharding, layers onto pipeline stages and tensors onto mesh axes.

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import GPT, Family

FAMILY = Family("E4")
_entry = FAMILY.add


_entry("E401", """
    A `stages` block puts one layer on two pipeline stages. A layer's weights live on
    exactly one stage: placing it twice would either run it twice per microbatch or
    keep two diverging copies.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages {{
        0: embed, layers[0:2]
        1: layers[1:4], norm, head
      }}
    }}
    """, "Give each layer to one stage: ranges leave out their end.", ("layers[1:4]", "layers[2:4]"))

_entry("E402", """
    A `stages` block leaves a layer on no stage. Every layer of the model must run
    somewhere; the message lists the unplaced ones as ranges, and the hint adds each to
    the stage of the layer before it (the first stage for leading ones), so that
    activations still flow forward through the stages (E410).
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages {{
        0: embed, layers[0:2]
        1: layers[2:4], norm
      }}
    }}
    """, "Place the output head on the last stage.", ("layers[2:4], norm\n", "layers[2:4], norm, head\n"))

_entry("E403", """
    A pipeline stage would hold no layer. Its rank would only pass activations along,
    adding a pipeline hop and a bubble while holding no work: there are more stages
    (pp x virtual) than layers to split (with `account`, than the blocks and the parts
    it counts: the embedding and the loss may hold a stage alone, nothing may not).
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [pp = 8]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages  = evenly over pp
    }}
    """, "Use at most as many stages as the model has blocks, and the other devices for data parallelism.",
       ("[pp = 8]", "[dp = 2, pp = 4]"))

_entry("E404", """
    The stages of a `stages` block do not match the pipeline axis: there must be
    exactly pp x virtual stages, numbered from 0, one set per pipeline rank.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages {{
        0: embed, layers[0:1]
        1: layers[1:2]
        2: layers[2:3]
        3: layers[3:4], norm, head
      }}
    }}
    """, "Make the pipeline axis as wide as the stages declared (`pp = 4, dp = 1` keeps the 8 devices), "
       "or declare two stages for `pp = 2`.", ("[dp = 2, pp = 2, tp = 2]", "[dp = 1, pp = 4, tp = 2]"))

_entry("E405", """
    A layer selector (`layers[0:8]`, `layers.*.mlp`, `embed`) in a stage block or
    shard rule matches nothing in the model, or a stage's range reaches past the model's
    last layer (`layers[60:80]` on a 64-layer model: written for another model), or
    `stages = evenly ... with account = [embed, loss]` counts a part the model does not
    have apart from its layers (an `mlp` or written model, split layer by layer), or an
    entry of a factory module's own `tp_plan` dict names no module of it. A rule
    that applies to nothing is almost always a misspelt module name, and ignoring it
    would leave the intended tensors unsharded; a range clamped silently would place
    fewer layers than the author counted.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      shard layers.*.mlp.fc1 = colwise over tp
    }}
    """, "Name a module the model has (gpt's MLP projections are `mlp.w1` and `mlp.w2`).",
       ("mlp.fc1", "mlp.w1"))

_entry("E406", """
    A tensor dimension is split over a mesh axis whose size does not divide it.
    Megatron tensor parallelism gives each of tp ranks heads/tp attention heads and
    ffn/tp MLP columns, and its kernels and collectives expect equal shards on every
    rank (uneven ones would also leave the slowest rank setting the pace). The hint
    names the sizes of the axis with which the whole plan checks (every dim the axis
    splits, the cluster, the memory) and edits the mesh to the nearest, resizing a data
    axis so the mesh keeps its devices when it can.
    """, """
    import "clusters/dgx_a100"
    plan p {
      model   = gpt(layers=4, hidden=384, heads=12, seq=128, vocab=1024)
      cluster = dgx_a100 x 1
      mesh    = [tp = 8]
      train   = { global_batch: 16, micro_batch: 1 }
      tensor  = megatron over tp
    }
    """, "Use a tensor-parallel size that divides the head count, and the rest for data parallelism.",
       ("[tp = 8]", "[dp = 2, tp = 4]"))

_entry("E407", """
    Two shard rules set the same module differently and neither is more precise (an
    exact name beats a range, a range beats a glob). The plan's result would depend
    on rule order, so it is refused.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      shard layers[0:2].mlp.w1 = colwise over tp
      shard layers[1:4].mlp.w1 = rowwise over tp
    }}
    """, "Make the ranges disjoint (or name the shared layer exactly).", ("layers[1:4]", "layers[2:4]"))

_entry("E408", """
    A placement that cannot apply to the tensor it names: a `Shard(dim)` past the
    tensor's last dimension, a parameter the matched modules do not have, or a value
    that is not `Shard(dim) @ axis`, `Replicate @ axis` or `Partial @ axis`.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      shard layers.*.mlp.w1 = {{ weight: Shard(2) @ tp }}
    }}
    """, "A linear weight is [out, in]: shard dim 0 (columns) or 1 (rows).", ("Shard(2)", "Shard(0)"))

_entry("E409", """
    The map from pipeline stages to ranks does not fit: every rank must run exactly
    `virtual` stages, and the schedule decides how many that is (1F1B and GPipe run
    one stage per rank, interleaved 1F1B several, ZBV and DualPipeV two in a V). A
    built-in schedule also decides where they run: torch's classes and the generated
    tables put stage s on rank s mod pp, or the V's rank r on stages r and 2pp-1-r for
    ZBV and DualPipeV, and `plandsl run` runs that map; another map needs a written
    schedule that runs it.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 2, tp = 2]
      train    = {{ global_batch: 16, micro_batch: 1 }}
      stages   = evenly over pp with virtual = 2, map = [0, 1, 1, 1]
      schedule = interleaved_1f1b
    }}
    """, "Give each rank two stages, in the loop interleaved 1F1B runs: [0, 1, 0, 1] (or no `map`).",
       ("[0, 1, 1, 1]", "[0, 1, 0, 1]"))

_entry("E410", """
    A stage holds layers that come before the layers of the stage ahead of it.
    Activations flow forward from stage 0 to the last stage, so each stage must
    take the layers that follow those of the stage before.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      stages {{
        0: embed, layers[2:4]
        1: layers[0:2], norm, head
      }}
    }}
    """, "Keep the layers in model order across the stages.",
       ("embed, layers[2:4]", "embed, layers[0:2]"), ("  1: layers[0:2]", "  1: layers[2:4]"))

_entry("E411", """
    Expert parallelism splits the experts of mixture-of-experts layers over a mesh
    axis and routes tokens to them with all-to-all. A dense model has no experts to
    split, so the axis would only replicate work.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, ep = 4]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      experts = alltoall over ep
    }}
    """, "Use a model with experts (`llama(..., experts=8)`), or use the axis for something else.",
       ("ep = 4", "tp = 4"), ("experts = alltoall over ep", "tensor  = megatron over tp"))

# E412-E414: a model from torch (`hf(...)`, `factory(...)`), its table written by `plandsl inspect` first.
_GPT2 = 'hf("GPT2LMHeadModel", n_embd=64, n_layer=4, n_head=4, n_positions=128, vocab_size=512)'
_LLAMA = ('hf("LlamaForCausalLM", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,\n'
          '                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)')

_entry("E412", """
    A model from torch runs unchanged, split at its block boundaries into one module per pipeline stage.
    Two names of one tensor (GPT-2's `lm_head.weight` is `transformer.wte.weight`: tied embeddings) in
    layers on different stages would be two copies that drift apart, and the interpreter cannot keep them
    in sync for a module it did not write (plandsl's own families all-reduce the tied gradients). With a
    pipeline the embedding is on the first stage and the head on the last, so untie them.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT2}
      cluster = dgx_a100 x 1
      mesh    = [dp = 4, pp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Untie the head from the embedding (each trains its own weight), or do without the pipeline.",
    ("vocab_size=512)", "vocab_size=512, tie_word_embeddings=false)"), inspect=True)

_entry("E413", """
    `tensor = megatron over tp` on a model from torch applies the model's own tensor-parallel plan (a
    Hugging Face class's `base_model_tp_plan`, which Llama, Qwen3, Mistral and many others have) with the
    plan's shard rules over it. This model has no plan (GPT-2's config has none), and no shard rule says
    which of its modules to split over the axis, so the axis would only replicate the work.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_GPT2}
      cluster = dgx_a100 x 1
      mesh    = [dp = 4, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Use the axis for data parallelism (or write shard rules naming the model's nn.Linear modules).",
    ("[dp = 4, tp = 2]", "[dp = 8]"), inspect=True)

_entry("E414", """
    torch's tensor-parallel styles split nn.Linear (colwise: the output features, weight dim 0; rowwise:
    the input features, dim 1) and nn.Embedding modules; a shard rule or the model's own plan that
    gives `colwise` or `rowwise` to another module (a norm, a container, GPT-2's Conv1D) cannot be
    applied, nor can a Hugging Face style plandsl does not know (e.g. `grouped_gemm`), nor an entry of the
    model's own plan that names one parameter rather than a module (Llama 4's `experts.gate_up_proj`).
    An entry of a transformers model's own plan that names nothing in it (Qwen2-MoE's `mlp.gate_proj`,
    where its layers hold experts) is skipped, as transformers skips it; one of a module's own `tp_plan`
    dict is E405.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {_LLAMA}
      cluster = dgx_a100 x 1
      mesh    = [dp = 4, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
      shard model.layers.*.input_layernorm = colwise over tp
    }}
    """, "Name the Linear modules to split, or replicate the norm.",
    ("shard model.layers.*.input_layernorm = colwise over tp", "shard model.layers.*.input_layernorm = replicate"),
    inspect=True)

# A CNN written layer by layer (docs/language.md section 7): ResNet-18's stem, four of its 64-channel blocks and
# a 10-class head, per 32x32 sample, as `plandsl inspect` measures them (docs/models.md).
_CNN = """
    model cnn {
      input = image(3, 32, 32)
      layer embed {
        params = 9536
        flops  = 4816896
        output = 4096
      }
      layer blocks[0:4] {
        params      = 73984
        flops       = 9437184
        activations = 41728
        output      = 4096
      }
      layer head {
        params = 650
        flops  = 1280
        output = 10
      }
    }
"""

_entry("E415", """
    A model that takes images (`input = image(C, H, W)`, a CNN) is costed per sample: one image is
    one "token" and its sequence length is 1. Splitting one image over ranks (spatial, height/width
    parallelism: `context`, a `sequence` shard rule) needs each rank to exchange
    the border rows of its part (a halo) with its neighbours before every convolution and pooling,
    and BatchNorm's statistics reduced over the split. torch's DTensor shards a convolution by the
    batch only (weights replicated); its experimental halo exchange (`torch.distributed.tensor._tp_conv`)
    splits the width only, over the whole world, with stride 1 wherever there is padding, which a
    ResNet's stride-2 convolutions break. plandsl neither costs nor runs it; a train `seq` other
    than 1 would multiply the per-sample figures.
    """, _CNN + """
    import "clusters/dgx_a100"
    plan p {
      model   = cnn
      cluster = dgx_a100 x 1
      mesh    = [dp = 4, sp = 2]
      train   = { global_batch: 64, micro_batch: 8 }
      shard blocks[0:2] = sequence over sp
    }
    """, "Split the batch instead: use the axis for data parallelism.",
       ("[dp = 4, sp = 2]", "[dp = 8]"), ("  shard blocks[0:2] = sequence over sp\n", ""))

_entry("E416", """
    `experts = alltoall over [ep, tp]` folds the tensor axis into the expert group, as Megatron-Core's
    MoE parallel folding does (`--expert-tensor-parallel-size 1` beside `--tensor-model-parallel-size`):
    each expert is whole on one rank, the experts are spread over ep x tp ranks, and tokens move by one
    all-to-all over them. Megatron forms an expert group from the ranks of one pipeline stage that
    attention splits the tokens or the weights over (ep x expert_tp x expert_dp = tp x cp x dp), so a
    pipeline axis or an axis nothing uses cannot join it; plandsl folds the tensor axis only (a data
    axis is the expert axis's own kind already). The tensor axis's ranks then dispatch their own
    sequence shards, so the plan needs sequence parallelism, as Megatron-Core requires for experts
    with tensor parallelism.
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=8, hidden=2048, heads=16, kv_heads=4, seq=4096, vocab=32000, experts=16)
      cluster = dgx_h100 x 2
      mesh    = [pp = 2, ep = 4, tp = 2]
      train   = { global_batch: 32, micro_batch: 1 }
      tensor  = megatron over tp with sequence_parallel
      experts = alltoall over [ep, pp]
    }
    """, "Fold the tensor axis instead: each expert whole on one of the ep x tp ranks.",
       ("experts = alltoall over [ep, pp]", "experts = alltoall over [ep, tp]"))

_entry("E417", """
    `tensor = megatron over tp with sequence_parallel, overlap` splits each tensor-parallel all-gather
    and reduce-scatter of a block into chunks that run behind the GEMM they feed or follow (Wang et al.
    2022's decomposition; torch's async tensor parallelism, which torchtitan turns on with
    `--compile.enable_async_tensor_parallel`; Megatron-LM's `--tp-comm-overlap`, Transformer Engine's
    userbuffers). Those collectives are sequence parallelism's: without it the block all-reduces
    instead, and Megatron-LM refuses the flag ("Tensor parallel communication/GEMM overlap can happen
    only when sequence parallelism is enabled"). torch's async tensor parallelism is a pass of
    torch.compile, and torchtitan refuses it without compiling the model, which `kernels: eager` says
    the plan does not (`overlap = userbuffers`, Transformer Engine's, compiles nothing).
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=8, hidden=2048, heads=16, kv_heads=4, seq=4096, vocab=32000)
      cluster = dgx_h100 x 1
      mesh    = [dp = 2, tp = 4]
      train   = { global_batch: 32, micro_batch: 1 }
      tensor  = megatron over tp with overlap
    }
    """, "Split the sequence too: sequence parallelism's all-gathers and reduce-scatters are what overlaps.",
       ("with overlap", "with sequence_parallel, overlap"))


_entry("E418", """
    `experts = ... with overlap` is Megatron-Core's combined 1F1B all-to-all overlap
    (`--overlap-moe-expert-parallel-comm`): each block's forward of one microbatch runs inside the
    backward of another, its dispatch and combine behind the other's computation. Megatron-Core refuses
    it beside full recomputation: TransformerConfig asserts "disable full recomputation when enabling
    overlap_moe_expert_parallel_comm" (and no recompute method or `recompute_num_layers`), so
    `recompute: full`, with or without `recompute_layers`, cannot go with it; selective recomputation
    (the attention core) can. `recompute_layers: 0` reruns no block and passes.
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=8, hidden=2048, heads=16, kv_heads=4, seq=4096, vocab=32000, experts=16)
      cluster = dgx_h100 x 1
      mesh    = [dp = 2, ep = 4]
      train   = { global_batch: 32, micro_batch: 1, recompute: full }
      experts = alltoall over ep with overlap
    }
    """, "Recompute selectively (the attention core), or overlap nothing.",
       ("recompute: full", "recompute: selective"))


_entry("E419", """
    `experts = ... with overlap` is Megatron-Core's combined 1F1B all-to-all overlap
    (`--overlap-moe-expert-parallel-comm`), and Megatron-Core runs it only where TransformerConfig lets
    it: under a pipeline only with virtual stages (the interleaved schedule pairs one microbatch's
    forward with another's backward), only with more than one expert rank (an all-to-all to hide),
    and only for a bf16 or fp16 model (an FP8 or FP4 plan's model is bf16). A plan that breaks one of
    these cannot be run as written; beside full recomputation it is E418.
    """, """
    import "clusters/dgx_h100"
    plan p {
      model    = llama(layers=8, hidden=2048, heads=16, kv_heads=4, seq=4096, vocab=32000, experts=16)
      cluster  = dgx_h100 x 2
      mesh     = [pp = 2, ep = 8]
      train    = { global_batch: 32, micro_batch: 1 }
      experts  = alltoall over ep with overlap
      stages   = evenly over pp
      schedule = 1f1b
    }
    """, "Give the pipeline virtual stages and the interleaved schedule.",
       ("evenly over pp\n", "evenly over pp with virtual = 2\n"), ("= 1f1b", "= interleaved_1f1b"))

_entry("E420", """
    Ring attention passes each rank's keys and values around the context axis and runs one kernel per
    step under the causal mask (Transformer Engine's p2p ring, Megatron-Core's `--cp-comm-type p2p`;
    torch's `_templated_ring_attention`, which `plandsl run` runs): Transformer Engine asserts it takes
    no sliding window and runs learnable attention sinks under context parallelism only over a2a, and
    torch's ring takes neither. `allgather` context parallelism gathers every key for each rank's
    queries and masks them with the band, which both Megatron-Core and `plandsl run` run.
    """, """
    import "clusters/dgx_h100"
    plan p {
      model   = llama(layers=8, hidden=2048, heads=16, kv_heads=4, seq=8192, vocab=32000, window=1024)
      cluster = dgx_h100
      mesh    = [dp = 4, cp = 2]
      train   = { global_batch: 32, micro_batch: 1 }
      context = ring over cp
    }
    """, "Gather the keys and values instead of passing them around a ring.", ("ring over cp", "allgather over cp"))
