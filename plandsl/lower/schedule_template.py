"""Schedules written in the language -> the schedule IR, for the sizes of one plan.

A table (`schedule t(ranks = 2, microbatches = 3) { rank 0: 0F0 0F1 _ 0B0 ... }`) is
taken as written: its rows are the actions of each rank, `_` cells are idle alignment
and dropped from the order; its declared sizes must equal the plan's. A template
(`schedule s(p: ranks, m: microbatches) { for r in 0..p on rank r { ... } }`) binds its
variables to the plan's sizes (ranks, microbatches, virtual, stages = ranks x virtual)
and runs its body: `for x in a..b [on rank r]`, `on rank r { }`, `if`/`else`, `let`, and
the action statements `F(stage, mb)`, `B(...)`, `I(...)`, `W(...)`, each appended to the
current rank. Arithmetic is the language's own (`plandsl.lower.evaluate.Scope`); any error
while running a template is E608 at the expression that failed.

Every emitted action remembers where it was written (`Instance.spans`), so that
`plandsl.schedules.validate` points its diagnostics at the source. The stage -> rank map
is derived from where each stage's actions appear (the rank holding most of them); a
stage that also appears elsewhere is E607, reported by the validation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plandsl import ir
from plandsl import syntax as s
from plandsl.diagnostics import Diagnostic, Note, PlanError
from plandsl.lower.evaluate import Poison, Reporter, Scope
from plandsl.schedules.generators import MAX_ACTIONS  # a template needs at most this many (E609)
from plandsl.schedules.program import Action, Kind, Schedule, derive_stage_map, parse_action
from plandsl.diagnostics.source import NO_SPAN, SourceFile, Span
from plandsl.syntax.parser import parse_source

MAX_STEPS = 10_000_000     # statements and loop iterations run by one instantiation
ACTION_KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}


@dataclass
class Instance:
    """A schedule definition instantiated for one plan's sizes."""
    schedule: Schedule | None
    spans: dict[tuple[int, int], Span] = field(default_factory=dict)  # (rank, index) -> where written
    diagnostics: list[Diagnostic] = field(default_factory=list)


def instantiate(defn: ir.ScheduleDef, scope: Scope | None, ranks: int, microbatches: int,
                virtual: int = 1) -> tuple[Schedule | None, list[Diagnostic]]:
    """The schedule `defn` describes for `ranks` x `microbatches` (x `virtual` stages per rank),
    and every problem found: instantiation errors (E608, the schedule is then None) and the
    validation of the result (E602-E607, with the schedule returned)."""
    instance = expand(defn, scope, ranks, microbatches, virtual)
    return instance.schedule, instance.diagnostics


def expand(defn: ir.ScheduleDef, scope: Scope | None, ranks: int, microbatches: int, virtual: int = 1,
           validate: bool = True) -> Instance:
    """Like `instantiate`, keeping the span of every action; `validate=False` skips E602-E607."""
    where = defn.span or NO_SPAN
    sizes = {"ranks": ranks, "microbatches": microbatches, "virtual": virtual, "stages": ranks * virtual}
    if min(ranks, microbatches, virtual) < 1:
        return Instance(None, {}, [Diagnostic(
            "E608", f"schedule '{defn.name}' needs at least 1 rank, 1 microbatch and 1 stage per rank, but the "
                    f"plan has {_sizes_text(sizes)}", where)])
    definition, source = _definition(defn, scope)
    problems = _size_mismatches(defn, definition, sizes, where)
    if problems:
        return Instance(None, {}, problems)
    least = 2 * sizes["stages"] * microbatches  # F and B per stage and microbatch, at least
    if defn.kind != "table" and least > MAX_ACTIONS:
        return Instance(None, {}, [Diagnostic(
            "E609", f"schedule '{defn.name}' for {_sizes_text(sizes)} needs at least {least:,} actions (F and B for "
                    f"each of {sizes['stages']:,} stages x {microbatches:,} microbatches), more than the "
                    f"{MAX_ACTIONS:,} a written schedule is laid out with", where,
            "lower global_batch or raise micro_batch (fewer microbatches), or use a built-in schedule, which "
            "`plandsl check` and `plandsl estimate` need not lay out")])
    try:
        if defn.kind == "table":
            rows, spans = _table(defn, definition, sizes, where)
        else:
            if definition is None or definition.body is None:
                raise _Fail(Diagnostic("E608", f"schedule '{defn.name}': the template's text is not available",
                                       where))
            rows, spans = _Runner(defn, definition, scope, sizes, source).run()
    except _Fail as failure:
        return Instance(None, {}, [failure.diagnostic])
    schedule = Schedule(defn.name, ranks, sizes["stages"], microbatches,
                        (derive_stage_map(rows, ranks, sizes["stages"]),),
                        tuple(tuple(row) for row in rows))
    diagnostics: list[Diagnostic] = []
    if validate:
        # lazy: ~7 ms, only a plan with a written template needs it
        from plandsl.schedules.validate import validate as check
        diagnostics = check(schedule, spans, default_span=where)
    return Instance(schedule, spans, diagnostics)


