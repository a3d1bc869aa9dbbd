"""`runtime.memtrace`: a rank's steps run on fake tensors record what a real run of the same steps holds.

The reference is the run itself: the same plans trained for two steps on forked gloo ranks, every tensor's storage
an operator returns recorded by a dispatch mode (`memtrace.recording(fake=False)`); the trace of each rank, made in
this process on fake tensors with a fake process group, records in the fake mode itself, which also sees what
DTensor runs inside its handler. So a trace must record at least the run's allocations, per step, the same in
the steady step where no DTensor computes (FSDP2 over plain unsharded tensors: its parameters allocated and freed
by resizing storages), and the same most alive at once within 5 %, for FSDP2, tensor parallelism and their product. Then what a trace holds by construction (Adam's two states per local parameter element after the first
step, the loss's fp32 log-probabilities), the plans it refuses (`TraceError`, one line), its bound (`MAX_EVENTS`),
and `plandsl run --dry-run --memory`.
"""
from __future__ import annotations

import functools
import math

import pytest
from click.testing import CliRunner

from tests.conftest import STDLIB
from tests.distributed.harness import run_ranks
from tests.distributed.ranks import load
from tests.support import lazy

torch = lazy("torch")
memtrace = lazy("plandsl.runtime.memtrace")

pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("memtrace")]  # a group of its own: `_trace_of` shares a
# worker's traces (~3 CPU-minutes, which in the "torch" group ran behind the unit tests' torch imports on one worker)

LOCAL = STDLIB / "local"
STEPS = 2
PEAK = 0.05
PIPELINE_PEAK = 0.10  # the real run's last pipeline stage holds 6 % more than its trace from the second step on (this
# tiny model: 155 KB, not found; a stage the run built with torch's dynamic shape inference, the trace's static)
SCALARS = 64  # bytes: the build's small tensors made outside the fake mode (real there, so not recorded)


@functools.lru_cache(maxsize=16)
def _trace_of(text: str, rank: int = 0, steps: int = 2):
    """`memtrace.trace_rank` of a plan's text, once per text in this worker (the module is one xdist group): the
    parametrized cases below compare each rule with the same default plan, whose trace (2-10 s) they only read. Made
    with a `progress` as `plandsl run --dry-run --memory` gives it, called after each step (test_run_dry_run_memory's
    command gets the fsdp plan's trace from here, not from its own call)."""
    done = []
    trace = memtrace.trace_rank(load(text), rank, steps, lambda step, total: done.append((step, total)))
    assert done == [(step, steps) for step in range(1, steps + 1)], done
    return trace


VIEWS = ("split.", "view.", "slice.", "as_strided.", "alias.", "_reshape_alias.", "unbind.", "select.", "t.",
         "transpose.", "expand.", "permute.", "unsqueeze.", "squeeze.")


def _seen_made(trace) -> tuple[tuple, tuple]:
    """`trace`'s events and step marks without the storages first seen through a view: made inside an operator,
    where no dispatch mode sees the allocation (gloo's collectives in a real run, `distribute_tensor`'s scatter of
    a real parameter), so a run records them where a view first shows them, and a fake run may record them earlier."""
    hidden = {key for key, label in trace.labels.items() if label.startswith(VIEWS)}
    events = tuple(event for event in trace.events if event[1] not in hidden)
    steps = tuple(sum(1 for event in trace.events[:mark] if event[1] not in hidden) for mark in trace.steps)
    return events, steps


def _summary(events, steps) -> dict:
    """Per step: storages allocated and their bytes; and the most bytes alive at once from the first step on."""
    out = {"made": [], "bytes": []}
    bounds = list(steps) + [len(events)]
    for first, end in zip(bounds, bounds[1:]):
        made = [size for op, _, size in events[first:end] if op > 0]
        out["made"].append(len(made))
        out["bytes"].append(sum(made))
    return out


def _real_steps(rank: int, source: str) -> dict:
    """Train `source` for STEPS steps on this gloo rank, recording every tensor's storage from the build on."""
    from plandsl.runtime import train
    from plandsl.runtime.parallel.mesh import build_mesh, init_distributed
    plan = load(source)
    device = init_distributed(60.0, "cpu")
    torch.manual_seed(plan.train.seed)
    with memtrace.recording(fake=False) as recorder:
        with recorder:
            job = train.build_job(plan, build_mesh(plan, device), device, train.RunConfig(steps=STEPS, quiet=True))
            marks = []
            for step in range(STEPS):
                marks.append(len(recorder.events))
                train.train_step(job, step, report=False)
    trace = memtrace.MemoryTrace(plan.name, rank, tuple(recorder.events), tuple(marks), dict(recorder.labels))
    return {"summary": _summary(*_seen_made(trace)), "peaks": [trace.peak_allocated(mark)[0] for mark in trace.steps]}


