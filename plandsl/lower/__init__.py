"""Syntax trees of loaded files -> the typed IR (`plandsl.ir.Document`), E2xx diagnostics.

One `Scope` per file; definitions are lowered on first use and memoised, so a plan can
use a cluster defined three imports away. Problems are collected, never raised: a value
that fails is reported once and poisons only what depends on it, not its neighbours.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plandsl import ir
from plandsl import syntax as s
from plandsl.diagnostics import Note, diag, did_you_mean
from plandsl.diagnostics.limits import MAX_SMS
from plandsl.lower.bodies import attributes, build, dict_items, require
from plandsl.lower.evaluate import Poison, Rep, Reporter, Scope, Word
from plandsl.lower.model import custom_model, model_call, model_value, schedule_def
from plandsl.syntax.loader import Loaded, Loader
from plandsl.lower.plan import lower_plan
from plandsl.lower.measured import MIN_RATE, attention_curve, measured_collectives, measured_table
from plandsl.lower.units import BANDWIDTH, BYTES, FLOPS, TIME, format_bytes
from plandsl.syntax.parser import deep_recursion

PRECISIONS = tuple(p.value for p in ir.Precision)
# attribute (or key) -> required, of each definition and `{ }` value lowered here (the language server completes them)
DEVICE_ATTRS = {"memory": True, "bandwidth": True, "peak": True, "efficiency": False, "reserve": False,
                "comm_share": False, "sms": False, "host_bandwidth": False}
NODE_ATTRS = {"devices": True, "link": True, "nic": False, "hosts": False, "host_memory": False}
CLUSTER_ATTRS = {"nodes": True, "fabric": False}
LINK_KEYS = {"bandwidth": True, "latency": False, "measured": False}
EFFICIENCY_KEYS = {"matmul": False, "kernel_latency": False, "measured": False, "attention": False,
                   "attention_backward": False, "attention_by_sequence": False}


class Lowering:
    """Lowers every loaded file; `document(root)` gives the root file's IR."""

    def __init__(self, modules: dict[str, Loaded], param_overrides: dict[str, Any] | None = None):
        self.reporter = Reporter()
        self.scopes: dict[str, Scope] = {}
        self.memo: dict[tuple[str, str], Any] = {}
        self.in_progress: set[tuple[str, str]] = set()
        for key, loaded in modules.items():
            self.scopes[key] = self._scope(loaded)
        for key, loaded in modules.items():
            self.scopes[key].imported = [self.scopes[m.path] for _, m in loaded.imports if m is not None]
        self.param_overrides = param_overrides or {}

    @property
    def diagnostics(self):
        return self.reporter.diagnostics

    def _scope(self, loaded: Loaded) -> Scope:
        scope = Scope(self.reporter, loaded.path, self.resolve)
        scope.source = loaded.source
        seen: dict[str, s.Node] = {}
        for item in loaded.syntax.items if loaded.syntax else ():
            if isinstance(item, s.Import):
                continue
            name = item.name
            if name in seen:
                self.reporter.error("E202", f"'{name}' is defined twice", item.name_span,
                                    notes=[Note("first defined", getattr(seen[name], "name_span", None))])
                continue
            seen[name] = item
            if isinstance(item, s.Param):
                scope.params[name] = item
            elif isinstance(item, s.Let):
                scope.lets[name] = item
            else:
                scope.definitions[name] = item
        return scope

    # ---- definitions ---------------------------------------------------------------
    def resolve(self, scope: Scope, node: s.Definition | s.Call) -> Any:
        if isinstance(node, s.Call):
            return model_call(scope, node, name=None)
        key = (scope.file, node.name)
        if key in self.memo:
            value = self.memo[key]
            if value is None:
                raise Poison()
            return value
        if key in self.in_progress:
            raise self.reporter.error("E211", f"'{node.name}' is defined in terms of itself", node.name_span)
        self.in_progress.add(key)
        try:
            value = getattr(self, f"_{node.kind}")(scope, node)
        except Poison:
            self.memo[key] = None
            raise
        finally:
            self.in_progress.discard(key)
        self.memo[key] = value
        return value

    def _device(self, scope: Scope, d: s.Definition) -> ir.DeviceType:
        allowed = DEVICE_ATTRS
        found = attributes(scope, d.body, allowed, f"device '{d.name}'")
        if not require(scope, found, allowed, f"device '{d.name}'", d.name_span, d.body):
            raise Poison()
        memory = scope.quantity(found["memory"].value, BYTES, "memory")
        bandwidth = self._rate(scope, found["bandwidth"].value, BANDWIDTH, "bandwidth", "B/s")
        peaks = dict_items(scope, found["peak"].value, {p: False for p in PRECISIONS}, "peak")
        peak = {ir.Precision(k): self._rate(scope, item.value, FLOPS, f"peak {k}", "FLOP/s") for k, item in peaks.items()}
        if not peak:
            raise self.reporter.error("E207", "peak needs at least one precision", found["peak"].value.span,
                                      hint="peak = { bf16: 312 TFLOP/s }")
        efficiency = self.efficiency(scope, found["efficiency"].value, peak) if "efficiency" in found else None
        if efficiency is not None:
            self._slowest_kernel(peak, efficiency, found["efficiency"].value)
        reserve = None
        if "reserve" in found:
            value = found["reserve"].value
            reserve = scope.quantity(value, BYTES, "reserve", allow_zero=True)
            if reserve >= memory:
                raise self.reporter.error("E205", f"reserve {format_bytes(reserve)} leaves nothing of the device's "
                                          f"memory {format_bytes(memory)} for a plan's tensors", value.span,
                                          hint="the reserve is what the allocator, the CUDA context and communication "
                                               "buffers take, a few GiB of a GPU's memory")
        comm_share = None
        if "comm_share" in found:
            value = found["comm_share"].value
            comm_share = float(scope.number(scope.eval(value), value))
            if not 0 <= comm_share < 1:
                raise self.reporter.error("E205", f"comm_share is the fraction of the device's compute a collective "
                                          f"beside it takes, in [0, 1), found {comm_share:g}", value.span,
                                          hint="NCCL's channels over the SMs: `comm_share = 0.18` (24 of an H100's "
                                               "132); 0 for a transport that takes no SMs")
        # streaming multiprocessors: a whole number of at least 1 (E205, E211), at most MAX_SMS (E505)
        sms = {"sms": scope.integer(found["sms"].value, "sms", minimum=1, maximum=MAX_SMS)} if "sms" in found else {}
        if "host_bandwidth" in found:  # to the host's memory, each way: what offloaded activations cross
            sms["host_bandwidth"] = self._rate(scope, found["host_bandwidth"].value, BANDWIDTH, "host_bandwidth", "B/s")
        return build(scope, ir.DeviceType, d.span, name=d.name, memory=memory, bandwidth=bandwidth, peak=peak,
                     efficiency=efficiency, reserve=reserve, comm_share=comm_share, **sms)

    def _rate(self, scope: Scope, expr: s.Expr, dimension, what: str, unit: str) -> float:
        """A rate a device or link states (FLOP/s, B/s): positive, and at least 1 per second (E205), so that every
        time the cost model divides a plan's work by it, or by a fraction of it, stays finite."""
        value = scope.quantity(expr, dimension, what)
        if value < MIN_RATE:
            raise self.reporter.error("E205", f"{what} is {value:g} {unit}, below {MIN_RATE:g} {unit}", expr.span,
                                      hint=f"a rate is at least 1 {unit}: the cost model divides a plan's work by it "
                                           f"(write the unit's prefix: `312 TFLOP/s`, `2 TB/s`)")
        return value

    def _slowest_kernel(self, peak: dict[ir.Precision, float], efficiency: ir.DeviceEfficiency, expr: s.Expr) -> None:
        """E205 when a fraction of the peak the efficiency states (a GEMM's `matmul`, the attention kernel's figures
        scaled by their smallest `attention_by_sequence` ratio) runs below 1 FLOP/s: `_rate`'s floor for what the
        cost model divides the FLOPs by."""
        for precision, rate in peak.items():
            knobs = efficiency.precisions.get(precision, efficiency)
            slowest = min((point.ratio for point in knobs.attention_by_sequence), default=1.0)
            fractions = {"matmul": knobs.matmul}
            for key in ("attention", "attention_backward"):
                if getattr(knobs, key) is not None:
                    fractions[key if slowest == 1.0 else f"{key} x its smallest attention_by_sequence ratio"] = \
                        getattr(knobs, key) * slowest
            what, fraction = min(fractions.items(), key=lambda item: item[1])
            if rate * fraction < MIN_RATE:
                raise self.reporter.error("E205", f"efficiency {what} ({fraction:g}) runs the {precision.value} peak "
                                          f"({rate:g} FLOP/s) at {rate * fraction:g} FLOP/s, below {MIN_RATE:g} "
                                          "FLOP/s", expr.span,
                                          hint="the fractions and ratios scale the peak: a kernel runs at least "
                                               "1 FLOP/s, or no time the cost model gives is finite")

    def efficiency(self, scope: Scope, expr: s.Expr, peak: dict[ir.Precision, float]) -> ir.DeviceEfficiency:
        """`{ matmul: 0.64, kernel_latency: 18 us }`, optionally `attention: 0.5, attention_backward: 0.45` (the
        fused attention kernel's fractions of the peak), `measured: [[m, n, k, time], ...]` and, per
        precision, `bf16: { matmul, kernel_latency, measured }` (its omitted keys take the outer ones); an
        omitted key keeps its fitted default. Bad tables: E216, E217."""
        keys = EFFICIENCY_KEYS
        items = dict_items(scope, expr, {**keys, **{p: False for p in PRECISIONS}}, "efficiency")
        fields = self._knobs(scope, items, max(peak.values()), "any precision")
        precisions = {}
        curves = [items["attention_by_sequence"]] if "attention_by_sequence" in items else []
        for name in PRECISIONS:
            if name not in items:
                continue
            precision = ir.Precision(name)
            value = items[name].value
            if precision not in peak:
                raise self.reporter.error("E217", f"efficiency for {name}, but the device has no {name} peak",
                                          items[name].key_span, hint=f"add `{name}: ...` to `peak`, or remove "
                                          f"the `{name}` efficiency")
            inner = dict_items(scope, value, keys, f"efficiency {name}")
            own = {k: v for k, v in fields.items() if k != "measured"}
            own.update(self._knobs(scope, inner, peak[precision], name))
            curves += [inner["attention_by_sequence"]] if "attention_by_sequence" in inner else []
            if "attention_by_sequence" in inner and own.get("attention") is None:  # its own curve scales nothing
                raise self.reporter.error("E207", f"attention_by_sequence for {name} scales the attention kernel's "
                                          f"figures, but {name} has no `attention` (its own or the device's)",
                                          inner["attention_by_sequence"].key_span,
                                          hint=f"add `attention: 0.3` to the {name} entry or beside it (the "
                                               "kernel's forward fraction of the peak at the sequence whose ratio "
                                               "is 1)")
            curve = inner["attention_by_sequence"].value if "attention_by_sequence" in inner else expr
            self._attention_curve_fits(scope, own, curve, name)
            precisions[precision] = build(scope, ir.DeviceEfficiency, value.span, **own)
        if curves and fields.get("attention") is None and all(k.attention is None for k in precisions.values()):
            raise self.reporter.error("E207", "attention_by_sequence scales the attention kernel's figures, but the "
                                      "device states no `attention`", curves[0].key_span,
                                      hint="add `attention: 0.3` (the kernel's forward fraction of the peak at the "
                                           "sequence whose ratio is 1)")
        if "attention_by_sequence" in items:
            self._attention_curve_fits(scope, fields, items["attention_by_sequence"].value, "any precision")
        return build(scope, ir.DeviceEfficiency, expr.span, **fields, precisions=precisions)

    def _attention_curve_fits(self, scope: Scope, fields: dict, where: s.Expr, precision: str) -> None:
        """E205 when the attention kernel, scaled by its fastest ratio, would run above the peak."""
        curve = fields.get("attention_by_sequence") or ()
        figures = [fields[key] for key in ("attention", "attention_backward") if fields.get(key) is not None]
        if not curve or not figures:
            return
        fastest = max(curve, key=lambda point: point.ratio)
        if max(figures) * fastest.ratio > 1 + 1e-9:
            raise self.reporter.error("E205", f"attention_by_sequence's ratio {fastest.ratio:g} at "
                                      f"{fastest.tokens:,} tokens takes the attention kernel ({precision}) to "
                                      f"{max(figures) * fastest.ratio:.3g} of the peak, above 1", where.span,
                                      hint="the ratios scale `attention` and `attention_backward`: lower them, or "
                                           "the figures")

    def _knobs(self, scope: Scope, items: dict, peak: float, precision: str) -> dict:
        fields = {}
        if "matmul" in items:
            value = items["matmul"].value
            fraction = scope.number(scope.eval(value), value)
            if not 0 < fraction <= 1:
                raise self.reporter.error("E205", f"efficiency matmul is a fraction of the peak in (0, 1], "
                                          f"found {fraction:g}", value.span,
                                          hint="e.g. `matmul: 0.64` (64 % of the peak for a large GEMM)")
            fields["matmul"] = float(fraction)
        for key in ("attention", "attention_backward"):
            if key in items:
                value = items[key].value
                fraction = scope.number(scope.eval(value), value)
                if not 0 < fraction <= 1:
                    raise self.reporter.error("E205", f"efficiency {key} is a fraction of the peak in (0, 1], "
                                              f"found {fraction:g}", value.span,
                                              hint=f"e.g. `{key}: 0.5` (the fused attention kernel at half the peak)")
                fields[key] = float(fraction)
        if "kernel_latency" in items:
            fields["kernel_latency"] = scope.quantity(items["kernel_latency"].value, TIME,
                                                      "efficiency kernel_latency", allow_zero=True)
        if "measured" in items:
            fields["measured"] = measured_table(scope, items["measured"].value, peak, precision)
        if "attention_by_sequence" in items:
            fields["attention_by_sequence"] = attention_curve(scope, items["attention_by_sequence"].value)
        return fields

    def link(self, scope: Scope, expr: s.Expr, what: str) -> ir.Link:
        items = dict_items(scope, expr, LINK_KEYS, what)
        bandwidth = self._rate(scope, items["bandwidth"].value, BANDWIDTH, f"{what} bandwidth", "B/s")
        latency = scope.quantity(items["latency"].value, TIME, f"{what} latency", allow_zero=True) \
            if "latency" in items else 0.0
        measured = measured_collectives(scope, items["measured"].value, what) if "measured" in items else {}
        return build(scope, ir.Link, expr.span, bandwidth=bandwidth, latency=latency, measured=measured)

    def _node(self, scope: Scope, d: s.Definition) -> ir.NodeType:
        allowed = NODE_ATTRS
        found = attributes(scope, d.body, allowed, f"node '{d.name}'")
        if not require(scope, found, allowed, f"node '{d.name}'", d.name_span, d.body):
            raise Poison()
        devices = scope.eval(found["devices"].value)
        if not (isinstance(devices, Rep) and isinstance(devices.thing, ir.DeviceType)):
            raise self._expected(scope, devices, found["devices"].value, "devices", "`8 x a100_80g` (a count x a device)")
        count = scope.integer(devices.count_expr, "device count", minimum=1)
        link = self.link(scope, found["link"].value, "link")
        nic = self.link(scope, found["nic"].value, "nic") if "nic" in found else None
        hosts = {"hosts": scope.integer(found["hosts"].value, "hosts", minimum=1, maximum=1024)} if "hosts" in found else {}
        if hosts and count % hosts["hosts"]:
            divisors = [str(k) for k in range(1, min(count, 1024) + 1) if count % k == 0]
            raise self.reporter.error("E205", f"hosts ({hosts['hosts']}) must divide devices ({count}): each machine of "
                                      f"a node holds the same number of its devices", found["hosts"].value.span,
                                      hint=f"hosts = one of {', '.join(divisors[:12])}{' ...' if len(divisors) > 12 else ''}")
        if "host_memory" in found:  # CPU memory per machine of the node
            hosts["host_memory"] = scope.quantity(found["host_memory"].value, BYTES, "host_memory")
        return build(scope, ir.NodeType, d.span, name=d.name, device=devices.thing, devices=count, link=link, nic=nic,
                     **hosts)

    def _expected(self, scope: Scope, value, expr: s.Expr, what: str, example: str) -> Poison:
        if isinstance(value, Word):
            return scope.unknown(value)
        if isinstance(value, Rep) and isinstance(value.thing, Word):
            return scope.unknown(value.thing)
        return self.reporter.error("E205", f"{what} takes {example}", expr.span)

    def _cluster(self, scope: Scope, d: s.Definition) -> ir.Cluster:
        if d.value is not None:
            return self.cluster(scope, d.value, d.name)
        allowed = CLUSTER_ATTRS
        found = attributes(scope, d.body, allowed, f"cluster '{d.name}'")
        if not require(scope, found, allowed, f"cluster '{d.name}'", d.name_span, d.body):
            raise Poison()
        base = self.cluster(scope, found["nodes"].value, d.name)
        fabric = self.link(scope, found["fabric"].value, "fabric") if "fabric" in found else None
        return build(scope, ir.Cluster, d.span, name=d.name, groups=base.groups, fabric=fabric)

    def cluster(self, scope: Scope, expr: s.Expr, name: str | None = None) -> ir.Cluster:
        """`dgx_a100 x 64`, `[a x 4, b x 2]`, a cluster's name or a node's name (one node)."""
        target, inner = scope.deref(expr)
        items = target.items if isinstance(target, s.ListExpr) else (target,)
        groups: list[ir.NodeGroup] = []
        fabric = None
        for item in items:
            value = inner.eval(item)
            if isinstance(value, ir.Cluster) and len(items) == 1:
                return value if name is None else value.model_copy(update={"name": name})
            if isinstance(value, ir.NodeType):
                groups.append(build(inner, ir.NodeGroup, item.span, node=value, count=1))
                continue
            if isinstance(value, Rep) and isinstance(value.thing, ir.Cluster):
                count = inner.integer(value.count_expr, "cluster count", minimum=1)
                groups += [g.model_copy(update={"count": g.count * count}) for g in value.thing.groups]
                fabric = value.thing.fabric
                continue
            if not (isinstance(value, Rep) and isinstance(value.thing, ir.NodeType)):
                raise self._expected(inner, value, item, "a cluster", "`dgx_a100 x 64` (a node x a count)")
            count = inner.integer(value.count_expr, "node count", minimum=1)
            written = value.count_expr.span if isinstance(value.count_expr, s.Int) else None  # E301's edit grows it
            groups.append(build(inner, ir.NodeGroup, item.span, node=value.thing, count=count,
                                field_spans={"count": written} if written else {}))
        label = name or _cluster_label(groups)
        return build(scope, ir.Cluster, expr.span, name=label, groups=tuple(groups), fabric=fabric)

    def _model(self, scope: Scope, d: s.Definition) -> ir.Model:
        if d.value is not None:
            return model_value(scope, d.value, d.name)
        return custom_model(self, scope, d)

    def _schedule(self, scope: Scope, d: s.Definition) -> ir.ScheduleDef:
        return schedule_def(scope, d)

    def _plan(self, scope: Scope, d: s.Definition) -> ir.Plan:
        return lower_plan(self, scope, d)

    # ---- documents -----------------------------------------------------------------
    def document(self, root: Loaded) -> ir.Document:
        scope = self.scopes[root.path]
        scope.overrides = dict(self.param_overrides)
        unknown = sorted(set(self.param_overrides) - set(scope.params))
        for name in unknown:
            self.reporter.error("E201", f"--param {name}: the file has no parameter '{name}'", None,
                                hint=did_you_mean(name, scope.params, "parameters"))
        params = {}
        for name, node in scope.params.items():
            try:
                value = scope.param_value(node)
            except Poison:
                continue
            if isinstance(value, (int, float, str, bool)):
                params[name] = value
        buckets: dict[str, list] = {k: [] for k in ("device", "node", "cluster", "model", "schedule", "plan")}
        for name, node in scope.definitions.items():
            try:
                buckets[node.kind].append(self.resolve(scope, node))
            except Poison:
                pass
        if scope.definitions and any(d.kind == "plan" for d in scope.definitions.values()) \
                and not any(d.is_error for d in self.diagnostics):  # a file without plans is a library
            for name, node in {**scope.params, **scope.lets}.items():
                if name not in scope.used:
                    kind = "parameter" if isinstance(node, s.Param) else "definition"
                    self.reporter.warn("W201", f"{kind} '{name}' is never used", node.name_span,
                                       hint="remove it, or use it in a plan")
        return ir.Document(file=root.path, params=params, devices=tuple(buckets["device"]),
                           nodes=tuple(buckets["node"]), clusters=tuple(buckets["cluster"]),
                           models=tuple(buckets["model"]), schedules=tuple(buckets["schedule"]),
                           plans=tuple(buckets["plan"]))