# ---- helpers ------------------------------------------------------------------------------
class _Fail(Exception):
    def __init__(self, diagnostic: Diagnostic):
        self.diagnostic = diagnostic


def _sizes_text(sizes: dict[str, int]) -> str:
    return f"ranks = {sizes['ranks']}, microbatches = {sizes['microbatches']}, virtual = {sizes['virtual']}"


def _size_mismatches(defn: ir.ScheduleDef, definition: s.Definition | None, sizes: dict[str, int],
                     where: Span) -> list[Diagnostic]:
    written = {p.name: p.span for p in definition.params} if definition is not None else {}
    out = []
    for name, declared in defn.sizes.items():
        wanted = sizes.get(name)
        if wanted is not None and declared != wanted:
            span = written.get(name, where)
            out.append(Diagnostic(
                "E608", f"schedule '{defn.name}' is written for {name} = {declared}, but the plan has "
                        f"{name} = {wanted}", span,
                hint="a table fits one size only: write it for the plan's sizes, or make it a template "
                     "(`schedule name(p: ranks, m: microbatches) { ... }`)"))
    return out


def _definition(defn: ir.ScheduleDef, scope: Scope | None) -> tuple[s.Definition | None, SourceFile | None]:
    """The syntax of the definition (kept by the lowering, else parsed again from its text) and
    the text it was parsed from, laid out so that its offsets are those of the original file."""
    span = defn.span if defn.span is not None else NO_SPAN
    whole = getattr(scope, "source", None) if scope is not None else None
    if whole is not None and span is not NO_SPAN and whole.path == span.file and span.end > span.start:
        text = whole.text[span.start:span.end]
    else:
        text = defn.source
    if not text:
        return (defn.syntax if isinstance(defn.syntax, s.Definition) else None), None
    if span is not NO_SPAN and span.line >= 1 and span.start >= (span.line - 1) + (span.column - 1):
        # pad so that offsets, lines and columns of the re-parse are those of the original file
        before = span.start - (span.column - 1) - (span.line - 1)
        source = SourceFile(span.file, " " * before + "\n" * (span.line - 1) + " " * (span.column - 1) + text)
    else:
        source = SourceFile("<schedule>", text)
    if isinstance(defn.syntax, s.Definition):
        return defn.syntax, source
    try:
        module = parse_source(source)
    except PlanError:
        return None, source
    found = next((item for item in module.items if isinstance(item, s.Definition) and item.kind == "schedule"
                  and item.name == defn.name), None)
    return found, source


