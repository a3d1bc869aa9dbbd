"""E6xx: schedules, built in and written as tables or templates.

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import GPT, Family

FAMILY = Family("E6")
_entry = FAMILY.add


_entry("E601", """
    The plan names a pipeline schedule that is neither built in (gpipe, 1f1b,
    interleaved_1f1b, looped_bfs, zb_h1, zb_h2, interleaved_zero_bubble, zbv,
    dualpipev, chimera) nor defined with `schedule NAME(...) { ... }` in scope.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 2, tp = 2]
      train    = {{ global_batch: 16, micro_batch: 1 }}
      stages   = evenly over pp with virtual = 2
      schedule = interleaved
    }}
    """, "Use the schedule's full name.", ("= interleaved\n", "= interleaved_1f1b\n"))

_SCHEDULE_PLAN = """
    import "clusters/local"
    schedule mine(ranks = 2, microbatches = 2) {{
    {rows}
    }}
    plan p {{
      model    = gpt(layers=4, hidden=64, heads=4, seq=32, vocab=256)
      cluster  = localhost
      mesh     = [pp = 2] over devices[0:2]
      train    = {{ global_batch: 2, micro_batch: 1, precision: fp32 }}
      schedule = mine
    }}
    """


def _schedule_example(rank0: str, rank1: str) -> str:
    return _SCHEDULE_PLAN.format(rows=f"  rank 0: {rank0}\n      rank 1: {rank1}")


_entry("E602", """
    A written schedule names a stage or a microbatch the plan does not have: with the
    plan's global batch, data-parallel size and micro-batch there are m microbatches
    (0..m-1), and pp x virtual stages. Such an action could never be fed with data.
    A cell of a schedule CSV that reads as no action (`plandsl import --from torch-csv`, `plandsl schedule
    FILE.csv`) is this error too, at that cell (its line counted as torch's csv module counts them).
    """, _schedule_example("0F0 0F1 0B0 0B1 0F2", "1F0 1B0 1F1 1B1"),
    "Remove the action, or raise the microbatch count of the plan and the table together.",
    (" 0F2\n", "\n"))

_entry("E603", """
    Every stage must run a forward and a backward (or an input-gradient and a
    weight-gradient action) for every microbatch; otherwise some gradients are never
    computed and the step is not the step one device would take. In torch's schedule
    CSV every rank's row holds an action too: torch reads each line as a rank's row,
    a blank one as a rank with none, and refuses it.
    """, _schedule_example("0F0 0F1 0B0 0B1", "1F0 1B0 1F1"),
    "Add the missing action.", ("1F0 1B0 1F1\n", "1F0 1B0 1F1 1B1\n"))

_entry("E604", """
    An action appears twice. Running a forward or backward twice for one microbatch
    would double its gradient contribution (or overwrite the stored activations).
    """, _schedule_example("0F0 0F1 0B0 0B1 0B1", "1F0 1B0 1F1 1B1"),
    "Remove the repeated action.", (" 0B1 0B1\n", " 0B1\n"))

_entry("E605", """
    On one rank an action comes before an action it depends on: a backward before the
    forward it differentiates, a weight gradient before its input gradient, or a stage
    before the stage that feeds it when both live on this rank. A rank runs its row in
    order, so this can never execute.
    """, _schedule_example("0F0 0B1 0F1 0B0", "1F0 1B0 1F1 1B1"),
    "Put the forward first.", ("0F0 0B1 0F1 0B0", "0F0 0F1 0B0 0B1"))

_entry("E606", """
    Run with blocking receives (as torch's schedule runtime runs it), every rank would
    end up waiting for an action that another waiting rank runs only later: the job
    would hang on the first step. The diagnostic lists every stuck rank and what it
    waits for.
    """, _schedule_example("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"),
    "Let the last stage process microbatches in the order they arrive.",
    ("1F1 1B1 1F0 1B0", "1F0 1B0 1F1 1B1"))

_entry("E607", """
    A stage's actions appear on two ranks. A stage's weights live on one rank, so every
    action of the stage must be in that rank's row (V-shape and interleaved maps give a
    rank several stages, never a stage several ranks).
    """, _schedule_example("0F0 0F1 0B0 0B1 1F1 1B1", "1F0 1B0 1F1 1B1"),
    "Remove the actions from the other rank's row.", (" 0B1 1F1 1B1\n", " 0B1\n"))

_entry("E608", """
    A user-defined schedule is written either as a table (`rank 0: 0F0 0B0 ...` rows,
    with fixed sizes such as `ranks = 2`) or as a template (loops over variables such
    as `p: ranks, m: microbatches` that work for any size), not a mix of both: a table
    has no variables to loop over.
    """, """
    schedule mine(p: ranks, m: microbatches) {
      rank 0: 0F0 0F1 0B0 0B1
      rank 1: _ 1F0 1B0 1F1 1B1
    }
    """, "Make it a table with fixed sizes.", ("p: ranks, m: microbatches", "ranks = 2, microbatches = 2"))

_entry("E609", """
    A written schedule is laid out action by action for the plan's sizes before it is
    validated, and a valid one holds at least F and B for every stage and microbatch.
    Past 500,000 actions (`MAX_ACTIONS`) the template is not run: its table would take
    longer to lay out and check than the plan is worth. Built-in schedules are checked
    and estimated without laying them out, for any microbatch count, and `plandsl simulate`
    gives their figures past the cap by extrapolating the steady state from a run of a few
    rounds of the pipeline's stages' microbatches; a pipeline so deep (pp x virtual in the
    hundreds of stages: 256, say) that this run alone passes the cap is E609 in `estimate`
    and `simulate` too (`check` accepts it), the hint naming the microbatch count that is
    simulated whole; printing, drawing or
    tracing every action (`plandsl schedule`, `render --view schedule`, `simulate --trace`)
    has the same cap. The error points at the plan's `schedule =` line, with notes at the
    definition and at where the microbatch count comes from.
    """, """
    import "clusters/dgx_a100"
    schedule flush(p: ranks, m: microbatches) {
      for r in 0..p on rank r {
        for i in 0..m { F(r, i) }
        for i in 0..m { B(r, i) }
      }
    }
    plan p {
      model    = gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 4]
      train    = { global_batch: 200000, micro_batch: 1 }
      schedule = flush
    }
    """, "Use a built-in schedule, which needs no table to check, or fewer microbatches (a larger micro_batch or a smaller global_batch).",
       ("schedule = flush", "schedule = 1f1b"))

_entry("E610", """
    `stages = ... with implementation = megatron` says the plan is Megatron-LM's pipeline
    (`megatron.core.pipeline_parallel.schedules`), whose memory the estimate counts: an
    output freed once sent, one receive at a time, none of torch's per-microbatch buffers.
    Megatron-LM runs two schedules: 1F1B (`forward_backward_pipelining_without_interleaving`)
    and, with virtual stages, interleaved 1F1B (`..._with_interleaving`). Any other schedule,
    or one written in the plan, is torch's to run: the plan cannot say Megatron-LM runs it.
    Likewise `implementation = deepspeed` (DeepSpeed's pipeline engine, `deepspeed/runtime/pipe`)
    runs one schedule, its TrainSchedule, a 1F1B: `schedule = 1f1b`; and `implementation = dualpipe`
    (DeepSeek's DualPipe, deepseek-ai/DualPipe's `DualPipeV`, whose `step` lays out its own order)
    runs `schedule = dualpipev` alone.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 2, tp = 2]
      train    = {{ global_batch: 16, micro_batch: 1 }}
      stages   = evenly over pp with implementation = megatron
      schedule = gpipe
    }}
    """, "Use a schedule Megatron-LM runs, or torch's pipeline.", ("schedule = gpipe", "schedule = 1f1b"))

_entry("E611", """
    `stages = ... with implementation = deepspeed` says the plan is DeepSpeed's pipeline engine
    (`deepspeed/runtime/pipe/engine.py`, as Megatron-DeepSpeed ran BLOOM and MT-NLG), which asserts
    `zero_optimization_stage() < 2`: it reduces the gradients itself after its schedule, so it takes
    replicated data parallelism or ZeRO-1 (optimizer states sharded), never ZeRO-2 or -3. Its tensor-parallel
    ranks each send 1/tp of a stage's output and gather it whole on arrival (`PartitionedTensor`): it runs no
    sequence parallelism either (`tensor = megatron over tp with sequence_parallel` beside it is E611 too).
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model    = {GPT}
      cluster  = dgx_a100 x 1
      mesh     = [dp = 2, pp = 2, tp = 2]
      train    = {{ global_batch: 16, micro_batch: 1 }}
      data     = zero2 over dp
      stages   = evenly over pp with implementation = deepspeed
      schedule = 1f1b
    }}
    """, "Shard only the optimizer states (ZeRO-1), or run torch's pipeline.", ("data     = zero2", "data     = zero1"))
