"""The options of `plandsl run` that every rank takes (`python -m plandsl.run PLAN ...`), defined once.

Stage: interpreter (both sides). Contract: `RANK_OPTIONS` is the one table of them; `parse_args` builds
each rank's argparse parser from it, the CLI builds `plandsl run`'s click options from it
(`plandsl.api.rank_options`), and the launcher forwards the values given to `plandsl run` to the ranks
with `forward`, in the table's order: an option added to the table is accepted, forwarded and parsed on
every side. `option_problem` is the rule between options both sides apply. `--param KEY=VALUE` values
are parsed here for every command (`parse_params`).
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any, Mapping

from plandsl.diagnostics.limits import MAX_STEPS, MAX_TIMEOUT_SECONDS

DEVICES = ("cpu", "cuda")
"""`--device`; not given, cuda where `torch.cuda.is_available()`, else cpu (`parallel.mesh.resolve_device`)."""


@dataclass(frozen=True)
class RankOption:
    flag: str
    dest: str
    help: str
    kind: str = "str"
    """str, int, float, flag (present or not), or list (repeatable)."""
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    metavar: str | None = None
    path: str | None = None
    """out_file, out_dir (checked writable before any work) or token_file (a regular file that exists)."""
    each_command: bool = False
    """The CLI gives it to every command that loads plans (`--plan`, `--param`, `--include`), not only run."""
    choices: tuple[str, ...] | None = None
    """The values a str option may take (None: any)."""


RANK_OPTIONS: tuple[RankOption, ...] = (
    RankOption("--steps", "steps", "The step to stop at, counted from the start of training (also with --resume).",
               "int", 10, 1, MAX_STEPS),
    RankOption("--plan", "plan_name", "The plan of the file to run."),
    RankOption("--param", "param", "Set a `param` of the file (repeatable).", "list", metavar="KEY=VALUE",
               each_command=True),
    RankOption("--include", "include", "Imports may also come from DIR (repeatable; also PLANDSL_PATH).", "list",
               metavar="DIR", each_command=True),
    RankOption("--metrics", "metrics", "Write one JSON object per step here.", path="out_file"),
    RankOption("--check-equivalence", "check_equivalence", "Compare losses and parameters with one process.",
               "flag", False),
    RankOption("--data", "data", "A uint16 token file (nanoGPT .bin), or a Hugging Face dataset saved to disk "
               "(its `input_ids`).", path="token_file"),
    RankOption("--timeout", "timeout", "Seconds a collective may wait before the job fails (default 300).",
               "float", minimum=1, maximum=MAX_TIMEOUT_SECONDS, metavar="SECONDS"),
    RankOption("--checkpoint-dir", "checkpoint_dir",
               "Write checkpoints here (step-NNNNNN directories), always after the last step.", path="out_dir"),
    RankOption("--checkpoint-every", "checkpoint_every", "A checkpoint every K steps.", "int", minimum=1,
               metavar="K"),
    RankOption("--resume", "resume", "Continue from the latest checkpoint in --checkpoint-dir.", "flag", False),
    RankOption("--device", "device", "Where the ranks compute: cuda (one GPU per process, nccl) or cpu (gloo); "
               "default: cuda when this machine has a GPU.", choices=DEVICES),
)


def option_problem(values: Mapping[str, Any]) -> str | None:
    """Options that need another one: --resume and --checkpoint-every need --checkpoint-dir."""
    if (values.get("resume") or values.get("checkpoint_every")) and not values.get("checkpoint_dir"):
        return f"{'--resume' if values.get('resume') else '--checkpoint-every'} needs --checkpoint-dir"
    return None


def forward(values: Mapping[str, Any]) -> list[str]:
    """The rank arguments that give each option its value in `values` (by `dest`; absent, None, False or
    empty: not given), in the table's order."""
    args: list[str] = []
    for option in RANK_OPTIONS:
        value = values.get(option.dest)
        if value is None or value is False or (option.kind == "list" and not value):
            continue
        if option.kind == "flag":
            args.append(option.flag)
        elif option.kind == "list":
            for item in value:
                args += [option.flag, str(item)]
        else:
            args += [option.flag, str(value)]
    return args


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


def format_params(params: Mapping[str, Any]) -> list[str]:
    """{key: value} -> `KEY=VALUE` items that `parse_params` reads back as the same values."""
    return [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in params.items()]


_INT = re.compile(r"[-+]?[0-9][0-9_]*")
_FLOAT = re.compile(r"[-+]?(?:[0-9][0-9_]*\.[0-9][0-9_]*(?:[eE][+-]?[0-9]+)?|[0-9][0-9_]*[eE][+-]?[0-9]+)")
"""A `--param` number as the language writes one (grammar/plan.lark's INT and FLOAT, signed): int() and float()
alone also took `١` (an Arabic-Indic one) as 1, `nan`, `inf` and ` 8 `, which no plan reads as a number."""


def _scalar(raw: str):
    if raw in ("true", "false"):
        return raw == "true"
    if _INT.fullmatch(raw):
        return int(raw.replace("_", ""))  # `1_000` as the language reads it (and `1_`: its grammar allows it)
    if _FLOAT.fullmatch(raw):
        return float(raw.replace("_", ""))
    return raw


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m plandsl.run", description="The torchrun entry point: `torchrun "
                                     "--nproc-per-node N -m plandsl.run PLAN [--steps S] [--resume] ...`.")
    parser.add_argument("plan", help="the .plan file")
    for option in RANK_OPTIONS:
        if option.kind == "flag":
            parser.add_argument(option.flag, dest=option.dest, action="store_true", help=option.help)
        elif option.kind == "list":
            parser.add_argument(option.flag, dest=option.dest, action="append", default=[], metavar=option.metavar,
                                help=option.help)
        else:
            parser.add_argument(option.flag, dest=option.dest, type=_typed(option), default=option.default,
                                metavar=option.metavar, choices=option.choices, help=option.help)
    args = parser.parse_args(argv)
    problem = option_problem(vars(args))
    if problem:
        parser.error(problem)
    # lazy: ranks only; `plandsl --help` builds its options from this module
    from plandsl.runtime.tokens import data_path_problem  # lazy: numpy; `plandsl --help` reads this module
    from plandsl.syntax.files import writable_dir, writable_file  # lazy: ranks only, as above
    checks = {"out_file": writable_file, "out_dir": writable_dir, "token_file": data_path_problem}
    for option in RANK_OPTIONS:
        path = getattr(args, option.dest)
        reason = checks[option.path](path) if option.path and path else None
        if reason:  # before the job is built: every rank says so and exits 2, none trains
            parser.error(f"{option.flag} {path}: cannot {'read' if option.path == 'token_file' else 'write'}: {reason}")
    return args


def _typed(option: RankOption):
    """argparse's `type` for an int or float option, with the table's bounds."""
    kind = {"int": int, "float": float, "str": str}[option.kind]

    def convert(text: str):
        value = kind(text)
        if value != value:  # NaN, which no range refuses
            raise argparse.ArgumentTypeError(f"{text} is not a number")
        if option.minimum is not None and value < option.minimum or option.maximum is not None and value > option.maximum:
            raise argparse.ArgumentTypeError(f"{value} is not in the range {option.minimum} to {option.maximum}")
        return value
    convert.__name__ = option.kind  # argparse names the type in its message: "invalid int value"
    return convert
