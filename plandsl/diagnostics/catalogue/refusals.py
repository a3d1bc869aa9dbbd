"""E7xx: valid plans `plandsl run` refuses before any process starts (what the interpreter
cannot run yet, or holds more than the devices have on torch's stack, E708), and `plandsl launch` cannot
submit as one cluster job (E707); the options run and launch are given that do not fit (E710-E715), what stops a dry
run (E716) or TorchX (E717-E719), a `plandsl profile` job that fails (E720), a checkpoint `plandsl run
--resume` cannot resume (E721) and a run whose nodes do not meet (E722).

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import GPT, Family

FAMILY = Family("E7")
_entry = FAMILY.add


# The plan checks clean (it can be estimated and rendered); `plandsl run` refuses it before any
# process starts, rather than run something else. tests/make_errors_doc.py runs these examples
# through `plandsl.runtime.support.refusals` as well.
_LOCAL_GPT = "gpt(layers=4, hidden=64, heads=4, seq=32, vocab=256)"


def _local_plan(lines: str, mesh: str = "[pp = 2]", model: str = _LOCAL_GPT, header: str = "") -> str:
    return f"""
    import "clusters/local"
    {header}plan p {{
      model   = {model}
      cluster = localhost
      mesh    = {mesh} over devices[0:{2 if mesh.count("=") == 1 else 4}]
      train   = {{ global_batch: 8, micro_batch: 1 }}
      {lines}
    }}
    """


_entry("E701", """
    The plan names a built-in schedule the interpreter cannot run yet. `chimera` runs two
    pipelines in opposite directions, each rank holding one stage of each and each microbatch
    taking one of them; torch.distributed.pipelining runs one chain of stages, so there is no
    faithful way to run it. The cost model and the renderer handle it; `plandsl run` refuses
    it rather than run another schedule under its name. A pipeline of more than 65,536
    microbatches per step is refused too: torch builds each rank's schedule as a list of actions
    that grows with the count (`plandsl estimate` takes any count).
    """, _local_plan("stages   = evenly over pp\n      schedule = chimera"),
    "Run a schedule over one chain of stages with a similar bubble (1f1b, or zbv with a V-shape map).",
    ("schedule = chimera", "schedule = 1f1b"))

_entry("E702", """
    The plan splits the sequence over a context-parallel axis in a way the interpreter cannot
    run on this machine's backend. `ring` runs torch's ring attention (the algorithm behind
    torch's `context_parallel`) over the CPU flash-attention kernel with gloo; on CUDA it
    would need the CUDA attention kernels, whose outputs it merges differently, and that path
    is not written yet (no GPU has checked it), so with CUDA present `plandsl run` refuses
    it. `allgather` computes the same attention with public torch only (functional
    collectives and SDPA with a mask), on CPU and CUDA: each layer all-gathers K and V over
    the axis before the attention core (Llama 3's context parallelism).
    """, _local_plan("context = ring over cp", mesh="[cp = 2]"),
    "Gather K and V instead of passing them around the ring; the ring plan still estimates, renders and runs on CPU.",
    ("context = ring over cp", "context = allgather over cp"), on_cuda=True)

_entry("E703", """
    Two parallelisms the plan combines cannot run together with torch's building blocks.
    Context and expert parallelism do not run with `hsdp`: the context axis would have to join
    its shard dimension, and the parameters besides the experts would need a 2-D mesh
    replicated over the expert axis too. `recompute: selective_op` does not run with a
    schedule that splits the backward into I and W (`zbv`, the zero-bubble ones): torch's
    selective checkpointing serves the outputs it kept to one backward pass. Nor with ZeRO-2/3
    gathering by module (`unit = module`): each module of a block is then an FSDP2 group whose
    hooks run other ops in the checkpoint's rerun than in the forward. Nor a `grad_dtype` narrower
    than the weights beside ZeRO-2/3 gathering them as they are (`gather = fp32`) under torch's
    pipeline stages at one microbatch a step: the stage reduces that backward by hand after it, and
    a gradient that came after its group's hook keeps the weights' dtype beside the others'.
    """, _local_plan("data    = hsdp over [r, s]\n      context = allgather over cp", mesh="[r = 2, s = 1, cp = 2]"),
    "Shard over the data axes with zero3 (fsdp), which runs with context parallelism.",
    ("data    = hsdp over [r, s]", "data    = zero3 over [r, s]"))

_entry("E704", """
    The interpreter needs a torch module for the model, and has none. A model written layer
    by layer describes sizes for the cost model; to run it, `factory` names the Python
    function that builds it (docs/models.md says what the module must look like). Tensor
    parallelism, context parallelism and `recompute: selective_op` also need to know the
    module's layout, which only the gpt and llama families have (`selective_op` only their
    dense blocks). A model from torch (`hf(...)`, `factory(...)`) runs unchanged, and what it
    cannot do yet is refused here too: tensor parallelism without the model's own plan
    (transformers' `base_model_tp_plan`) or with sequence parallelism, pipeline stages without
    transformers' `base_model_pp_plan` (GPT-2) or of a model whose forward computes beside the
    modules a stage replaces (Gemma 2's logit cap), of a factory's module torch's pipeline
    frontend cannot trace or cut into that many stages, `recompute: selective` and shard rules
    (docs/models.md).
    """, _local_plan("data    = replicate over dp", mesh="[dp = 2]", model="tiny_written", header="""model tiny_written {
      layer blocks[0:2] {
        params = 64 * 64
        flops  = 2 * 64 * 64
        output = 64
      }
    }
    """),
    "Add a factory that builds the module.", ("model tiny_written {", 'model tiny_written {\n  factory = "my_models:build"'))

_entry("E705", """
    A shard rule asks for a placement the interpreter cannot run correctly: a norm's weight
    split (it normalises over the whole hidden dimension), `sequence` on a projection or
    without sequence parallelism, a parameter left `Partial`, split over an axis that is
    neither the tensor axis nor the one axis gradients are reduced over, a module split over
    that axis only in part, with `hsdp` or on `replicate`/`zero1` pipeline stages, MoE
    routers and experts split over the tensor axis. docs/running.md lists what runs.
    """, _local_plan("tensor  = megatron over tp\n      shard layers.*.norm1 = colwise over tp", mesh="[tp = 2]"),
    "Leave the norm replicated (or use `sequence` with sequence parallelism).",
    ("colwise over tp", "replicate"))


_entry("E706", """
    The plan trains in FP8 (`precision: fp8`: the blocks' linear layers in FP8, as Transformer
    Engine's recipe does), which `check`, `estimate`, the search and the renderer model from the
    devices' FP8 peaks; the interpreter does not run it yet: FP8 GEMMs need a GPU with FP8 tensor
    cores (Hopper, Ada or later) and per-tensor scaling that no run here has checked; `precision: mxfp8`
    and `nvfp4` likewise (Blackwell's tensor cores with a scale per 32, resp. 16, elements). It refuses rather than run the
    plan in another precision under its name. Likewise `optimizer_dtype: fp16`:
    Adam's second moment underflows in fp16 unless each state tensor keeps a scale (Transformer
    Engine's FusedAdam does), which the interpreter's optimizer does not; bf16 states run.
    """, _local_plan("", mesh="[dp = 2]", header="device fp8_cpu {\n      memory    = 16 GiB\n      bandwidth = 50 GB/s\n"
                                                  "      peak      = { bf16: 1 TFLOP/s, fp8: 2 TFLOP/s }\n    }\n"
                                                  "    node fp8_box {\n      devices = 2 x fp8_cpu\n      link    = "
                                                  "{ bandwidth: 5 GB/s, latency: 20 us }\n    }\n    ").replace(
        "cluster = localhost", "cluster = fp8_box").replace("micro_batch: 1 }", "micro_batch: 1, precision: fp8 }"),
    "Run it in bf16 here; keep fp8 for `estimate` and `generate`.", ("precision: fp8", "precision: bf16"))

_entry("E707", """
    `plandsl launch` submits a plan to Slurm or Kubernetes as one TorchX job built by its `dist.torchrun`
    component: one role, whose nodes are all of one kind and each start the same number of processes
    (torchrun's `--nproc-per-node`). A mesh that holds more devices of one node than of another (12 devices
    on nodes of 8: 8 and 4), or that spans nodes of different types, has no such job. `plandsl run`
    still starts it, node by node: `plandsl run --dry-run` prints each node's command.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 2
      mesh    = [dp = 12] over devices[0:12]
      train   = {{ global_batch: 48, micro_batch: 1 }}
    }}
    """, "Give the mesh whole nodes: 16 devices, two nodes of 8.",
    ("[dp = 12] over devices[0:12]", "[dp = 16]"), command=("launch", "--scheduler", "slurm", "--dryrun"))

_entry("E708", """
    The plan fits its devices as the stack it names holds it: `tensor = ... with implementation =
    megatron` (Megatron-LM's tensor parallelism, whose DDP reduces into buckets beside one copy of the
    parameters), a pipeline on Megatron-LM's or DeepSpeed's engine, Transformer Engine's ring attention,
    Megatron-LM's cross entropy (`loss: megatron`, its backward in place). `check`, `estimate` and `generate`
    count that stack's memory. `plandsl run` runs the plan on torch's stack (DTensor, torch's composable
    `replicate`, which copies each unit's parameters while it computes; `torch.distributed.pipelining`, whose
    stages keep a buffer per microbatch; torch's ring; torch's cross entropy), and there a device needs more than
    it has: the run would stop out of memory in its first
    step. `run` refuses it before any process starts. The message says what differs and the count as
    run holds it; the plan counted as run runs it is the plan with `implementation = torch`.
    """, """
    import "clusters/local"
    device small_cpu {
      memory    = 256 MiB
      bandwidth = 50 GB/s
      peak      = { fp32: 1 TFLOP/s, bf16: 1 TFLOP/s }
    }
    node small_box {
      devices = 4 x small_cpu
      link    = { bandwidth: 5 GB/s, latency: 20 us }
    }
    plan p {
      model   = gpt(layers=4, hidden=512, heads=8, seq=128, vocab=8192)
      cluster = small_box
      mesh    = [dp = 2, tp = 2] over devices[0:4]
      train   = { global_batch: 8, micro_batch: 1 }
      data    = replicate over dp
      tensor  = megatron over tp with implementation = megatron
    }
    """, "Give each device more memory (or hold less on it), so that torch's stack fits too.",
    ("memory    = 256 MiB", "memory    = 320 MiB"))

_entry("E709", """
    `plandsl run --dry-run --memory` runs a rank's first training steps on fake tensors (shapes, no
    values) and records every allocation, for the caching allocator's model to replay. A step that reads
    values from its data cannot run there: a mixture of experts routes each token by its router's scores,
    `loss: fused` finds the rank's targets by their values, fp16's loss scaling reads the gradients to skip a
    step, DistributedDataParallel orders its buckets from the ranks, a pipeline of a model from torch learns
    its stages' shapes from what the first step sends; and a step of more allocations than a trace records
    (`MAX_EVENTS`) is refused before it runs. The plan still runs, and `--dry-run` without `--memory` and
    `estimate` count its memory by the cost model; only the trace is refused.
    """, _local_plan("data    = fsdp over dp", mesh="[dp = 2]").replace(
        "train   = { global_batch: 8, micro_batch: 1 }", "train   = { global_batch: 8, micro_batch: 1, loss: fused }"),
    "Trace a plan whose steps read nothing from their data (here the standard loss), or count it without a trace.",
    ("loss: fused", "loss: standard"), command=("run", "--dry-run", "--memory"))


# E710-E716: the options `plandsl run` (or `plandsl launch`) is given do not fit the plan, or this machine, or a rank
# of the plan cannot be built. tests/make_errors_doc.py runs each example through the command named, with the
# options named (and this machine's GPUs as `gpus` says), and the fix through `fixed_command`.
_TWO_NODES = """
    import "clusters/dgx_a100"
    plan p {
      model   = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
      cluster = dgx_a100 x 2
      mesh    = [dp = 16]
      train   = { global_batch: 48, micro_batch: 1 }
    }
    """
_ENDPOINT = ("--node-rank", "0", "--rdzv-endpoint", "node0:29500")

_entry("E710", """
    torchrun starts `--nproc-per-node` processes on each of `--nnodes` machines, one rank per device of the
    mesh: their product must be the mesh's size. Fewer processes would leave devices of the mesh without a
    rank (the ranks would wait for them in their first collective), more would give ranks no device.
    `--nproc-per-node` defaults to the mesh's size over `--nnodes`.
    """, _local_plan("data    = fsdp over dp", mesh="[dp = 2]"),
    "Start one process per device of the mesh: leave `--nproc-per-node` out (the mesh's size over `--nnodes`).",
    command=("run", "--nproc-per-node", "1"), fixed_command=("run",))

_entry("E711", """
    A mesh larger than one node of the plan's cluster runs on several machines, each starting the ranks
    of its own devices. `plandsl run` given neither `--nnodes` nor `--nproc-per-node` would start every
    rank of the mesh on this machine: a 1,024-device plan started by mistake would fork 1,024 processes
    here. It is refused before any process starts; `plandsl run --dry-run` prints the command each node
    runs, and `--nproc-per-node` with the mesh's size starts them all here on purpose (at most 256). The
    hint's `--nnodes` divides the mesh (every node starts as many processes, at most a machine's devices):
    9 devices on nodes of 8 are 3 nodes of 3.
    """, _TWO_NODES,
    "Run it on every node, each with its index and node 0's address.",
    command=("run",), fixed_command=("run", "--nnodes", "2", *_ENDPOINT))

_entry("E712", """
    The nodes of a job several machines run meet before training at node 0's address, where torchrun's
    rendezvous gives each process its rank: `--nnodes` above 1 needs `--rdzv-endpoint HOST:PORT`, the same
    on every node. One machine (`--nnodes 1`) meets on its own, privately (`--standalone`).
    """, _TWO_NODES,
    "Give every node node 0's address and a free port.",
    command=("run", "--nnodes", "2"), fixed_command=("run", "--nnodes", "2", *_ENDPOINT), command_line=True)

_entry("E713", """
    `--resume` continues from the latest checkpoint of `--checkpoint-dir`, and `--checkpoint-every K`
    writes one there every K steps: without the folder neither has anything to act on. `plandsl run`
    refuses them before any rank starts (each rank's own parser, `python -m plandsl.run`, refuses them too),
    and `plandsl launch` before it submits the job.
    """, _local_plan("data    = fsdp over dp", mesh="[dp = 2]"),
    "Name the folder the checkpoints are written to and resumed from.",
    command=("run", "--resume"), fixed_command=("run", "--resume", "--checkpoint-dir", "checkpoints"),
    command_line=True)

_entry("E714", """
    With CUDA each of a node's processes takes a GPU of its own (`cuda:LOCAL_RANK`, nccl): a node that
    starts more processes than torch sees GPUs (`CUDA_VISIBLE_DEVICES` may narrow them) would fail in every
    rank at once, after the launch. `plandsl run` counts the GPUs before any rank starts. `--device cpu`
    runs the ranks on the CPU with gloo, whatever the GPUs; without `--device`, a machine without CUDA runs
    them there too.
    """, _local_plan("data    = fsdp over dp", mesh="[dp = 2]"),
    "Run the ranks on the CPU (or start as many processes per node as there are GPUs, on more nodes).",
    command=("run",), fixed_command=("run", "--device", "cpu"), command_line=True, gpus=1)

_entry("E715", """
    `plandsl launch` hands TorchX each node's command, `python -m plandsl.run PLAN` and the rank options.
    TorchX fills its macros (`${img_root}`, `${app_id}`, `$$`) into that command after quoting it, so an
    argument holding `$` would read as another value on the nodes, or run what follows it there. A plan
    file, an `--include` folder, a path (`--metrics`, `--checkpoint-dir`, `--data`) or a `--param` holding
    `$` is refused before TorchX is asked. (`plandsl run` starts torchrun itself: there `$` is a character
    like any other.)
    """, _local_plan("data    = fsdp over dp", mesh="[dp = 2]"),
    "Give the path without `$` (a path on the nodes is not expanded there).",
    command=("launch", "--scheduler", "slurm", "--dryrun", "--metrics", "'/scratch/$SLURM_JOB_ID/m.jsonl'"),
    fixed_command=("launch", "--scheduler", "slurm", "--dryrun", "--metrics", "/scratch/m.jsonl"), command_line=True)

_entry("E716", """
    `plandsl run --dry-run` builds every rank's share of the plan in this process, on the meta device, with
    the functions its ranks would run. A plan that passes `plandsl check` and everything `plandsl run`
    refuses (E701-E715) should build; one whose rank does not would most likely stop in that rank of the
    real run too. The exception is named: where it comes from the model's own code (a `factory`'s function,
    a Hugging Face model) the fix is there; otherwise it is a plandsl bug, to report with the plan, which
    reproduces it. It is a diagnostic of its own, not E108 (a bug anywhere), because the same plan fails the
    same way every time, at the rank the message names (or at the model, when its factory raises or cannot be
    imported before any rank's share is built). The example has a rank's build raise, as no plan
    known does; `PLANDSL_DEBUG=1` adds the exception's traceback as a note.
    """, _local_plan("data    = fsdp over dp", mesh="[dp = 2]"),
    "Fix the model's code where the exception is raised there; otherwise report the plan and the message.",
    command=("run", "--dry-run"), internal=True)

# E717-E719: `plandsl launch` hands the job to TorchX, which refuses it or cannot hand it on. tests/make_errors_doc.py
# submits each example through TorchX itself (its slurm scheduler: a dry run, or a submission where `sbatch` is a
# stub that prints a job id), on a machine without what `lacks` names and the fix's with it.
_LAUNCHED = _local_plan("data    = fsdp over dp", mesh="[dp = 2]")

_entry("E717", """
    `plandsl launch` builds the job with TorchX's `dist.torchrun` component and hands it to TorchX's scheduler,
    whose kubernetes scheduler builds the Volcano job with the Kubernetes client: both come with the `launch`
    extra (TorchX's nightly build, since its last release pins an old urllib3; README, Install), not with
    plandsl itself, which checks, estimates and runs plans without them. It is a usage error (exit 2), as for
    the language server without pygls; the message names the module that could not be imported.
    """, _LAUNCHED,
    "Install the `launch` extra where `plandsl launch` runs.",
    command=("launch", "--scheduler", "slurm", "--dryrun"), fixed_command=("launch", "--scheduler", "slurm", "--dryrun"),
    command_line=True, lacks="TorchX")

_entry("E718", """
    `--cfg` gives the scheduler's options as TorchX takes them, and TorchX parses them with the scheduler's own
    run options: an option it does not have (the nearest one is named), a value of the wrong type (at its option,
    the type named), a required
    option left out (kubernetes' `queue`) and, on slurm, a value holding a space (TorchX writes it unquoted on
    an `#SBATCH` line, where sbatch would read more than one option) are refused before the job is built, with
    TorchX's own message; so is a scheduler TorchX does not have, through the API (`plandsl launch` itself
    offers slurm and kubernetes). `torchx runopts SCHEDULER` lists the options, their types and defaults.
    """, _LAUNCHED,
    "Spell the option as the scheduler has it.",
    command=("launch", "--scheduler", "slurm", "--dryrun", "--cfg", "partiton=gpu"),
    fixed_command=("launch", "--scheduler", "slurm", "--dryrun", "--cfg", "partition=gpu"), command_line=True)

_entry("E719", """
    Without `--dryrun`, TorchX hands the job to the scheduler: slurm runs `sbatch` on this machine, which must be
    a login node of the cluster; kubernetes asks the API server of the current kubeconfig, where Volcano must
    run. When that fails (no `sbatch`, no cluster reached, the scheduler refusing the job) the job is not
    submitted; the message is TorchX's, and what TorchX warned of on the way (often the cause: no kubeconfig)
    follows as notes. `--dryrun` prints the job without handing it over, and asks no cluster but where told to:
    kubernetes' `--cfg validate_spec=True` has the API server check the job, and that check failing is E719 too.
    Any other exception as the job is handed over is a bug in the job plandsl built (or in TorchX), E108.
    """, _LAUNCHED,
    "Submit from a login node of the cluster, where `sbatch` runs.",
    command=("launch", "--scheduler", "slurm", "--cpu", "16", "--mem-mb", "64000"),
    fixed_command=("launch", "--scheduler", "slurm", "--cpu", "16", "--mem-mb", "64000"), command_line=True,
    lacks="sbatch")

# E720: `plandsl profile` (no plan: the example is the cluster file `-o` names, from an earlier profile, which stays as
# it was). tests/make_errors_doc.py runs the command with torch's launcher made to report rank 1 failed, as no machine
# known fails on purpose; the fix's launcher succeeds.
_entry("E720", """
    `plandsl profile --nproc-per-node N` (or `--nnodes`) measures through ranks started by torch's launcher, as
    `plandsl run` starts its own. A rank that fails prints its own error (a device that fails or runs out of
    memory, a collective that waited 300 s for a peer that was lost) and the launcher stops the others; nodes that
    do not meet at `--rdzv-endpoint` (node 0 not started, or not reachable at that address and port) fail before
    any rank starts. Either way nothing is written: the file `-o` names stays as it was (the new one is written to
    a temporary name and renamed at the end). Nor is a signal this error: Ctrl-C exits 130, a SIGTERM 143
    (`interrupted by SIGTERM: nothing written to OUT`).
    """, """
    # the cluster file of an earlier `plandsl profile -o lab.plan`, left as it was
    """, "Read the rank's own error above E720 and mend what it names (`--quick` tries again in seconds).",
    file="lab.plan", command=("profile", "--nproc-per-node", "2", "--quick", "-o"), command_line=True, internal=True)

# E721: `plandsl run --resume` from a checkpoint of another optimizer. tests/make_errors_doc.py writes the record of a
# run's second step (what the launcher reads before any rank starts) into `checkpoints/` beside the example and its fix.
_entry("E721", """
    `--resume` continues from the latest checkpoint of `--checkpoint-dir`: DCP's shards of the model and the
    optimizer's states, and plandsl's record of the run that wrote them. Any layout of the same model and optimizer
    resumes it (DCP reshards by parameter name); another model (a parameter of another shape, or one only one side
    has) or another optimizer has no state to continue from, and a record that cannot be read, is of another
    format or lacks what the ranks read of it (a field missing or of another type) says nothing to trust. `plandsl run` reads the record before any rank starts and refuses another
    optimizer, format or an unreadable record there; the model's shapes are known once a rank has built its share,
    so every rank checks them again before any step (rank 0 prints the refusal; nothing is written, no metrics file
    opened).
    """, _local_plan("data    = fsdp over dp", mesh="[dp = 2]").replace(
        "train   = { global_batch: 8, micro_batch: 1 }", "train   = { global_batch: 8, micro_batch: 1, optimizer: sgd }"),
    "Resume with the optimizer the checkpoint holds (or start afresh: another `--checkpoint-dir`, or without "
    "`--resume`).", ("optimizer: sgd", "optimizer: adam"),
    command=("run", "--checkpoint-dir", "checkpoints", "--resume"), checkpoint="""
    {"format": 1, "step": 2, "steps": 4, "plan": "p", "plan_hash": "0", "optimizer": "adam", "world_size": 2,
     "scheduler": {"last_epoch": 2, "lr_lambdas": [null]}, "loss_scale": null, "model": {"embed.tok.weight": [256, 64]}}
    """)

# E722: `plandsl run` on several nodes whose rendezvous fails. tests/make_errors_doc.py launches the example with torch's
# launcher made to raise what its static rendezvous raises when node 0 cannot be reached; the fix's command is the same,
# node 0 started (checked up to the launch).
_entry("E722", """
    `plandsl run --nnodes N` starts torch's launcher on each machine; the launchers meet at `--rdzv-endpoint`
    (node 0's address and a port, torch's static rendezvous) before any rank starts. A node that cannot reach
    node 0 (a wrong address, node 0 not started yet, a port a firewall closes) or a node 0 that waits for nodes
    that never come fails there, after torch's wait, with no rank started and nothing written: it is neither a
    rank's failure (the job's failed ranks are named, not coded) nor a plandsl bug (E108). torch's own message
    is in the diagnostic.
    """, _local_plan("data    = fsdp over dp", mesh="[dp = 2]"),
    "Start node 0's command first, with the same --rdzv-endpoint (node 0's reachable address) on every node.",
    command=("run", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:29500"), command_line=True,
    internal=True)