DP_TP_FSDP = """
import "clusters/local"
import "local/tiny"
plan tiny_fsdp_tp {
  model   = tiny_gpt
  cluster = localhost
  mesh    = [dp = 2, tp = 2] over devices[0:4]
  train   = tiny_train
  data    = fsdp over dp
  tensor  = megatron over tp with sequence_parallel
}
"""
SOURCES = {"fsdp": str(LOCAL / "fsdp.plan"), "tp_sp": str(LOCAL / "tp_sp.plan"), "fsdp_tp": DP_TP_FSDP,
           "pp_1f1b": str(LOCAL / "pp_1f1b.plan"), "pp_interleaved": str(LOCAL / "pp_interleaved.plan")}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_trace_records_what_a_real_run_holds(name):
    source = SOURCES[name]
    plan = load(source)
    real = run_ranks(plan.mesh.size, _real_steps, source, deadline_s=60)
    # the first rank and, on a pipeline, the last (a stage of its own: embedding, head); without one every rank holds
    # even shards of the same tensors (dp, tp and their product here) and mirrors the first (a trace ~4 s)
    ranks = ((0, real[0]), (len(real) - 1, real[-1])) if plan.stages is not None else ((0, real[0]),)
    for rank, got in ranks:
        trace = _trace_of(source, rank, STEPS)  # DP_TP_FSDP's first rank read again below
        made = _summary(*_seen_made(trace))
        # the trace sees at least what a dispatch mode sees in the real run; more where a tensor subclass runs
        # operators inside its handler (DTensor: the trace records them in the fake mode itself), and the same
        # once the optimizer's states exist where no DTensor computes (FSDP2 computes on plain unsharded tensors)
        # a pipeline's first step: the run infers its stages' shapes by running them (torch's dynamic mode), the trace
        # gives them (`memtrace._static_stages`), so only the steps after the first compare, and the peaks from there
        first = 1 if plan.stages is not None else 0
        for kind in ("made", "bytes"):
            assert all(f >= r for f, r in zip(made[kind][first:], got["summary"][kind][first:])), (rank, kind, made, got)
        if plan.tp == 1 and plan.stages is None:
            assert made["made"][-1] == got["summary"]["made"][-1] and made["bytes"][-1] == got["summary"]["bytes"][-1]
        # the most alive at once within 5 % (a few bytes without tensor parallelism): a real run's operators
        # allocate inside themselves (gloo's collectives), which no dispatch mode sees, and the build makes small
        # tensors outside the fake mode (real there, not recorded)
        peak, real = trace.peak_allocated(trace.steps[first])[0], got["peaks"][first]
        assert abs(peak - real) <= max(SCALARS, (PIPELINE_PEAK if first else PEAK) * real), (rank, peak, real)