def _table(defn: ir.ScheduleDef, definition: s.Definition | None, sizes: dict[str, int], where: Span):
    ranks = sizes["ranks"]
    written: dict[int, tuple[tuple[str, ...], tuple[Span, ...]]] = {}
    if definition is not None and definition.body is not None:
        for row in definition.body:
            if isinstance(row, s.RankRow):
                cell_spans = row.cell_spans or (row.span,) * len(row.cells)
                written[row.rank] = (row.cells, cell_spans)
    else:
        for rank, cells in enumerate(defn.rows):
            written[rank] = (cells, (where,) * len(cells))
    extra = sorted(r for r in written if r >= ranks)
    if extra:
        span = next((sp for sp in written[extra[0]][1]), where)
        raise _Fail(Diagnostic("E608", f"schedule '{defn.name}' has a row for rank {extra[0]}, but the plan "
                                       f"has {ranks} pipeline ranks (0..{ranks - 1})", span))
    rows: list[list[Action]] = [[] for _ in range(ranks)]
    spans: dict[tuple[int, int], Span] = {}
    for rank, (cells, cell_spans) in written.items():
        for cell, span in zip(cells, cell_spans):
            if cell == "_":
                continue
            try:
                action = parse_action(cell)
            except ValueError as error:
                raise _Fail(Diagnostic("E608", str(error), span)) from None
            spans[(rank, len(rows[rank]))] = span
            rows[rank].append(action)
    return rows, spans


