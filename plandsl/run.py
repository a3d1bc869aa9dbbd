"""The torchrun entry point: `torchrun --nproc-per-node N -m plandsl.run PLAN [--steps S] [--resume] ...`.

Every rank loads and checks the plan, builds the model, mesh and parallelisms, and trains; `plandsl run`
launches this same module through torch.distributed.run. Exit status: 0, or 1 (bad plan, refused
feature, a checkpoint this plan cannot resume, failed equivalence, or an error on this rank, reported
with the rank's number).
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import traceback


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m plandsl.run", description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="the .plan file")
    parser.add_argument("--plan", dest="plan_name", help="which plan of the file (default: its only one)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="set a `param` of the file")
    parser.add_argument("--include", action="append", default=[], metavar="DIR",
                        help="imports may also come from DIR (as `plandsl run --include`)")
    parser.add_argument("--steps", type=_positive, default=10,
                        help="the step to stop at, counted from the start of training (default 10)")
    parser.add_argument("--metrics", help="write one JSON object per step to this file (rank 0)")
    parser.add_argument("--check-equivalence", action="store_true",
                        help="compare losses and final parameters with a one-process run")
    parser.add_argument("--data", help="a uint16 token file (nanoGPT train.bin) instead of synthetic tokens")
    parser.add_argument("--timeout", type=float, default=None, help="seconds a collective may wait")
    parser.add_argument("--checkpoint-dir", help="write checkpoints here (step-NNNNNN directories), and after "
                                                 "the last step")
    parser.add_argument("--checkpoint-every", type=_positive, metavar="K", help="a checkpoint every K steps")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir (step 1 if none)")
    args = parser.parse_args(argv)
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        parser.error(f"{'--resume' if args.resume else '--checkpoint-every'} needs --checkpoint-dir")
    from plandsl.syntax.files import writable_dir, writable_file
    for option, path, problem in (("--metrics", args.metrics, writable_file),
                                  ("--checkpoint-dir", args.checkpoint_dir, writable_dir)):
        reason = problem(path) if path else None
        if reason:  # before the job is built: every rank says so and exits 2, none trains
            parser.error(f"{option} {path}: cannot write: {reason}")
    return args


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints a hung rank's stacks
    from plandsl import api
    from plandsl.diagnostics import PlanError
    from plandsl.syntax.loader import include
    try:
        with include(args.include):
            plan = api.load_runnable(args.plan, args.plan_name, _params(args.param))  # E7xx: refused
    except PlanError as error:
        print(error, file=sys.stderr)
        return 1
    from plandsl.runtime.parallel.mesh import DEFAULT_TIMEOUT_S
    from plandsl.runtime.train import RunConfig, main_error, run
    from plandsl.runtime.checkpoint import CheckpointError
    config = RunConfig(steps=args.steps, metrics=args.metrics, check_equivalence=args.check_equivalence,
                       token_file=args.data, timeout_s=args.timeout or DEFAULT_TIMEOUT_S,
                       checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                       resume=args.resume)
    try:
        status, job = run(plan, config)
    except CheckpointError as error:  # every rank refuses alike, before training; rank 0 says why
        if os.environ.get("RANK", "0") == "0":
            print(f"plandsl run: error: {error}", file=sys.stderr, flush=True)
        return 1
    except Exception as error:  # noqa: BLE001 - one line naming the rank, then a non-zero exit
        main_error(error)
        raise
    _KEEP.append(job)  # alive until `entry` exits the process
    return status


_KEEP: list = []


def entry() -> None:
    """Run `main` and leave without tearing torch.distributed down.

    Destroying a gloo process group from Python joins its worker threads while holding the GIL;
    a worker still releasing its last collective's tensors needs the GIL, and the rank hangs
    (seen with torch 2.13 at the end of a run, e.g. DDP's Reducer dropping its group). The rank is
    done, so it flushes its output and exits at once; the launcher and peers see a clean exit.
    """
    status = 1
    try:
        status = main()
    except SystemExit as error:
        status = error.code if isinstance(error.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed like Python would, then exit 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _params(items: list[str]) -> dict:
    from plandsl.cli import _params as parse
    return parse(tuple(items))


if __name__ == "__main__":
    entry()
