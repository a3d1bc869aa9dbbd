"""The arguments every rank takes (`python -m plandsl.run PLAN ...`), defined once: `plandsl.run` parses
them on each rank and the launcher reads back the plan its ranks ran; `--param KEY=VALUE` values are
parsed here for every command."""
from __future__ import annotations

import argparse


def parse_params(items) -> dict:
    """`KEY=VALUE` items -> {key: value}; values `true`/`false`, integers and floats become those types.
    ValueError names the item that is not KEY=VALUE."""
    params = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"'{item}' is not KEY=VALUE")
        params[key.strip()] = _scalar(raw.strip())
    return params


def _scalar(raw: str):
    if raw in ("true", "false"):
        return raw == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m plandsl.run", description="The torchrun entry point: `torchrun "
                                     "--nproc-per-node N -m plandsl.run PLAN [--steps S] [--resume] ...`.")
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
