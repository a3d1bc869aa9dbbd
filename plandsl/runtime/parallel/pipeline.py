"""Pipeline parallelism: a plan's stages and schedule -> this rank's torch.distributed.pipelining objects.

Stage: runtime, called by `runtime.train` when `plan.stages` is set. Contract: `build_pipeline` splits
the full model into this rank's stage modules as `placement.assign_stages` says, wraps each in a
`PipelineStage` and builds the plan's schedule (torch's class where torch ships it, else torch's
runtime fed with the plan's compute-only program); `Pipeline.step` runs one optimizer step's
forward and backward over the microbatches and leaves the gradients on the stage parameters.

Private torch API used (pinned to torch 2.13; `tests/distributed/test_schedules.py` exercises each):
`schedules._PipelineScheduleRuntime`, its `pipeline_order` and `_prepare_schedule_with_comms`
(what `_load_csv(format="compute_only")` does after reading the file), `schedules._Action.from_str`, and the
stage's `_prepare_forward_infra` and `_post_metadata_inference_cleanup` (`_inference_keeps_buffers`).
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _Action, _PipelineScheduleRuntime
from torch.nn.parallel import DistributedDataParallel

from plandsl import ir
from plandsl.cost.schedule import plan_schedule
from plandsl.ir.placement import Assignment, assign_stages
from plandsl.runtime.buffers import Saved, owned_buffers, put_back, save
from plandsl.runtime.precision import autocast
from plandsl.schedules.generators import generate
from plandsl.schedules.program import Kind, Schedule, loop_map, vshape_map
from plandsl.schedules.registry import BUILTIN
from plandsl.lower.schedule_template import instantiate
from plandsl.runtime.parallel.parallelize import move, parallelize as parallelize_plan
from plandsl.runtime.models import loss_fn as default_loss, materialize
from plandsl.runtime.torch_model import TorchModel

# The built-ins torch ships, name -> class (`ScheduleInfo.torch_class`; the class assumes the
# schedule's `rank_map`). Every other schedule over one chain of stages (zb_h1, zb_h2, written
# tables and templates) runs through `_PipelineScheduleRuntime`.
TORCH_SCHEDULES: dict[str, type] = {name: getattr(pipelining, info.torch_class)
                                    for name, info in BUILTIN.items() if info.torch_class}

class PipelineError(RuntimeError):
    """The plan's pipeline cannot be built on this process group."""


class UnsupportedScheduleError(PipelineError):
    """The plan names a schedule the interpreter cannot run (yet): `chimera`."""


