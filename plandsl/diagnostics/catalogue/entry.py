"""One catalogue entry (`Entry`) and the `Family` each family module fills with its codes' entries.

An example is one file (`file`, `example.plan` unless said otherwise), self-contained
apart from standard-library imports. The fix is a sentence and a list of `(old, new)`
edits that turn the example into a plan without the problem; `fixed` applies them:

    _entry("E501", "why the rule exists", "<example plan>", "what to do, in a sentence",
           ("global_batch: 30", "global_batch: 32"))        # (old, new): each old occurs once

where `_entry = FAMILY.add` and `FAMILY = Family("E5")` in the family's module. Every entry needs
at least one edit (tests/unit/test_diagnostics.py fails, naming the code, when one has none), and
the fixed example must check clean. A diagnostic whose hint is computed carries its own edits
(`Diagnostic.edits`); tests/unit/test_hints.py applies those to the example too.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from plandsl.diagnostics.codes import CODES

# The plan most examples start from: 8 A100s, 2-way data, pipeline and tensor parallel.
GPT = "gpt(layers=4, hidden=256, heads=8, seq=128, vocab=1024)"


def family_of(code: str) -> str:
    """The family a code belongs to: "W" for warnings, else "E" and its hundreds ("E2" for E214)."""
    return "W" if code.startswith("W") else code[:2]


@dataclass(frozen=True)
class Entry:
    code: str
    title: str
    explanation: str
    example: str                               # the text of `file`
    fix: str                                   # what to do, in a sentence
    edits: tuple[tuple[str, str], ...] = ()    # (old, new) replacements: example -> fixed
    file: str = "example.plan"
    encoding: str = "utf-8"                    # how the example is saved (E105: latin-1)
    fixed_encoding: str = "utf-8"
    on_cuda: bool = False                      # E7xx: refused on a machine with CUDA (the example's rendering)
    folders: tuple[str, ...] = ()              # folders next to the example (E107: one named like a plan)
    files: tuple[str, ...] = ()                # empty files next to the example, not its fix (E110: `.plandsl`)
    checkpoint: str = ""                       # E721: the record of a checkpoint in `checkpoints/` beside both
    command: tuple[str, ...] = ()              # E8xx: the command that reports it (`generate --from`, `shrink`)
    fixed_command: tuple[str, ...] = ()        # E710-E715: the command the fix runs (its options fixed), else `command`
    command_line: bool = False                 # E712-E715: the options are wrong, not a line: no location, no caret
    gpus: int = 0                              # E714: the GPUs torch sees where the example runs (0: none)
    lacks: str = ""                            # E717, E719, E812, E815: what the example's machine lacks (`TorchX`, `sbatch`, `Graphviz`, `pygls`), the fix's has
    internal: bool = False                     # E108, E716, E813: no plan triggers it; the example's check has a stage raise (E813: graphviz)
    inspect: bool = False                      # E412-E414: `plandsl inspect FILE.plan` writes its models' tables first

    @property
    def fixed(self) -> str:
        """The example with the fix applied (each `old` occurs exactly once in it)."""
        text = self.example
        for old, new in self.edits:
            text = text.replace(old, new, 1)
        return text

    @property
    def named_file(self) -> str:
        """The example's file as the command line names it (" example.plan"): none for `plandsl lsp` (E815), which an
        editor starts, and which opens the file itself."""
        return "" if self.command[:1] == ("lsp",) else f" {self.file}"

    @property
    def stage(self) -> str:
        return family_of(self.code)


def _text(block: str) -> str:
    return textwrap.dedent(block).strip("\n") + "\n"


def _para(block: str) -> str:
    return " ".join(textwrap.dedent(block).split())


@dataclass
class Family:
    """The entries of one family of codes (`prefix`: "E1" ... "E8", or "W"), in the order written."""
    prefix: str
    entries: list[Entry] = field(default_factory=list)

    def add(self, code: str, explanation: str, example: str, fix: str, *edits: tuple[str, str],
            **options) -> None:
        """One entry: the title from `CODES`, explanation and fix as one paragraph each, the example dedented."""
        self.entries.append(Entry(code, CODES[code], _para(explanation), _text(example), _para(fix), tuple(edits),
                                  **options))