def test_a_trace_holds_the_optimizer_states_and_the_loss():
    """After the first step Adam's two states per local parameter element are alive (DTensors: the recorder keeps
    their local shards), and the step makes the loss's fp32 log-probabilities, [tokens, vocabulary / tp] (torch's
    loss parallel)."""
    plan = load(DP_TP_FSDP)
    trace = _trace_of(DP_TP_FSDP, 0, STEPS)
    states = [size for key, size in trace.live_before(trace.steps[1]).items()
              if trace.labels[key].startswith("zeros_like")]
    local = sum(size for key, size in trace.live_before(trace.steps[0]).items()
                if trace.labels[key].startswith(("new_zeros", "empty")) and "float32" in trace.labels[key])
    assert sum(states) == 2 * local > 0
    tokens = plan.train.micro_batch * plan.seq
    shape = f"[{tokens}, {plan.model.vocab // plan.tp}] float32"  # loss parallel's log-softmax on the local shard
    logprobs = [size for op, key, size in trace.events if op > 0 and trace.labels[key].endswith(shape)]
    assert len(logprobs) >= 4 * STEPS and set(logprobs) == {tokens * plan.model.vocab // plan.tp * 4}
    assert not [label for label in trace.labels.values() if label.endswith(f"[{tokens}, {plan.model.vocab}] float32")]


def test_a_pipeline_stage_traces_its_sharded_parameters():
    """A tensor-parallel pipeline stage's local parameters are alive when its first step starts: at least half
    the bytes of Adam's two states per local parameter element, which exist after that step. A stage is a deep copy of
    the model (`pipeline.split_stage`): its fake tensors stay in the recording fake mode, whose copy is itself (a
    copied recorder lost tensor parallelism's and FSDP2's shards of the stage: tp_pp's peak 16 % low)."""
    plan = load(str(LOCAL / "tp_pp.plan"))
    trace = memtrace.trace_rank(plan, 0, STEPS)
    states = sum(size for key, size in trace.live_before(trace.steps[1]).items()
                 if trace.labels[key].startswith("zeros_like"))
    assert states > 0 and sum(trace.live_before(trace.steps[0]).values()) >= states // 2, states


MANY_MICROBATCHES = """
import "clusters/local"
import "local/tiny"
plan many {
  model   = tiny_gpt
  cluster = localhost
  mesh    = [dp = 2] over devices[0:2]
  train   = { global_batch: 2000000, micro_batch: 1, precision: fp32, optimizer: adam, lr: 1e-3, seed: 0 }
  data    = fsdp over dp
}
"""


@pytest.mark.parametrize("name", ["ep", "dp", "zero1", "many"])
def test_plans_a_trace_cannot_run_are_refused(name):
    """A step that reads its data (experts' routing), DDP (its reducer orders its buckets from the ranks), and a step
    past the bound before it runs (a million microbatches: refused at once, not after minutes)."""
    plan = load(MANY_MICROBATCHES) if name == "many" else load(LOCAL / f"{name}.plan")
    with pytest.raises(memtrace.TraceError, match="cannot be traced") as error:
        memtrace.trace_rank(plan)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("bound", [500, 2500, 4000, 5500])
def test_a_trace_is_bounded(monkeypatch, bound):
    """Past the bound, wherever it falls (the build, the forward, the loss, the backward, the optimizer), the trace
    stops with TraceError, raised where Python called an operator, never from inside torch's C++ (which would
    abort the process), and leaves no process group behind."""
    monkeypatch.setattr("plandsl.runtime.memtrace.MAX_EVENTS", bound)
    monkeypatch.setattr("plandsl.runtime.memtrace.EVENTS_PER_BLOCK_PASS", 0)  # past the up-front reckoning
    with pytest.raises(memtrace.TraceError, match=f"more than {bound:,} allocations"):
        memtrace.trace_rank(load(LOCAL / "fsdp.plan"))
    import torch.distributed as dist
    assert not dist.is_initialized()


def test_run_dry_run_memory(monkeypatch):
    """The command's trace of rank 0's two steps is `_trace_of`'s of the same plan, rank and steps, which
    test_trace_records_what_a_real_run_holds[fsdp] made in this worker (the module is one xdist group) and checked
    against a real run: a second identical trace cost ~4 s. What the command does with it (the allocator's replays,
    the count beside it, the lines it prints) runs here; a plan other than that one is traced by `trace_rank`."""
    from plandsl.cli import main
    fsdp, trace_rank, shared = str(LOCAL / "fsdp.plan"), memtrace.trace_rank, []
    made = _trace_of(fsdp, 0, STEPS)

    def trace_once(plan, rank=0, steps=2, progress=None):
        if (plan, rank, steps) != (load(fsdp), 0, STEPS):
            return trace_rank(plan, rank, steps, progress)
        shared.append((rank, steps))
        for done in range(1, steps + 1):
            if progress is not None:
                progress(done, steps)
        return made

    monkeypatch.setattr("plandsl.runtime.memtrace.trace_rank", trace_once)
    result = CliRunner().invoke(main, ["run", fsdp, "--dry-run", "--memory"])
    assert result.exit_code == 0, result.output
    assert shared == [(0, STEPS)], shared  # rank 0's first two steps, the trace shared
    traced = result.output[result.output.index("memory of rank 0, traced"):]
    assert "reserved, expandable segments:" in traced and "the cost model counts" in traced
    refused = CliRunner().invoke(main, ["run", str(LOCAL / "ep.plan"), "--dry-run", "--memory"])
    assert refused.exit_code == 1 and "error[E709]: plan 'tiny_ep' cannot be traced" in refused.output, refused.output
    assert "^" in refused.output and "Traceback" not in refused.output  # a Diagnostic at the plan, with its caret
    alone = CliRunner().invoke(main, ["run", str(LOCAL / "fsdp.plan"), "--memory"])
    assert alone.exit_code == 2 and "--dry-run" in alone.output


WHOLE_VOCAB = """
import "clusters/local"
plan whole_vocab {
  model    = llama(layers=2, hidden=32, heads=4, seq=16, vocab=4096)
  cluster  = localhost x 8
  mesh     = [dp = 2, pp = 2, tp = 2] over devices[0:8]
  train    = { global_batch: 8, micro_batch: 1, precision: fp32, optimizer: adam, lr: 1e-3, seed: 0 }
  data     = fsdp over dp
  tensor   = megatron over tp with sequence_parallel
  stages   = evenly over pp
  schedule = 1f1b
}
"""


def _most_alive(trace, label: str) -> int:
    """The most storages of `label` (an op's output, shape and dtype) alive at once in `trace`'s events."""
    alive, most = set(), 0
    for op, key, _ in trace.events:
        if trace.labels[key] == label:
            (alive.add if op > 0 else alive.discard)(key)
            most = max(most, len(alive))
    return most


def test_the_count_holds_the_whole_vocabulary_embedding_gradient_a_trace_shows():
    """torch's vocabulary-parallel embedding makes its gradient over the whole vocabulary on every tensor rank, and
    FSDP2 under torch's pipeline accumulates it unreduced across the stage's microbatches: the trace of the first
    stage shows one [vocab, hidden] fp32 storage alive from the stage's first backward to past its last, and the count
    holds exactly its bytes beyond the vocabulary shard (`cost.memory.whole_vocab_gradient_bytes`)."""
    from plandsl.cost.memory import estimate_plan_memory, whole_vocab_gradient_bytes
    from plandsl.ir.placement import assign_stages
    plan = load(WHOLE_VOCAB)
    vocab, hidden = plan.model.vocab, plan.model.hidden
    trace = memtrace.trace_rank(plan, 0, 1)
    shape = f"embedding_dense_backward.default[{vocab}, {hidden}] float32"
    made, spans = {}, []
    for index, (op, key, size) in enumerate(trace.events):
        if trace.labels[key] == shape:
            if op > 0:
                made[key] = index
            else:
                spans.append((made.pop(key), index, size))
    spans += [(start, len(trace.events), vocab * hidden * 4) for start in made.values()]  # alive at the end
    # one per microbatch's backward: all but the first added into the first, which lives across the others
    assert len(spans) == plan.num_microbatches
    first = min(spans)
    assert all(first[0] < start and end <= first[1] for start, end, _ in spans if (start, end) != first[:2])
    assert first[2] == vocab * hidden * 4
    assignment, _ = assign_stages(plan)
    beyond = whole_vocab_gradient_bytes(plan, assignment.stage_layers[0])
    assert beyond == first[2] - vocab // plan.tp * hidden * 4 > 0
    assert estimate_plan_memory(plan)[0].gathered_grads >= beyond


@pytest.mark.parametrize("data", ["replicate", "zero1"])
def test_a_batch_shares_replica_under_replicate_holds_the_whole_vocabulary_gradient_the_count_holds(data):
    """`batch_shares` replicas reduce after their last microbatch only, under `replicate` (which replicate and zero1
    run for TP's DTensor parameters) as under FSDP2: the first microbatch's [vocab, hidden] fp32 embedding gradient
    lives while the next one's is made, and the count (`cost.estimate._estimate_replicas`) holds its part beyond the
    vocabulary shard."""
    from plandsl.cost.compute import DEFAULT_EFFICIENCY
    from plandsl.cost.estimate import estimate_plan
    plan = load(WHOLE_VOCAB.replace("[dp = 2, pp = 2, tp = 2] over devices[0:8]", "[dp = 2, tp = 2] over devices[0:4]")
                .replace("seed: 0 }", "seed: 0, batch_shares: [6, 2] }").replace("fsdp over dp", f"{data} over dp")
                .replace("  stages   = evenly over pp\n  schedule = 1f1b\n", ""))
    vocab, hidden = plan.model.vocab, plan.model.hidden
    trace = memtrace.trace_rank(plan, 0, 1)
    assert _most_alive(trace, f"embedding_dense_backward.default[{vocab}, {hidden}] float32") == 2
    torch = estimate_plan(plan, DEFAULT_EFFICIENCY).memory[0].gathered_grads
    megatron = estimate_plan(plan.model_copy(update={"tensor": plan.tensor.model_copy(update={"stack": "megatron"})}),
                             DEFAULT_EFFICIENCY).memory[0].gathered_grads
    assert torch - megatron == (vocab - vocab // plan.tp) * hidden * 4


REPLICATED_TP = """
import "clusters/local"
plan replicated_tp {
  model    = llama(layers=4, hidden=256, heads=4, seq=32, vocab=512)
  cluster  = localhost x 4
  mesh     = [dp = 2, tp = 2] over devices[0:4]
  train    = { global_batch: 8, micro_batch: 2, precision: bf16, optimizer: adam, lr: 1e-3, seed: 0 }
  data     = ddp over dp
  tensor   = megatron over tp with sequence_parallel
}
"""


REPLICATED_PP = REPLICATED_TP.replace("[dp = 2, tp = 2]", "[dp = 2, pp = 2]").replace(
    "  tensor   = megatron over tp with sequence_parallel\n", "  stages   = evenly over pp\n  schedule = 1f1b\n")


SPLIT_OVER_DP = REPLICATED_TP.rstrip().rstrip("}") + "  shard layers.*.mlp.w2 = { weight: [Shard(1) @ tp, Shard(0) @ dp] }\n}\n"


@pytest.mark.parametrize("text", [REPLICATED_TP, REPLICATED_TP.replace("ddp over", "zero1 over"), REPLICATED_PP],
                         ids=["ddp-tp", "zero1-tp", "ddp-pp"])
def test_the_count_holds_what_replicate_holds(text):
    """DDP over tensor-parallel (DTensor) parameters, and over pipeline stages, runs torch's composable `replicate`,
    FSDP2's machinery over a mesh it does not shard: it copies each unit's parameters into buffers of its own before
    the unit's forward and frees them after its backward (a stage's after its last), so at a backward's start the rank
    holds its parameters twice. Traced against counted (MiB): ddp x tp 40.9 / 40.2 (33.2 before the count held the
    copies, `cost.memory.replicate_copy_bytes`), zero1 x tp 33.9 / 33.2 (26.2), ddp x pp 42.4 / 40.5 (33.5)."""
    from plandsl.cost.memory import estimate_plan_memory, replicates_units
    plan = load(text)
    trace = memtrace.trace_rank(plan, 0, 2)
    counted = estimate_plan_memory(plan)[0]
    assert replicates_units(plan) and counted.gathered_params == counted.params / 2  # the copies: the weights again
    assert 0.95 <= counted.total / trace.peak_allocated(trace.steps[0])[0] <= 1.02


@pytest.mark.parametrize("kind", ["ddp", "zero1"])
def test_a_module_split_over_the_data_axis_is_gathered_apart(kind):
    """A shard rule's split over the data axis makes the module an FSDP group of its own, which `replicate` does not
    copy and which reshards after its forward (`data_parallel.shard_by_rules` says so: a group no FSDP group encloses
    is a root, which FSDP2 would keep gathered to its backward): each w2 1/dp of its states, one whole while it
    computes (`cost.memory.data_split_gathered`). Traced against counted (MiB): ddp 36.6 / 36.5, zero1 31.0 / 31.0
    (40.9 / 40.2 and 33.9 / 33.2 without the rule)."""
    from plandsl.cost.memory import estimate_plan_memory
    plan = load(SPLIT_OVER_DP.replace("ddp over", f"{kind} over"))
    trace = memtrace.trace_rank(plan, 0, 2)
    assert 0.97 <= estimate_plan_memory(plan)[0].total / trace.peak_allocated(trace.steps[0])[0] <= 1.02


@pytest.mark.parametrize("global_batch, alive", [(1, 1), (4, 2)])
def test_a_step_of_one_microbatch_holds_one_whole_vocabulary_gradient(global_batch, alive):
    """Without data parallelism the step keeps the embedding's whole-vocabulary gradient (its `.grad`) till the next
    `zero_grad`; over several microbatches each backward makes a new one beside it (two alive at once, the moment
    `cost.memory.whole_vocab_gradient_moment` counts), but a step of one microbatch makes one only, the accumulator
    itself: the moment is 0 there (the count held it twice, 4 MiB more than the trace at its backward's end)."""
    from plandsl.cost.memory import whole_vocab_gradient_moment
    from plandsl.ir.placement import assign_stages
    plan = load(WHOLE_VOCAB.replace("hidden=32", "hidden=256").replace("[dp = 2, pp = 2, tp = 2] over devices[0:8]",
                                                                       "[tp = 2] over devices[0:2]")
                .replace("global_batch: 8", f"global_batch: {global_batch}").replace("  data     = fsdp over dp\n", "")
                .replace("  stages   = evenly over pp\n  schedule = 1f1b\n", ""))
    vocab, hidden = plan.model.vocab, plan.model.hidden
    trace = memtrace.trace_rank(plan, 0, 2)
    most = _most_alive(trace, f"embedding_dense_backward.default[{vocab}, {hidden}] float32")
    assert plan.num_microbatches == global_batch and most == alive
    assignment, _ = assign_stages(plan)
    assert whole_vocab_gradient_moment(plan, assignment.stage_layers[0]) == (alive - 1) * vocab * hidden * 4


RULED_BLOCKS = """
import "clusters/local"
plan ruled_blocks {
  model    = gpt(layers=4, hidden=512, heads=8, seq=256, vocab=8192)
  cluster  = localhost x 8
  mesh     = [dp = 2, tp = 4] over devices[0:8]
  train    = { global_batch: 4, micro_batch: 2, precision: bf16, optimizer: adam, lr: 1e-3, seed: 0 }
  data     = zero1 over dp
  tensor   = megatron over tp with sequence_parallel
}
"""  # one microbatch a rank a step: what these tests compare is one microbatch's (a trace of four took 3x as long)


def _weights_copy(label: str) -> bool:
    """A weight's autocast copy (`_to_copy` of at most two dims: these models' parameters) or a parameter's gathered or
    replicated buffer (`empty.memory_format`); not an activation cast (torch's ring casts its fp32 merged output to
    the 16-bit [b, heads, s, d] it keeps for its backward)."""
    if label.startswith("empty.memory_format"):
        return True
    shape = label[label.index("[") + 1:label.index("]")] if label.startswith("_to_copy") else None
    return shape is not None and shape.count(",") < 2


def _saved_before_backward(trace) -> int:
    """Bytes the second step's first microbatch leaves alive for its backward: the storages made from its embedding on
    and alive at the first backward operator of the blocks' stack (the final norm's), but the weights' autocast copies
    and the parameters' gathered or replicated buffers (`_weights_copy`)."""
    events, labels = trace.events, trace.labels
    first = next(i for i in range(trace.steps[1], len(events))
                 if events[i][0] > 0 and labels[events[i][1]].startswith("embedding"))
    backward = next(i for i in range(first, len(events))
                    if events[i][0] > 0 and labels[events[i][1]].startswith("native_layer_norm_backward"))
    before = trace.live_before(first)
    return sum(size for key, size in trace.live_before(backward).items()
               if key not in before and not _weights_copy(labels[key]))


@pytest.mark.parametrize("rules, before", [
    ("  shard layers.*.mlp.w1 = { weight: Shard(0) @ dp, bias: Shard(0) @ dp }", 0.68),
    ("  shard layers.*.mlp = replicate", 0.50),
    ("  shard layers.*.attn.wq = replicate", 0.66),
], ids=["w1_over_dp", "replicated_mlp", "replicated_wq"])
def test_the_count_keeps_a_broken_pairs_tensors_whole_as_a_trace_does(rules, before):
    """Where a shard rule breaks a block's Megatron pair, `run` makes its members take and return whole tensors
    (`runtime.parallel.tensor_parallel._pair`), so the block saves its producers' outputs whole on every tensor rank
    (`cost.memory._broken_terms`). What the blocks save for the backward, traced (the second step's first microbatch,
    `_saved_before_backward`) against counted (the layers before the head), MiB: w1 over dp 17.27 / 17.69, a
    replicated MLP 23.27 / 23.69, a replicated wq 17.82 / 18.19 (the default split 11.27 / 11.69, which the count held
    for all of them before: `before`, the share of the trace it counted)."""
    from plandsl.cost.memory import estimate_layer_activations
    from plandsl.ir.placement import assign_stages

    def saved(text):
        plan = load(text)
        layers = assign_stages(plan)[0].stage_layers[0]
        counted = sum(estimate_layer_activations(plan, layer) for layer in layers if layer.kind != "head")
        return _saved_before_backward(_trace_of(text)), counted

    traced, counted = saved(RULED_BLOCKS.rstrip().rstrip("}") + rules + "\n}\n")
    default_traced, default_counted = saved(RULED_BLOCKS)
    assert 1.0 <= counted / traced <= 1.04
    assert (counted - default_counted) / (traced - default_traced) == pytest.approx(1.0, abs=0.02)
    assert default_counted / traced == pytest.approx(before, abs=0.02)


def _traced_and_counted(text: str) -> tuple[int, float]:
    """What the blocks save for the backward: traced (`_saved_before_backward`) and counted (the layers before the
    head, `cost.memory.estimate_layer_activations`)."""
    from plandsl.cost.memory import estimate_layer_activations
    from plandsl.ir.placement import assign_stages
    plan = load(text)
    layers = assign_stages(plan)[0].stage_layers[0]
    counted = sum(estimate_layer_activations(plan, layer) for layer in layers if layer.kind != "head")
    return _saved_before_backward(_trace_of(text)), counted


RING = RULED_BLOCKS.replace("[dp = 2, tp = 4]", "[cp = 2, tp = 4]").replace("  data     = zero1 over dp\n", "").replace(
    "with sequence_parallel\n", "with sequence_parallel\n  context  = ring over cp\n")


@pytest.mark.parametrize("rule", ["attn.wq = replicate", "attn = replicate", "attn.wo = colwise over tp",
                                  "attn.wo = replicate"], ids=["wq", "attn", "wo_colwise", "wo"])
def test_the_count_makes_the_rings_output_whole_where_a_rule_breaks_the_attention(rule):
    """Under ring context parallelism torch's ring keeps its own output ([b, heads, s, d], cast from its fp32 merge:
    a `_to_copy`, which this file's measure once took for a weight's copy) apart from wo's input in Megatron's layout
    too; a broken attention makes it whole, 2o(1 - 1/t) more per block, beside wo's chunk (a replicated wq) or wo's
    whole input (wo colwise or whole; `cost.memory._broken_terms`'s `ring`). Traced against counted, MiB: a replicated
    wq 8.91 / 8.84 (9.09 counted before; 7.91 traced without the ring's output); the other three 9.66 / 9.59 (8.84
    counted before the ring's output was counted beside wo's whole input); the default split 5.89 / 5.84 (the ring's
    o/t the count does not hold, gpt's dropout masks, which this model does not make, in its place)."""
    traced, counted = _traced_and_counted(RING.rstrip().rstrip("}") + f"  shard layers.*.{rule}\n}}\n")
    default_traced, default_counted = _traced_and_counted(RING)
    assert 0.98 <= counted / traced <= 1.04
    assert (counted - default_counted) / (traced - default_traced) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("rules", ["  shard layers.*.attn = replicate", "  shard layers.*.attn.wo = colwise over tp",
                                   "  shard layers.*.mlp = replicate"], ids=["attn", "wo_colwise", "mlp"])
def test_selective_op_keeps_what_the_count_holds_of_a_broken_pair(rules):
    """`selective_op` keeps every other matmul's output, the core's and the reduce-scatters
    (`runtime.recompute.keep_every_other_matmul`): a broken pair keeps its whole projections' whole outputs and, a
    broken attention, the core's whole output; a consumer not split along its input features reduce-scatters nothing,
    so keeps nothing after it (`cost.memory._selective_op_terms`). What the blocks save, traced against counted, MiB:
    a replicated attention 9.32 / 9.19 (9.69 before), wo colwise 6.32 / 6.19 (6.69), a replicated MLP 10.77 / 10.69
    (11.19); the default split 5.27 / 5.19 (flash attention's log-sum-exp and the embedding's output, not counted)."""
    selective = RULED_BLOCKS.replace("seed: 0 }", "seed: 0, recompute: selective_op }")
    plan = load(selective)
    traced, counted = _traced_and_counted(selective.rstrip().rstrip("}") + rules + "\n}\n")
    default_traced, default_counted = _traced_and_counted(selective)
    # a broken attention's fp32 log-sum-exp over every head, not counted (a few KiB a block)
    lse = 4 * plan.model.heads * plan.seq * plan.train.micro_batch * (1 - 1 / plan.tp) * plan.model.layers
    assert 0.97 <= counted / traced <= 1.04
    assert abs((counted - default_counted) - (traced - default_traced)) <= 0.02 * (traced - default_traced) + lse


def _collectives(trace) -> dict[str, int]:
    """The tensor axis's collectives of the second step, by operator, output shape and dtype (`trace.labels`)."""
    found: dict[str, int] = {}
    for op, key, _ in trace.events[trace.steps[1]:]:
        label = trace.labels[key]
        if op > 0 and label.startswith(("all_reduce", "all_gather", "reduce_scatter", "all_to_all")):
            found[label] = found.get(label, 0) + 1
    return found


@pytest.mark.parametrize("rules, changed", [
    # a replicated MLP: neither reduce-scatter of Megatron's pair (w2's output forward, the MLP input's gradient
    # backward); its input gathered, its output's gradient gathered as before
    ("  shard layers.*.mlp = replicate", {"reduce_scatter_tensor.default[2, 64, 512] bfloat16": -2}),
    # w1 whole before a rowwise w2: no reduce-scatter of the MLP input's gradient (w1's is whole); w2's input gradient
    # [tokens, ffn] all-gathered
    ("  shard layers.*.mlp.w1 = { weight: Shard(0) @ dp, bias: Shard(0) @ dp }",
     {"reduce_scatter_tensor.default[2, 64, 512] bfloat16": -1,
      "all_gather_into_tensor.default[8, 256, 512] bfloat16": 1}),
], ids=["replicated_mlp", "w1_over_dp"])
def test_a_broken_pair_runs_the_collectives_the_time_model_prices(rules, changed):
    """`run`'s collectives for a broken MLP pair (`cost.layer._broken_pair_comm` prices these), per block and
    microbatch against the default split's, Megatron's pair (an all-gather and a reduce-scatter each way:
    `tensor_parallel._block_tp` hands an intact pair's producers one Replicate DTensor, so their input gradients are
    reduce-scattered once), as the trace records them under sequence parallelism (the fake process group's
    collectives are operators of their own)."""
    text = RULED_BLOCKS.rstrip().rstrip("}") + rules + "\n}\n"  # the same text as the broken pairs' test above
    plan = load(text)
    default = _collectives(_trace_of(RULED_BLOCKS))
    ruled = _collectives(_trace_of(text))  # read only: the trace test_the_count_keeps_a_broken_pairs_... made
    passes = plan.model.layers * plan.num_microbatches  # blocks x the microbatches of a step
    assert {label: (ruled.get(label, 0) - default.get(label, 0)) / passes
            for label in set(ruled) | set(default) if ruled.get(label, 0) != default.get(label, 0)} == changed


def test_selective_op_keeps_a_colwise_w2s_own_part_of_its_output():
    """llama's w2 is the 7th matmul of its block, whose output `selective_op` keeps: split along its output features
    (`colwise`) its own part, [tokens, h/t], and no reduce-scatter after it (all-to-all'd to the shards), where the
    default keeps w2's partial sums whole and their reduce-scatter: 2 s·b·h per block less, traced as counted (the
    count kept the default's before). Measured from the loss's backward (llama's norms have no backward operator
    of their own to stop at), so only the change is compared."""
    from plandsl.cost.memory import estimate_layer_activations
    from plandsl.ir.placement import assign_stages
    llama = RULED_BLOCKS.replace("gpt(", "llama(").replace("seed: 0 }", "seed: 0, recompute: selective_op }")

    def saved(text):
        plan = load(text)
        trace = memtrace.trace_rank(plan, 0, 2)
        events, labels = trace.events, trace.labels
        first = next(i for i in range(trace.steps[1], len(events))
                     if events[i][0] > 0 and labels[events[i][1]].startswith("embedding"))
        backward = next(i for i in range(first, len(events)) if events[i][0] > 0 and "backward" in labels[events[i][1]])
        before = trace.live_before(first)
        traced = sum(size for key, size in trace.live_before(backward).items()
                     if key not in before and not _weights_copy(labels[key]))
        layers = assign_stages(plan)[0].stage_layers[0]
        return traced, sum(estimate_layer_activations(plan, layer) for layer in layers if layer.kind == "block")

    traced, counted = saved(llama.rstrip().rstrip("}") + "  shard layers.*.mlp.w2 = colwise over tp\n}\n")
    default_traced, default_counted = saved(llama)
    plan = load(llama)
    sbh = plan.train.micro_batch * plan.seq * plan.model.hidden
    assert traced - default_traced == counted - default_counted == -2 * sbh * plan.model.layers


def _collective_bytes(label: str, tp: int) -> int:
    """The bytes a collective of `_collectives`' `label` moves as `cost.layer` sizes it: its output's, a
    reduce-scatter's input (tp x its output)."""
    shape, dtype = label[label.index("[") + 1:label.index("]")], label.rsplit(" ", 1)[1]
    numel = math.prod(int(size) for size in shape.split(",") if size.strip())
    return numel * getattr(torch, dtype).itemsize * (tp if label.startswith("reduce_scatter") else 1)


def test_full_recomputation_reruns_a_broken_mlp_up_to_its_consumer():
    """Full recomputation reruns the block under torch's checkpoint, which stops once it has remade what the backward
    needs: with w1 whole before a rowwise w2, the attention's input gathered, wo's reduce-scatter and the MLP's input
    gathered again, not w2's reduce-scatter (nothing saves its output): per block and microbatch 3 [b, s, h] tensors'
    bytes, traced as counted (`cost.layer._layer_comm`; 4 counted before, as Megatron's intact pair reruns its whole
    forward: the count keeps that for the default split)."""
    from plandsl.cost.estimate import pipeline_rank_device_types, plan_work, slowest
    from plandsl.cost.layer import estimate_layer_time, plan_links
    from plandsl.ir.placement import assign_stages
    rules = "  shard layers.*.mlp.w1 = { weight: Shard(0) @ dp, bias: Shard(0) @ dp }"
    traced, counted = {}, {}
    for recompute in ("none", "full"):
        plan = load(RULED_BLOCKS.replace("seed: 0 }", f"seed: 0, recompute: {recompute} }}").rstrip().rstrip("}")
                    + rules + "\n}\n")
        found = _collectives(memtrace.trace_rank(plan, 0, 2))
        traced[recompute] = sum(count * _collective_bytes(label, plan.tp) for label, count in found.items())
        block = next(layer for layer in assign_stages(plan)[0].stage_layers[0] if layer.kind == "block")
        device = slowest(pipeline_rank_device_types(plan)[0], plan.train.precision)
        counted[recompute] = estimate_layer_time(plan.model, block, plan_work(plan), device, plan_links(plan)).moved.tensor
    activation = plan.train.micro_batch * plan.seq * plan.model.hidden * 2
    passes = plan.model.layers * plan.num_microbatches
    assert (traced["full"] - traced["none"]) / passes == counted["full"] - counted["none"] == 3 * activation


@pytest.mark.parametrize("global_batch", [16, 4], ids=["four_microbatches", "one_microbatch"])
@pytest.mark.parametrize("rules", ["  shard head = replicate", "  shard head = rowwise over tp"],
                         ids=["replicated_head", "rowwise_head"])
def test_the_count_holds_the_whole_logits_of_a_head_whose_rule_keeps_the_vocabulary_whole(rules, global_batch):
    """A head whose weight is not split along the vocabulary makes the whole logits on every rank, and torch's plain
    cross entropy over them (no loss parallel, `tensor_parallel.splits_logits`): the rank peaks in the loss's backward
    (`cost.memory.loss_backward_bytes`, the head's activations). Traced against counted, MiB: four microbatches a rank,
    replicated 206.1 / 206.7 (142.7 counted before), rowwise 141.7 / 142.4 (78.4 before); one, whose loss's backward
    comes before its backward has made a gradient (`zero_grad` freed the last step's: `cost.memory.one_backward_apart`),
    replicated 184.3 / 184.9, rowwise 131.9 / 132.7 (206.7 and 142.4 counted before, the gradients with them)."""
    from plandsl.cost.memory import estimate_plan_memory
    plan = load(RULED_BLOCKS.replace("gpt(layers=4, hidden=512, heads=8, seq=256, vocab=8192)",
                                     "gpt(layers=2, hidden=256, heads=8, seq=256, vocab=16384)")
                .replace("global_batch: 4,", f"global_batch: {global_batch},").replace(" with sequence_parallel", "")
                .rstrip().rstrip("}") + rules + "\n}\n")
    trace = memtrace.trace_rank(plan, 0, 2)
    peak, at = trace.peak_allocated(trace.steps[0])
    assert plan.num_microbatches == global_batch // 4
    assert trace.labels[trace.events[at][1]].startswith("_log_softmax_backward_data")  # the loss's backward
    assert 1.0 <= estimate_plan_memory(plan)[0].total / peak <= 1.01



def test_a_step_of_one_microbatch_whose_activations_barely_outweigh_its_gradients_counts_adams_step():
    """A step of one microbatch whose activations outweigh its gradients by less than the optimizer's step allocates
    peaks in that step, its gradients alive (`cost.memory.one_backward_apart`, `optimizer_step_bytes`): a one-device
    gpt, fp32 Adam, traced 184.9 MiB at Adam's `div` beside the gradients; counted 157.5 with all 38.2 MiB of its
    gradients left out, 191.1 now (CUDA's `foreach` step takes every second moment's square root at once: 38.2)."""
    from plandsl.cost.memory import estimate_plan_memory
    from tests.support import ONE_MICROBATCH
    plan = load(ONE_MICROBATCH.format(layers=2, hidden=256, seq=192, devices=1, mesh="dp = 1", batch=1, train="",
                                      body=""))
    trace = memtrace.trace_rank(plan, 0, 2)
    peak, at = trace.peak_allocated(trace.steps[0])
    assert trace.labels[trace.events[at][1]].startswith("div.Tensor[16384, 256]")  # Adam's step, not the backward
    assert 1.0 <= estimate_plan_memory(plan)[0].total / peak <= 1.05


PIPELINED_HEAD = """
import "clusters/local"
plan pipelined_head {
  model    = gpt(layers=4, hidden=256, heads=8, seq=256, vocab=16384)
  cluster  = localhost x 8
  mesh     = [dp = 2, pp = 2, tp = 2] over devices[0:8]
  train    = { global_batch: 16, micro_batch: 2, precision: bf16, optimizer: adam, lr: 1e-3, seed: 0 }
  data     = zero1 over dp
  tensor   = megatron over tp
  stages   = evenly over pp
  schedule = 1f1b
  shard head = replicate
}
"""


def test_a_whole_heads_last_stage_keeps_its_whole_logits_till_their_backward():
    """On torch's pipeline the last stage keeps each microbatch's output, the logits, till its backward
    (`cost.memory.torch_stage_bytes`): all of the vocabulary where the head's rule keeps it whole
    (`torch_stage_sizes`). Traced against counted on the last stage, MiB: 217.1 / 217.3 (209.3 before; without the
    rule 133.1 / 133.3)."""
    from plandsl.cost.memory import estimate_plan_memory
    from plandsl.runtime.faults import mesh_coordinate
    plan = load(PIPELINED_HEAD)
    last = next(rank for rank in range(8) if mesh_coordinate(plan, rank)["pp"] == 1)
    trace = memtrace.trace_rank(plan, last, 2)
    assert 1.0 <= estimate_plan_memory(plan)[-1].total / trace.peak_allocated(trace.steps[0])[0] <= 1.01


MLA_UP_PROJ = """
import "clusters/local"
plan mla_up_proj {
  model    = llama(layers=2, hidden=512, heads=8, seq=256, vocab=8192, q_lora_rank=128, kv_lora_rank=64,
                   qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64)
  cluster  = localhost
  mesh     = [dp = 1] over devices[0:1]
  train    = { global_batch: 8, micro_batch: 2, precision: bf16, seed: 0, recompute: selective,
               recompute_modules: [mla_up_proj] }
}
"""


def test_outputs_run_without_output_are_freed_in_the_trace_as_in_a_run():
    """`recompute_modules: [mla_up_proj]` frees Q, K and V after the attention core (`runtime.discard`, a storage
    resized away) and rebuilds them in the backward. On fake tensors the tracer records both without resizing the
    fake storage (resized away and back, a fake storage was never released when its tensors died: every
    microbatch's Q and K stayed in the trace, 56 at this plan's peak, where a real run frees them all); so no Q or K
    outlives its microbatch's backward, and the plan peaks below the same plan recomputing nothing."""
    plan = load(MLA_UP_PROJ)
    trace = memtrace.trace_rank(plan, 0, 2)
    qk = f"cat.default[{plan.train.micro_batch}, {plan.seq}, 8, 64] bfloat16"
    assert not [key for key in trace.live_before(len(trace.events)) if trace.labels[key] == qk]
    plain = memtrace.trace_rank(load(MLA_UP_PROJ.replace("recompute: selective,\n               "
                                                         "recompute_modules: [mla_up_proj]", "recompute: none")), 0, 2)
    assert trace.peak_allocated(trace.steps[0])[0] < plain.peak_allocated(plain.steps[0])[0]