@dataclass
class Pipeline:
    """This rank's share of the pipeline: its stage modules, their `PipelineStage`s and the schedule."""

    schedule: object                  # a torch schedule; `_PipelineScheduleRuntime` for IR-driven ones
    stages: list[PipelineStage]
    modules: list[nn.Module]          # what runs: the stage modules as `parallelize` returned them
    models: list[nn.Module]           # the same unwrapped (DDP's `module.` prefix absent), sharing parameters
    stage_indices: tuple[int, ...]
    microbatches: int
    group: dist.ProcessGroup
    runner: str                       # "ScheduleGPipe", ..., or "_PipelineScheduleRuntime"
    plan: ir.Plan = field(repr=False)
    program: Optional[Schedule] = field(default=None, repr=False)  # the plan's IR, when the runtime runs it
    tied: Optional["TiedEmbeddings"] = field(default=None, repr=False)  # embed and head copies to keep equal

    @property
    def is_first(self) -> bool:
        """Does this rank hold stage 0 (it takes the input tokens)?"""
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        """Does this rank hold the last stage (it computes the loss)?"""
        return any(stage.is_last for stage in self.stages)

    def parameters(self) -> Iterator[nn.Parameter]:
        return itertools.chain.from_iterable(model.parameters() for model in self.models)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters named as in the full model (`layers.3.attn.wq.weight`), up to the prefix that
        recomputation inserts (`_checkpoint_wrapped_module.`)."""
        return itertools.chain.from_iterable(model.named_parameters() for model in self.models)

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None, *,
             target: torch.Tensor | None = None, losses: list | None = None) -> torch.Tensor | None:
        """Forward and backward of one optimizer step's batch, split into `microbatches`.

        Every rank of the pipeline group calls it with the same batch, its data rank's share (ranks
        that hold neither the first nor the last stage may pass None). Gradients accumulate into `.grad` of the stage parameters, scaled so they
        equal those of the mean loss over the whole batch; zero them before the next step. Returns
        the loss averaged over the microbatches (= the whole batch's mean loss) on the rank holding
        the last stage, None elsewhere. Called like a torch schedule (`step(x, target=y, losses=[])`),
        it also fills `losses` with each microbatch's loss on that rank.
        """
        targets = target if targets is None else targets
        device = self.stages[0].device
        args: tuple = ()
        if self.is_first:
            _need_split(inputs, self.microbatches, "inputs")
            args = (inputs.to(device),)
        target = None
        if self.is_last:
            _need_split(targets, self.microbatches, "targets")
            target = targets.to(device)
        found: list[torch.Tensor] | None = [] if self.is_last else None
        with autocast(self.plan, device.type):  # forwards run inside `step`; backward ignores autocast
            # `outputs = returned`: the last stage keeps every microbatch's output and returns their merge (unused)
            returned = self.plan.stages is not None and self.plan.stages.outputs == "returned"
            self.schedule.step(*args, target=target, losses=found, return_outputs=returned)
        if self.tied is not None:
            self.tied.sum_grads()
        if found is None:
            return None
        if losses is not None:
            losses[:] = found
        return torch.stack([loss.detach().float() for loss in found]).mean()

    def __iter__(self):
        """Unpacks as `(pipeline, parts, has_first, has_last)`, as `runtime.train.build_job` takes it;
        `parts` are the unwrapped stage modules (parameter names as the catalogue gives them)."""
        return iter((self, self.models, self.is_first, self.is_last))


def build_pipeline(plan: ir.Plan, model: nn.Module, mesh, device: torch.device | str,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   microbatches: int | None = None,
                   parallelize: Callable[[nn.Module, int], nn.Module] | None = None,
                   scale_grads: bool = True) -> Pipeline:
    """This rank's pipeline for `plan`.

    `model` is the full model (top level `embed`, `layers` as an `nn.ModuleDict`, `norm`, `head`,
    with a forward that skips missing parts); it is deep-copied, never modified. `mesh` is the plan's
    DeviceMesh (its stage axis is the pipeline group), a 1-D mesh over that axis, or the pipeline's
    ProcessGroup. `loss_fn(output, target)` must be a mean over its microbatch; default: the model's
    `loss`, else `runtime.models.loss_fn`. `microbatches` defaults to `plan.num_microbatches`.
    `parallelize(module, stage_index)` is applied to each stage module before it is wrapped (tensor,
    data parallelism, recomputation: torchtitan's order) and returns the module to run; default, given
    the plan's whole mesh: `runtime.parallelize.parallelize` over it, else only the move to `device` (a part of a
    model on the meta device, `models.build_meta_model`, allocated there and filled: `models.materialize`).
    `scale_grads`: torch divides the gradients by `microbatches` after the backward, which is after the
    data-parallel reduction; replicas with their own microbatch counts (`batch_shares`) must not, and
    divide their losses instead (`runtime.train`).
    """
    if plan.stages is None or plan.schedule is None:
        raise PipelineError(f"plan '{plan.name}' has no pipeline: it needs `stages` and `schedule`")
    name = plan.schedule.name
    if plan.schedule.definition is None and BUILTIN[name].refused:  # `plandsl run` refuses it first (E701)
        raise UnsupportedScheduleError(f"schedule '{name}' cannot run yet: {BUILTIN[name].refused}")
    microbatches = plan.num_microbatches if microbatches is None else microbatches
    assignment, problems = assign_stages(plan)
    if problems or assignment is None:
        raise PipelineError("cannot place the stages: " + "; ".join(f"[{d.code}] {d.message}" for d in problems))
    program, runner_map = _program_and_map(plan, microbatches, name)
    _check_map(name, runner_map, assignment.rank_of_stage)
    device = torch.device(device)
    group = _pipeline_group(mesh, plan.stages.axis)
    if parallelize is None and _is_plan_mesh(mesh, plan):
        parallelize = lambda module, stage_index: parallelize_plan(plan, module, mesh, device)  # noqa: E731
    if loss_fn is None:
        loss_fn = getattr(model, "loss", default_loss)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != plan.pp:
        raise PipelineError(f"the pipeline group has {size} ranks, but the plan's axis '{plan.stages.axis}' "
                            f"has {plan.pp}")

    num_stages = assignment.num_stages
    layer_names = [layer.name for layers in assignment.stage_layers for layer in layers]
    local = assignment.rank_stages()[rank]
    modules, models, stages = [], [], []
    torch_parts = None
    if isinstance(model, TorchModel):  # a model from torch: split by its own convention, or traced (runtime.torch_model)
        keeps = [{layer.name for layer in layers} for layers in assignment.stage_layers]
        torch_parts = model.stage_modules(keeps, list(local), _example(plan, model))
    split = _splits_backward(name, program)
    for stage_index in local:
        keep = {layer.name for layer in assignment.stage_layers[stage_index]}
        part = move(torch_parts[stage_index] if torch_parts is not None
                    else stage_part(model, keep, layer_names, split), device)
        # may wrap `part` (DDP); a part of a model on the meta device comes back filled (`parallelize_plan`)
        module = parallelize(part, stage_index) if parallelize is not None else \
            materialize(part, plan.model, plan.train.seed, device)
        models.append(part)
        modules.append(module)
        stages.append(PipelineStage(module, stage_index, num_stages, device, group=group))
    stages = _inference_keeps_buffers(stages)
    _check_ddp(name, modules, program)
    tied = tie_embeddings(plan, assignment, models, local, mesh)

    if program is None:
        schedule_class = TORCH_SCHEDULES[name]
        first = stages[0] if issubclass(schedule_class, PipelineScheduleSingle) else stages
        schedule = schedule_class(first, microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        runner = schedule_class.__name__
    else:
        schedule = runtime_schedule(stages, program, loss_fn, scale_grads)
        runner = _PipelineScheduleRuntime.__name__
    mapping = getattr(schedule, "stage_index_to_group_rank", None) or stages[0].stage_index_to_group_rank
    used = tuple(mapping[s] for s in range(num_stages))
    if used != tuple(assignment.rank_of_stage):
        raise PipelineError(f"{runner} put the stages on ranks {list(used)}, but the plan's map is "
                            f"{list(assignment.rank_of_stage)}")
    return Pipeline(schedule, stages, modules, models, tuple(local), microbatches, group, runner, plan, program,
                    tied)


def _inference_keeps_buffers(stages: list[PipelineStage]) -> list[PipelineStage]:
    """This rank's `stages`, their modules' buffers put back after torch infers their shapes. torch 2.13's schedules
    infer each stage's inputs and outputs at the first step by running its forward and backward once more
    (`_prepare_forward_infra`, `_prepare_backward_infra`: the first stage on the first microbatch, a later one on
    uninitialised tensors of the shapes it is sent), the random state forked around them and FSDP resharded after
    (`_post_metadata_inference_cleanup`), nothing else put back: a BatchNorm in training took one more update of its
    running statistics than one process does (--check-equivalence failed on a CNN cut into stages). Each stage's
    buffers are saved as its forward's inference starts, into one list for the rank's stages, and the first cleanup
    puts them all back, the latest saved first: torch infers the forward of every stage of the rank before it cleans
    up any, so a buffer two of them hold (torch's pipeline frontend gives each traced stage the buffers it reads, the
    same tensor) was saved again by the later stage after the earlier one's forward had changed it, and putting back
    each stage's own saving left that change. Private torch methods (the module docstring): a torch without them is
    left as it is."""
    saved: Saved = []  # the buffers of every stage whose inference has started, in the order saved

    def keeps(stage: PipelineStage) -> PipelineStage:
        infer = getattr(stage, "_prepare_forward_infra", None)
        cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
        if infer is None or cleanup is None:
            return stage

        def prepare_forward_infra(*args, **kwargs):
            mode = getattr(stage, "_inference_mode", None)  # torch's static mode (shapes given: memtrace) runs none
            if getattr(mode, "name", None) != "STATIC":
                saved.extend(save(owned_buffers(stage.submod)))
            return infer(*args, **kwargs)

        def post_metadata_inference_cleanup():
            cleanup()
            put_back(saved)
            saved.clear()

        stage._prepare_forward_infra = prepare_forward_infra
        stage._post_metadata_inference_cleanup = post_metadata_inference_cleanup
        return stage

    return [keeps(stage) for stage in stages]


def runtime_schedule(stages: list[PipelineStage], program: Schedule,
                     loss_fn: Callable, scale_grads: bool = True) -> _PipelineScheduleRuntime:
    """torch's action-list runtime running `program` (compute-only, one chain of stages).

    Each action goes through its text (`2F0`, `1I3`, `0W1`: the notation is torch's), and torch's
    own passes lower it: `_add_send_recv`, `_add_reduce_grad` (grad scaling after each stage's
    last backward), `_add_unshard_reshard`. torch's lowering is used rather than plandsl's
    `add_send_recv` because its point-to-point messages carry no tag: each pair of ranks must post
    its receives in the order the sender sends, which torch's pass guarantees by placing a receive
    when it schedules the matching send."""
    if not hasattr(_PipelineScheduleRuntime, "_prepare_schedule_with_comms"):
        raise PipelineError(f"schedule '{program.name}' needs torch's private _PipelineScheduleRuntime."
                            f"_prepare_schedule_with_comms (written against torch 2.13); torch "
                            f"{torch.__version__} lacks it")
    schedule = _PipelineScheduleRuntime(stages, program.microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    schedule.pipeline_order = {rank: [_Action.from_str(str(action)) for action in row]
                               for rank, row in enumerate(program.compute_only().actions)}
    schedule._prepare_schedule_with_comms(schedule.pipeline_order)  # validates, infers the map, lowers
    return schedule


def split_stage(model: nn.Module, keep: set[str], layer_names: list[str]) -> nn.Module:
    """A deep copy of `model` without the top-level layers (`embed`, `layers.3`, `norm`, `head`) that
    are not in `keep`: removed from a `ModuleDict`, set to None elsewhere (torchtitan's way)."""
    stage = copy.deepcopy(model)
    for name in layer_names:
        if name in keep:
            continue
        parent_name, _, child = name.rpartition(".")
        try:
            parent = stage.get_submodule(parent_name)
        except AttributeError:
            parent = None
        if parent is None or child not in parent._modules:
            raise PipelineError(f"the model has no module '{name}' to leave out of a stage; its top-level "
                                f"modules are {', '.join(n for n, _ in model.named_children())}")
        if isinstance(parent, nn.ModuleDict):
            del parent[child]
        else:
            setattr(parent, child, None)
    return stage


def stage_part(model: nn.Module, keep: set[str], layer_names: list[str], split_backward: bool = False) -> nn.Module:
    """`split_stage`, and multi-token prediction's depths (`mtp`, placed with the head: `ir.layers`) on the head's
    stage only, beside a copy of the embedding for the tokens they embed when that stage has none (megatron-core
    0.16.1 builds the embedding on the last stage for its depths, gpt_model.py:149-157); the copy's gradient is
    summed with the first stage's (`tie_embeddings`), and the stage's input stays the previous stage's hidden
    states (`Transformer.embeds_inputs`). Under a schedule that splits the backward (`split_backward`), a tied
    head there holds a weight of its own, summed with both: as one weight, its gradient's W pass (torch's
    `stage_backward_weight`) would run from each depth's head back through the depth to its embedding, through
    nodes the input gradient's pass freed."""
    if getattr(model, "mtp", None) is None:
        return split_stage(model, keep, layer_names)
    holds_head = "head" in keep
    part = split_stage(model, keep | {"embed"} if holds_head else keep, layer_names)
    if not holds_head:
        part.mtp = None
    elif "embed" not in keep:
        if part.embed.pos is not None:  # the checker allows depths on rotary positions only (E233)
            raise PipelineError("multi-token prediction's copy of the embedding holds learned positions")
        part.embeds_inputs = False
        if split_backward and part.head.weight is part.embed.tok.weight:
            part.head.weight = nn.Parameter(part.embed.tok.weight.detach().clone())
    return part


def _pipeline_group(mesh, axis: str):
    """The pipeline's process group: the `axis` dimension of a DeviceMesh, or the group given."""
    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names or ()
        if mesh.ndim > 1 or (names and names[0] != axis):
            if axis not in names:
                raise PipelineError(f"the mesh has no axis '{axis}' (its axes: {', '.join(names)})")
            mesh = mesh[axis]
        return mesh.get_group()
    return mesh


def _is_plan_mesh(mesh, plan: ir.Plan) -> bool:
    return isinstance(mesh, DeviceMesh) and tuple(mesh.mesh_dim_names or ()) == tuple(a.name for a in plan.mesh.axes)


def _program_and_map(plan: ir.Plan, microbatches: int, name: str) -> tuple[Schedule | None, tuple[int, ...]]:
    """(the plan's compute-only program when the runtime runs it, else None; the runner's stage map)."""
    pp, virtual = plan.pp, plan.stages.virtual
    if plan.schedule.definition is None and name in TORCH_SCHEDULES:
        return None, vshape_map(pp) if BUILTIN[name].rank_map == "vshape" else loop_map(pp, pp * virtual)
    if microbatches == plan.num_microbatches:
        program, problems = plan_schedule(plan)
    elif plan.schedule.definition is not None:
        definition = plan.schedule.definition
        program, problems = instantiate(definition, definition.scope, ranks=pp, microbatches=microbatches,
                                        virtual=virtual)
    else:
        try:
            program, problems = generate(name, pp, microbatches, virtual), []
        except ValueError as error:
            raise PipelineError(f"schedule '{name}': {error}") from None
    errors = [d for d in problems if d.is_error]
    if errors or program is None:
        raise PipelineError(f"schedule '{name}' for {pp} ranks x {microbatches} microbatches: "
                            + "; ".join(f"[{d.code}] {d.message}" for d in errors))
    if len(program.stage_to_rank) != 1 or program.microbatch_pipeline:
        raise UnsupportedScheduleError(f"schedule '{name}' uses {len(program.stage_to_rank)} pipelines; the "
                                       "interpreter runs one chain of stages")
    return program, tuple(program.stage_to_rank[0])


def _check_map(name: str, runner_map: tuple[int, ...], plan_map: tuple[int, ...]) -> None:
    if tuple(runner_map) == tuple(plan_map):
        return
    if len(runner_map) != len(plan_map):
        raise PipelineError(f"schedule '{name}' runs {len(runner_map)} stages, but the plan has {len(plan_map)}")
    stage = next(s for s, (a, b) in enumerate(zip(runner_map, plan_map)) if a != b)
    hint = ""
    if name in TORCH_SCHEDULES and BUILTIN[name].rank_map == "vshape":
        hint = " (set `map = vshape` in the stages)"
    elif name in TORCH_SCHEDULES:
        hint = " (torch's class places stage s on rank s mod pp: set `map = loop` in the stages)"
    raise PipelineError(f"schedule '{name}' runs stage {stage} on rank {runner_map[stage]}, but the plan's stage "
                        f"map puts it on rank {plan_map[stage]}: the schedule's map is {list(runner_map)}{hint}")


def _splits_backward(name: str, program: Schedule | None) -> bool:
    """Whether the schedule runs backwards as I then W (program None: torch's class runs the built-in)."""
    return BUILTIN[name].split_backward if program is None else any(
        action.kind is Kind.I for row in program.actions for action in row)


def _check_ddp(name: str, modules: list[nn.Module], program: Schedule | None) -> None:
    """DistributedDataParallel stages run only one stage per rank with full backwards (B): checked
    with torch 2.13, DDP reduces during the input-gradient pass (I), before W has made the weight
    gradients (silently wrong), and two DDP stages on one rank break its reducer (bucket rebuild)."""
    if not any(isinstance(module, DistributedDataParallel) for module in modules):
        return
    split = _splits_backward(name, program)
    if split or len(modules) > 1:
        why = "it splits the backward into I and W" if split else "it runs several stages per rank"
        raise PipelineError(f"schedule '{name}' cannot run stages wrapped in DistributedDataParallel: {why}; "
                            "replicate the stages with torch's composable `replicate` (FSDP2 without "
                            "sharding) instead")


@dataclass
class TiedEmbeddings:
    """The copies of a tied embedding weight this rank holds when `embed` and `head` sit on different
    stages (Megatron-LM's embedding group), or of the embedding that multi-token prediction's depths read on the
    head's stage: both start equal (one full model is split), and after each
    backward their gradients are summed, over `group` between the first and the last stage's ranks and
    locally between two stages of this rank, so both copies take the same optimizer step and stay
    equal. `duplicates` are the head's stage's copies, which the global gradient norm must not count twice."""

    params: list[nn.Parameter]
    group: Optional[dist.ProcessGroup]  # None when both stages are on this rank
    duplicates: list[nn.Parameter]

    @torch.no_grad()
    def sum_grads(self) -> None:
        grads = [_as_param(p.grad, p) for p in self.params if p.grad is not None]
        if not grads:
            return
        # outside autocast: step() runs under the plan's, and an fp16 autocast refuses to stack bf16 gradients
        # (`precision: fp16` with `param_dtype: bf16`: "Unexpected floating ScalarType in at::autocast::prioritize")
        with torch.autocast(grads[0].device.type, enabled=False):
            total = grads[0].clone() if len(grads) == 1 else torch.stack(grads).sum(0)
        if self.group is not None:
            local = total.to_local() if isinstance(total, DTensor) else total
            dist.all_reduce(local, group=self.group)  # in place: a DTensor's local shard is its storage
        for param in self.params:
            param.grad = total.clone()


def _as_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The gradient laid out as its parameter (under tensor parallelism a vocabulary-parallel embedding's
    gradient comes back Replicate, while the head's is Shard(0) like both weights), so that the two
    copies' local shards line up."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def tie_embeddings(plan: ir.Plan, assignment: Assignment, models: list[nn.Module], local: list[int],
                   mesh) -> Optional[TiedEmbeddings]:
    """The tied copies of this rank (None when the model is untied and has no multi-token prediction, or one stage
    holds both embed and head). The head's stage holds a copy as its head's weight when tied, and with multi-token
    prediction one as its embedding's (`stage_part`; both when both).

    Every rank creates every embedding group (`new_group` is collective over the world), one per
    pipeline, i.e. per coordinate of the other mesh axes."""
    depths, tied = bool(getattr(plan.model, "mtp", 0)), getattr(plan.model, "tied_embeddings", False)
    if not tied and not depths:
        return None
    owner = {layer.name: s for s, layers in enumerate(assignment.stage_layers) for layer in layers}
    first, last = owner.get("embed"), owner.get("head")
    if first is None or last is None or first == last:
        return None
    ranks = (assignment.rank_of_stage[first], assignment.rank_of_stage[last])
    group = None
    if ranks[0] != ranks[1]:
        if not isinstance(mesh, DeviceMesh) or mesh.size() != dist.get_world_size():
            raise PipelineError("tied embeddings (or multi-token prediction's copy of the embedding) on two "
                                "pipeline ranks need the plan's whole DeviceMesh (every rank forms every pipeline's "
                                "embedding group); untie them or place embed and head on one rank")
        names = list(mesh.mesh_dim_names or ())
        pipelines = mesh.mesh.movedim(names.index(plan.stages.axis), -1).reshape(-1, plan.pp)
        me = dist.get_rank()
        for row in pipelines.tolist():
            pair = dist.new_group([row[ranks[0]], row[ranks[1]]])
            if me in (row[ranks[0]], row[ranks[1]]):
                group = pair
    params, duplicates = [], []
    for stage_index, model in zip(local, models):
        if stage_index == first:
            params.append(model.get_parameter("embed.tok.weight"))
        elif stage_index == last:
            copies = [model.get_parameter(name) for name, held in (("embed.tok.weight", depths),
                                                                    ("head.weight", tied)) if held]
            copies = list({id(p): p for p in copies}.values())  # one weight when the head is tied to the copy
            params += copies
            duplicates += copies
    if not params:
        return None
    return TiedEmbeddings(params, group, duplicates)


def _example(plan: ir.Plan, model: TorchModel) -> torch.Tensor:
    """One microbatch of the model's inputs (zeros), on the model's device: what torch's pipeline frontend traces a
    module on (on the meta device under `run --dry-run`, where a CNN's convolutions refuse a CPU input)."""
    rows = max(1, plan.train.micro_batch)
    device = next(model.parameters()).device
    if model.image:
        return torch.zeros(rows, *model.image, device=device)
    return torch.zeros(rows, plan.seq, dtype=torch.long, device=device)


def _need_split(batch: torch.Tensor | None, microbatches: int, what: str) -> None:
    if batch is None:
        raise ValueError(f"this rank holds the {'first' if what == 'inputs' else 'last'} stage and needs {what}")
    if batch.shape[0] % microbatches:
        raise ValueError(f"{what}: {batch.shape[0]} sequences do not split into {microbatches} equal microbatches")
