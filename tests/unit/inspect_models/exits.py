"""Factories for tests/unit/test_inspect.py that end the interpreter (sys.exit, as argparse does on a bad
argument) while they are imported, called, or while the model they return runs its forward."""
import sys

from torch import nn

from inspect_models.tiny import Tiny


def build(code: int = 0):
    sys.exit(code)


def parse_args():
    import argparse
    argparse.ArgumentParser(prog="train").parse_args(["--no-such-flag"])  # exits 2, its usage on stderr


class Leaves(Tiny):
    def forward(self, tokens):
        sys.exit("done")


def leaves() -> nn.Module:
    return Leaves(100, 32, 64, 2)
