"""The torchrun entry point: `torchrun --nproc-per-node N -m plandsl.run PLAN [--steps S] [--resume] ...`.

Every rank loads and checks the plan, builds the model, mesh and parallelisms, and trains; `plandsl run`
launches this same module through torch.distributed.run. Exit status: 0, or 1 (bad plan, refused
feature, a checkpoint this plan cannot resume, failed equivalence, or an error on this rank, reported
with the rank's number).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
from plandsl.runtime.leave import run_then_leave
from plandsl.runtime.options import parse_args, parse_params
from plandsl import api
from plandsl.diagnostics import PlanError
from plandsl.syntax.loader import include


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints a hung rank's stacks
    try:
        with include(args.include):
            plan = api.load_runnable(args.plan, args.plan_name, parse_params(args.param),  # E7xx: refused
                                     cuda=args.device and args.device == "cuda")
    except PlanError as error:
        print(error, file=sys.stderr)
        from plandsl.runtime.faults import report_refusal  # lazy: the schedules' simulator (0.3 s), on a refusal only
        report_refusal(error.diagnostics[0].code if error.diagnostics else "E108")
        return 1
    # lazy: torch after the plan checked (a bad plan fails without torch's seconds of import)
    from plandsl.runtime.parallel.mesh import DEFAULT_TIMEOUT_S
    from plandsl.runtime.train import RunConfig, main_error, run  # lazy: torch (as above)
    from plandsl.runtime.checkpoint import CheckpointError  # lazy: torch (as above)
    config = RunConfig(steps=args.steps, metrics=args.metrics, check_equivalence=args.check_equivalence,
                       token_file=args.data, timeout_s=args.timeout or DEFAULT_TIMEOUT_S,
                       checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                       resume=args.resume, device=args.device)
    try:
        status, job = run(plan, config)
    except CheckpointError as error:  # every rank refuses alike, before training; rank 0 says why (E721)
        if os.environ.get("RANK", "0") == "0":
            print(api.resume_refusal(plan, error), file=sys.stderr, flush=True)
        from plandsl.runtime.faults import report_refusal  # lazy: as above
        report_refusal("E721")
        return 1
    except Exception as error:  # noqa: BLE001 - one line naming the rank, then a non-zero exit
        main_error(error)
        raise
    _KEEP.append(job)  # alive until `entry` exits the process
    return status


_KEEP: list = []


def entry() -> None:
    """Run `main` and leave without tearing torch.distributed down (`runtime.leave` says why)."""
    run_then_leave(main)



if __name__ == "__main__":
    entry()