class _Runner:
    """Runs a template's body, one statement at a time."""

    def __init__(self, defn: ir.ScheduleDef, definition: s.Definition, scope: Scope | None,
                 sizes: dict[str, int], source: SourceFile | None = None):
        self.defn = defn
        self.definition = definition
        self.sizes = sizes
        self.reporter = Reporter()
        file = definition.span.file if definition.span is not NO_SPAN else "<schedule>"
        if scope is None:
            base = Scope(self.reporter, file, _no_definitions)
        else:
            base = scope.with_locals({})
            base.reporter = self.reporter  # errors here become E608, not the lowering's
        if base.source is None and source is not None:
            base.source = source  # for messages that quote the arithmetic
        self.values = {name: sizes[dimension] for name, dimension in defn.variables.items()
                       if dimension in sizes}
        for param in definition.params:  # the syntax wins where the IR dropped a bad dimension
            if param.dimension in sizes:
                self.values.setdefault(param.name, sizes[param.dimension])
        self.scope = base.with_locals(self.values)
        self.rows: list[list[Action]] = [[] for _ in range(sizes["ranks"])]
        self.spans: dict[tuple[int, int], Span] = {}
        expected = 3 * sizes["stages"] * sizes["microbatches"]
        self.max_actions = min(2 * MAX_ACTIONS, max(10_000, 8 * expected))
        self.max_steps = min(MAX_STEPS, max(100_000, 64 * expected))
        self.actions = 0
        self.steps = 0

    def fail(self, message: str, span: Span, hint: str | None = None, notes=()) -> _Fail:
        label = ", ".join(f"{name} = {value}" for name, value in self.values.items())
        prefix = f"schedule '{self.defn.name}'" + (f" ({label})" if label else "")
        return _Fail(Diagnostic("E608", f"{prefix}: {message}", span or NO_SPAN, hint, tuple(notes)))

    def run(self):
        try:
            self.block(self.definition.body, self.scope, None)
        except RecursionError:
            raise self.fail("statements nested too deeply", self.definition.span) from None
        return self.rows, self.spans

    # evaluation, with the language's errors turned into E608
    def _evaluated(self, thunk, expr: s.Expr):
        try:
            return thunk()
        except Poison:
            found = self.reporter.diagnostics[-1] if self.reporter.diagnostics else None
            self.reporter.diagnostics.clear()
            if found is None:
                raise self.fail("this expression has no value", expr.span) from None
            notes = (Note(f"reported by the language as {found.code}"),) + found.notes
            raise self.fail(found.message, found.span if found.span is not NO_SPAN else expr.span,
                            found.hint, notes) from None

    def integer(self, scope: Scope, expr: s.Expr, what: str) -> int:
        return self._evaluated(lambda: scope.integer(expr, what), expr)

    def truth(self, scope: Scope, expr: s.Expr) -> bool:
        return self._evaluated(lambda: scope.truth(scope.eval(expr), expr), expr)

    def value(self, scope: Scope, expr: s.Expr) -> Any:
        if isinstance(expr, s.BinOp) and expr.op == "..":
            return self.range(scope, expr)
        return self._evaluated(lambda: scope.eval(expr), expr)

    def range(self, scope: Scope, expr: s.Expr) -> range:
        if isinstance(expr, s.BinOp) and expr.op == "..":
            lo = self.integer(scope, expr.left, "the start of a range")
            hi = self.integer(scope, expr.right, "the end of a range")
            return range(lo, hi)
        if isinstance(expr, s.Name) and isinstance(scope.locals.get(expr.id), range):
            return scope.locals[expr.id]
        raise self.fail("a loop runs over a range `a..b`", expr.span, hint="for i in 0..m { ... }")

    def rank(self, scope: Scope, expr: s.Expr) -> int:
        rank = self.integer(scope, expr, "a rank")
        ranks = self.sizes["ranks"]
        if not 0 <= rank < ranks:
            raise self.fail(f"rank {rank} does not exist: the plan has {ranks} pipeline ranks (0..{ranks - 1})",
                            expr.span)
        return rank

    def tick(self, span: Span, count: int = 1) -> None:
        self.steps += count
        if self.steps > self.max_steps:
            raise self.fail(f"the template runs more than {self.max_steps:,} steps: does a loop run too long?",
                            span, hint="loops should run over ranks, stages and microbatches")

    # statements
    def block(self, body, scope: Scope, rank: int | None) -> None:
        for stmt in body:
            self.tick(stmt.span)
            if isinstance(stmt, s.Let):
                scope = scope.with_locals({stmt.name: self.value(scope, stmt.value)})
            elif isinstance(stmt, s.ActionStmt):
                self.action(stmt, scope, rank)
            elif isinstance(stmt, s.For):
                values = self.range(scope, stmt.iterable)
                count = max(0, values.stop - values.start)  # len() of a range past 2^63 is an OverflowError
                if count > self.max_steps - self.steps:
                    raise self.fail(f"this loop runs {count:,} times, more than a schedule of these sizes "
                                    f"needs", stmt.iterable.span,
                                    hint="loops should run over ranks, stages and microbatches")
                for x in values:
                    self.tick(stmt.span)
                    inner = scope.with_locals({stmt.var: x})
                    self.block(stmt.body, inner, self.rank(inner, stmt.rank) if stmt.rank is not None else rank)
            elif isinstance(stmt, s.On):
                self.block(stmt.body, scope, self.rank(scope, stmt.rank))
            elif isinstance(stmt, s.If):
                if self.truth(scope, stmt.cond):
                    self.block(stmt.then, scope, rank)
                elif stmt.orelse is not None:
                    self.block(stmt.orelse, scope, rank)
            elif isinstance(stmt, s.RankRow):
                raise self.fail("`rank r: ...` rows belong in a table schedule, not in a template", stmt.span,
                                hint="in a template, write actions inside `on rank r { F(stage, mb) }`")
            else:
                raise self.fail("this statement has no meaning in a schedule", stmt.span)

    def action(self, stmt: s.ActionStmt, scope: Scope, rank: int | None) -> None:
        call = stmt.call
        if not (isinstance(call, s.Call) and isinstance(call.func, s.Name) and call.func.id in ACTION_KINDS
                and len(call.args) == 2 and not call.kwargs):
            raise self.fail("an action is F(stage, microbatch), B(...), I(...) or W(...)", stmt.span)
        if rank is None:
            raise self.fail(f"{call.func.id}(...) is not inside an `on rank`: which rank runs it?", stmt.span,
                            hint="write it inside `on rank r { ... }` or `for x in a..b on rank r { ... }`")
        stage = self.integer(scope, call.args[0], "a stage")
        microbatch = self.integer(scope, call.args[1], "a microbatch")
        self.actions += 1
        if self.actions > self.max_actions:
            raise self.fail(f"the template emits more than {self.max_actions:,} actions: does a loop run too long?",
                            stmt.span, hint="a schedule runs each (stage, microbatch) forward and backward once")
        row = self.rows[rank]
        self.spans[(rank, len(row))] = stmt.span
        row.append(Action(stage, ACTION_KINDS[call.func.id], microbatch))


def _no_definitions(scope: Scope, node) -> Any:
    raise scope.reporter.error("E205", "a schedule template computes with numbers only", node.span)