@dataclass
class Lowered:
    """A file loaded and lowered: its document (None when it did not load or lower) and every
    diagnostic so far, with the sources they point into."""
    path: str
    document: ir.Document | None
    diagnostics: list
    sources: dict


def lower_file(path: str | None = None, text: str | None = None, params: dict[str, Any] | None = None,
               search_path=None) -> Lowered:
    """Load `path` (or `text`) with its imports, resolve parameters and lower every definition; never
    raises on bad input (E1xx, E2xx diagnostics)."""
    loader = Loader() if search_path is None else Loader(search_path=search_path)
    root = loader.load_text(text, path or "<string>") if text is not None else loader.load_file(path)
    diagnostics = list(loader.diagnostics)
    if root is None or root.syntax is None or diagnostics:
        key = root.path if root else (path or "<string>")
        return Lowered(key, None, diagnostics, loader.sources)
    lowering = Lowering(loader.modules, params)
    try:
        with deep_recursion():
            document = lowering.document(root)
    except RecursionError:
        lowering.diagnostics.append(diag("E106", "an expression is nested too deeply to evaluate", root.syntax.span))
        document = None
    return Lowered(root.path, document, diagnostics + lowering.diagnostics, loader.sources)


def _cluster_label(groups: list[ir.NodeGroup]) -> str:
    return " + ".join(f"{g.node.name} x {g.count}" for g in groups)
