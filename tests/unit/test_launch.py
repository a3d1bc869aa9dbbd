"""`plandsl run`'s launcher side without torch: torchrun's arguments and what may start on one machine."""
from __future__ import annotations

import pytest

from plandsl import api
from plandsl.runtime.launch import LaunchError, LaunchOptions, check_fits, torchrun_args
from tests.conftest import STDLIB

GPT3 = STDLIB / "examples" / "gpt3_175b_3d.plan"
LOCAL_3D = STDLIB / "local" / "3d.plan"


def _args(path, **options):
    return torchrun_args(api.load_plan(path), str(path), None, {}, LaunchOptions(**options))


def test_one_node_gets_a_private_rendezvous_and_the_mesh_size():
    args = _args(LOCAL_3D, steps=3)
    assert args[:3] == ["--standalone", "--nproc-per-node", "8"]
    assert args[3:] == ["-m", "plandsl.run", str(LOCAL_3D), "--steps", "3"]


def test_several_nodes_need_an_endpoint_and_a_process_count_that_covers_the_mesh():
    args = _args(GPT3, nnodes=128, node_rank=5, rdzv_endpoint="node0:29500")
    assert args[:8] == ["--nnodes", "128", "--node-rank", "5", "--rdzv-endpoint", "node0:29500",
                        "--nproc-per-node", "8"]
    with pytest.raises(LaunchError, match=r"--nnodes 128 needs --rdzv-endpoint") as caught:
        _args(GPT3, nnodes=128)
    assert caught.value.diagnostic.code == "E712" and not caught.value.diagnostic.span.line  # the options', no line
    with pytest.raises(LaunchError, match=r"mesh has 1024 devices, but nnodes\(2\) \* nproc-per-node\(8\) = 16") \
            as caught:
        _args(GPT3, nnodes=2, nproc_per_node=8, rdzv_endpoint="node0:29500")
    refused = caught.value.diagnostic
    assert refused.code == "E710" and "--nnodes 128 with --nproc-per-node 8" in refused.hint
    assert GPT3.read_text()[refused.span.start:refused.span.end].startswith("[dp = 16")  # at the mesh


@pytest.mark.parametrize("options, fits", [
    ({}, False),                                                    # 1,024 ranks here by default: no
    ({"nproc_per_node": 1024}, True),                               # asked for
    ({"nnodes": 128, "rdzv_endpoint": "node0:29500"}, True),        # one node of 128
])
def test_a_multi_node_mesh_starts_on_one_machine_only_when_asked(options, fits):
    plan = api.load_plan(GPT3)
    if fits:
        check_fits(plan, LaunchOptions(**options))
    else:
        with pytest.raises(LaunchError, match=r"mesh spans 1024 devices, 128 nodes of cluster 'dgx_a100 x 128'") \
                as caught:
            check_fits(plan, LaunchOptions(**options))
        assert caught.value.diagnostic.code == "E711" and caught.value.diagnostic.span == plan.mesh.span


@pytest.mark.parametrize("path", sorted((STDLIB / "local").glob("*.plan")), ids=lambda p: p.stem)
def test_every_local_plan_fits_this_machine(path):
    plan = api.load_plan(path)
    # hetero.plan's cluster declares this machine's processes as two nodes of 4 (two device types): it says
    # --nproc-per-node 8, as its comment does
    check_fits(plan, LaunchOptions(nproc_per_node=8) if plan.cluster.name == "local_mixed" else LaunchOptions())


# ---- what `run --dry-run` prints after its table ---------------------------------------------------------
def _dry_run_commands(path, text=None, **options):
    from plandsl.runtime.launch import dry_run_commands
    plan = api.loads(text).plans[0] if text else api.load_plan(path)
    launch_options = LaunchOptions(**options)
    name = path if text else path.relative_to(STDLIB.parent)  # the golden text holds no local path
    return dry_run_commands(plan, torchrun_args(plan, str(name), None, {}, launch_options), launch_options)


def test_dry_run_prints_the_command_for_every_node_of_a_multi_node_plan(golden):
    """GPT-3 on 128 DGX nodes: not `--standalone --nproc-per-node 1024` (which `run` itself refuses), but
    torchrun on each node, with placeholders for the node's index and node 0's address."""
    text = _dry_run_commands(GPT3)
    assert "--standalone" not in text and "--nproc-per-node 1024" not in text
    [note, command] = text.splitlines()
    assert command.split()[:9] == ["torchrun", "--nnodes", "128", "--node-rank", "NODE_RANK", "--rdzv-endpoint",
                                   "HOST:PORT", "--nproc-per-node", "8"]
    assert "NODE_RANK" in note and "0 to 127" in note and "HOST:PORT" in note
    golden("launch/dry_run_gpt3_175b_3d.txt", text + "\n")


def test_dry_run_prints_the_command_the_options_give():
    """One node (the local plans), or nodes the user already named: that command, as `run` would start it."""
    assert _dry_run_commands(LOCAL_3D).startswith("torchrun --standalone --nproc-per-node 8 -m plandsl.run ")
    given = _dry_run_commands(GPT3, nnodes=128, node_rank=3, rdzv_endpoint="node0:29500")
    assert given.startswith("torchrun --nnodes 128 --node-rank 3 --rdzv-endpoint node0:29500 --nproc-per-node 8 ")
    assert _dry_run_commands(GPT3, nproc_per_node=1024).startswith("torchrun --standalone --nproc-per-node 1024 ")


def test_dry_run_names_nodes_holding_fewer_devices():
    """A mesh ending inside a node: that node runs fewer processes, and its command says which node it is."""
    text = _dry_run_commands("partial.plan", """import "clusters/dgx_a100"
plan partial {
  model    = gpt(layers=8, hidden=1024, heads=16, seq=1024, vocab=50304)
  cluster  = dgx_a100 x 3
  mesh     = [dp = 5, pp = 2, tp = 2]
  train    = { global_batch: 40, micro_batch: 2, precision: bf16 }
  data     = zero1 over dp
  tensor   = megatron over tp
  stages   = evenly over pp
  schedule = 1f1b
}
""")
    lines = text.splitlines()
    assert "each of the 3 nodes" in lines[0] and "0 to 2" in lines[0]
    assert lines[1] == "# nodes 2 (4 devices each):" and " --nnodes 3 " in lines[2] and "--nproc-per-node 4 " in lines[2]
    assert lines[3] == "# nodes 0-1 (8 devices each):" and "--nproc-per-node 8 " in lines[4]
    assert all(line.endswith("-m plandsl.run partial.plan --steps 10") for line in lines[2::2])


def test_run_dry_run_ends_with_every_nodes_command():
    """`plandsl run --dry-run` of a two-node plan: the table, then torchrun for each node (not one machine)."""
    from click.testing import CliRunner

    from plandsl.cli import main
    result = CliRunner().invoke(main, ["run", str(STDLIB / "examples" / "data_parallel.plan"), "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("dry run of plan 'gpt2_medium_ddp': 16 of 16 ranks built on the meta device")
    assert lines[-2].startswith("# on each of the 2 nodes, NODE_RANK its index (0 to 1")
    assert lines[-1].startswith("torchrun --nnodes 2 --node-rank NODE_RANK --rdzv-endpoint HOST:PORT "
                                "--nproc-per-node 8 -m plandsl.run ")


@pytest.mark.parametrize("option, value", [("--nproc-per-node", 257), ("--nproc-per-node", 10**12),
                                           ("--nnodes", 131_073)])
def test_run_refuses_a_process_count_past_its_cap_before_reading_the_plan(option, value, tmp_path):
    """`run --nproc-per-node N` would fork N ranks here: past limits.MAX_LOCAL_RANKS it exits 2, naming it."""
    from click.testing import CliRunner

    from plandsl.cli import main
    from plandsl.diagnostics.limits import MAX_LOCAL_RANKS
    result = CliRunner().invoke(main, ["run", str(LOCAL_3D), option, str(value), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output
    if option == "--nproc-per-node":
        assert f"{MAX_LOCAL_RANKS}" in result.output


def test_a_mesh_past_the_local_cap_is_not_offered_on_one_machine():
    with pytest.raises(LaunchError) as error:
        check_fits(api.load_plan(GPT3), LaunchOptions())
    hint = error.value.diagnostic.hint
    assert "--nproc-per-node 1024" not in hint and "--nnodes 128" in hint


# ---- one definition of the ranks' options (runtime.options.RANK_OPTIONS) -----------------------------------
def test_every_rank_option_is_accepted_by_plandsl_run_and_forwarded(tmp_path, monkeypatch):
    """`plandsl run` with a value for every option of the ranks' table: the ranks' own parser reads back
    from torchrun's arguments exactly what was given (the launch itself is replaced by a recorder)."""
    import dataclasses

    import numpy as np
    from click.testing import CliRunner

    from plandsl.cli import main
    from plandsl.runtime.options import RANK_OPTIONS, parse_args
    plan = tmp_path / "dp.plan"
    plan.write_text((STDLIB / "local" / "dp.plan").read_text().replace('import "tiny"\n',
                                                                        'import "local/tiny"\nparam width = 2\n'))
    np.full(4096, 1, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    (tmp_path / "lib").mkdir()
    given = {"steps": 7, "plan_name": "tiny_dp", "param": ["width=3"], "include": [str(tmp_path / "lib")],
             "metrics": str(tmp_path / "m.jsonl"), "check_equivalence": True, "data": str(tmp_path / "tokens.bin"),
             "timeout": 12.5, "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 3, "resume": True,
             "device": "cpu"}
    assert set(given) == {option.dest for option in RANK_OPTIONS}, "give every option of the table a value"
    argv = ["run", str(plan)]
    for option in RANK_OPTIONS:
        value = given[option.dest]
        if option.kind == "flag":
            argv.append(option.flag)
        else:
            for item in value if option.kind == "list" else [value]:
                argv += [option.flag, str(item)]
    launched = []
    monkeypatch.setattr(api, "launch", lambda args: launched.append(args) or 0)
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    (args,) = launched
    ranks = parse_args(args[args.index("plandsl.run") + 1:])
    assert ranks.plan == str(plan)
    assert {option.dest: getattr(ranks, option.dest) for option in RANK_OPTIONS} == given
    # the launcher's options carry every option of the table but those that come with the plan
    fields = {field.name for field in dataclasses.fields(LaunchOptions)}
    assert {o.dest for o in RANK_OPTIONS} - fields == {"plan_name", "param", "include"}


def test_the_ranks_refuse_what_plandsl_run_refuses(tmp_path, capsys):
    """The rule between options is one function: --resume without --checkpoint-dir, on both sides."""
    from click.testing import CliRunner

    from plandsl.cli import main
    from plandsl.runtime.options import parse_args
    with pytest.raises(SystemExit) as caught:
        parse_args([str(LOCAL_3D), "--resume"])
    assert caught.value.code == 2 and "--resume needs --checkpoint-dir" in capsys.readouterr().err
    result = CliRunner().invoke(main, ["run", str(LOCAL_3D), "--resume"])
    assert result.exit_code == 1 and "error[E713]: --resume needs --checkpoint-dir" in result.output


@pytest.mark.parametrize("device, gpus, nproc, refused", [
    (None, 0, 4, None),                   # no GPU: every rank on the CPU, gloo
    (None, 1, 1, None),
    (None, 1, 2, "torch sees 1"),         # two ranks would both take cuda:0 .. and cuda:1 does not exist
    ("cuda", 8, 8, None),
    ("cuda", 2, 4, "torch sees 2"),
    ("cuda", 0, 1, "no CUDA device"),
    ("cpu", 1, 4, None),                  # --device cpu: gloo ranks whatever the GPUs
])
def test_ranks_without_a_device_of_their_own_are_refused_before_launch(monkeypatch, device, gpus, nproc, refused):
    from plandsl.runtime import launch
    monkeypatch.setattr(launch, "cuda_device_count", lambda: gpus)
    if refused is None:
        launch.check_devices(nproc, device)
        return
    with pytest.raises((LaunchError, launch.OptionError), match=refused) as caught:  # an OptionError is no LaunchError
        launch.check_devices(nproc, device)
    assert "--device cpu" in (str(caught.value) if gpus == 0 else caught.value.diagnostic.hint)
    assert getattr(caught.value, "option", None) == ("--device" if gpus == 0 else None)  # exit 2, naming it
    assert getattr(getattr(caught.value, "diagnostic", None), "code", None) == (None if gpus == 0 else "E714")  # exit 1


def test_the_ranks_take_the_device_the_launcher_was_given():
    from plandsl.runtime.options import parse_args
    args = _args(STDLIB / "local" / "dp.plan", device="cpu")
    assert args[args.index("--device") + 1] == "cpu" and parse_args(args[args.index("plandsl.run") + 1:]).device == "cpu"
    with pytest.raises(SystemExit):
        parse_args(["x.plan", "--device", "tpu"])


NVL72 = """import "clusters/gb200_nvl72"
plan rack {
  model    = llama(layers=8, hidden=1024, heads=16, seq=1024, vocab=50304)
  cluster  = gb200_nvl72 x 2
  mesh     = [dp = 18, tp = 8]
  train    = { global_batch: 36, micro_batch: 1, precision: bf16 }
  data     = zero1 over dp
  tensor   = megatron over tp
}
"""


def test_a_rack_scale_node_starts_one_torchrun_per_machine():
    """GB200 NVL72: a node is the 72-GPU NVLink domain, on 18 trays of 4 GPUs (`hosts = 18`). torchrun and Slurm
    start processes per machine, so 144 devices are 36 machines of 4, not 2 machines of 72."""
    plan = api.loads(NVL72).plans[0]
    assert plan.cluster.groups[0].node.devices == 72 and plan.cluster.groups[0].node.host_devices == 4
    with pytest.raises(LaunchError, match=r"mesh spans 144 devices, 36 machines of cluster 'gb200_nvl72 x 2' "
                                          r"\(4 devices each\)") as caught:
        check_fits(plan, LaunchOptions())
    assert caught.value.diagnostic.hint.startswith("start it on every machine with --nnodes 36 ")
    lines = _dry_run_commands("rack.plan", NVL72).splitlines()
    assert "each of the 36 nodes" in lines[0] and len(lines) == 2
    assert " --nnodes 36 " in lines[1] and "--nproc-per-node 4 " in lines[1]
    from plandsl.runtime.submit import node_refusals
    assert node_refusals(plan) == []


def test_hosts_must_share_a_nodes_devices_evenly_and_default_to_one_machine():
    bad = NVL72.replace('import "clusters/gb200_nvl72"', 'import "clusters/dgx_b200"').replace(
        "cluster  = gb200_nvl72 x 2", "cluster  = eights x 18") + (
        "node eights {\n  devices = 8 x b200\n  hosts   = 3\n  link    = { bandwidth: 900 GB/s, latency: 2 us }\n}\n")
    errors = api.checks(bad).errors
    assert [d.code for d in errors] == ["E205"] and errors[0].message.startswith("hosts (3) must divide devices (8)")
    assert bad[errors[0].span.start:errors[0].span.end] == "3" and "1, 2, 4, 8" in errors[0].hint  # at the value
    node = api.loads('import "clusters/dgx_b200"\ncluster c = dgx_b200\n').clusters[0].groups[0].node
    assert node.hosts == 1 and node.host_devices == 8 and "hosts" not in node.model_dump()


def test_an_endpoint_is_read_as_torchrun_reads_it_stripped():
    """torch's `parse_rendezvous_endpoint` strips the endpoint before it splits HOST:PORT, so surrounding whitespace
    is no reason to refuse one (the check once refused ' node0:29500'); inside the host it still is."""
    from plandsl.runtime.launch import endpoint_problem
    assert endpoint_problem(" node0:29500") is None and endpoint_problem("node0:29500 \n") is None
    assert endpoint_problem("node 0:29500") is not None and endpoint_problem(" :29500") is not None


# ---- what the options do not fit is a coded Diagnostic (docs/errors.md, E710-E714), exit 1 -----------------------
@pytest.mark.parametrize("argv, gpus, code, where", [
    (["--nproc-per-node", "3"], 0, "E710", "3d.plan:10:14"),  # 8 devices, 3 processes: at the mesh
    (["--nnodes", "2"], 0, "E712", None),                    # no endpoint: the options', no location
    (["--checkpoint-every", "2"], 0, "E713", None),
    ([], 2, "E714", None),                                   # 8 ranks, 2 GPUs
])
def test_run_reports_options_that_do_not_fit_as_coded_diagnostics(monkeypatch, argv, gpus, code, where):
    """Before, each was an uncoded `FILE: error: ...` line; now a Diagnostic with its code, hint and (where the mesh
    is what they do not fit) the plan's mesh line under a caret. The exit status stays 1."""
    from click.testing import CliRunner

    from plandsl.cli import main
    from plandsl.runtime import launch
    monkeypatch.setattr(launch, "cuda_device_count", lambda: gpus)
    monkeypatch.setattr(api, "launch", lambda args: pytest.fail("launched"))
    result = CliRunner().invoke(main, ["run", str(LOCAL_3D), *argv] + (["--device", "cuda"] if gpus else []))
    assert result.exit_code == 1, result.output
    first = result.output.splitlines()[0]
    assert f"error[{code}]: " in first and "= hint: " in result.output and ": error: " not in result.output
    if where:
        assert first.split(": error")[0].endswith(f"/{where}") and "^" in result.output, result.output
    else:
        assert first.startswith(f"error[{code}]: "), first


def test_run_reports_a_multi_node_mesh_at_its_mesh_line():
    """E711: the mesh of 1,024 devices, with how to start it on every node in the hint."""
    from click.testing import CliRunner

    from plandsl.cli import main
    result = CliRunner().invoke(main, ["run", str(GPT3)])
    assert result.exit_code == 1, result.output
    assert "gpt3_175b_3d.plan:9:14: error[E711]: plan 'gpt3_megatron': its mesh spans 1024" \
        in result.output.splitlines()[0], result.output
    assert "^^^" in result.output and "= hint: start it on every node with --nnodes 128" in result.output
    with pytest.raises(api.PlanError) as caught:  # the api raises the PlanError a script catches
        api.prepare_run(api.load_plan(GPT3), str(GPT3), None, {}, api.launch_options())
    assert [d.code for d in caught.value.diagnostics] == ["E711"]


def _dp_plan(size: int):
    """A plan of `size` devices of dp over dgx_a100 nodes (8 devices each), as few as hold it."""
    return api.loads(f'import "clusters/dgx_a100"\nplan p {{\n  model   = gpt(layers=2, hidden=64, heads=4, seq=32, '
                     f'vocab=256)\n  cluster = dgx_a100 x {-(-size // 8)}\n  mesh    = [dp = {size}]\n  train   = '
                     f'{{ global_batch: {size}, micro_batch: 1 }}\n}}\n').plans[0]


def _started(plan, nnodes: int, nproc: int | None) -> list[str]:
    """torchrun's arguments for `--nnodes nnodes [--nproc-per-node nproc]` (node 0's endpoint where several)."""
    return torchrun_args(plan, "p.plan", None, {}, LaunchOptions(nnodes=nnodes, nproc_per_node=nproc,
                                                                 rdzv_endpoint="node0:29500" if nnodes > 1 else None))


@pytest.mark.parametrize("size", [2, 7, 9, 12, 13, 16, 17, 24, 31, 36])
def test_each_count_the_hints_give_starts_the_mesh(size):
    """E710's hint names options (each alternative a --nnodes and/or --nproc-per-node) that start the mesh, for every
    count given; E711's names the --nnodes that does. A mesh of prime size, or one whose size no node count of the
    cluster's 8-device machines divides (9 on two nodes), included: E711 used to suggest --nnodes 2 for 9 and 13
    devices, which `plandsl run` then refused (E710), and E710's hint said only `a --nnodes that divides 13`."""
    import re
    plan = _dp_plan(size)
    for nnodes in range(1, 5):
        for nproc in (None, 1, 2, 3, 4, 5, 8):
            try:
                _started(plan, nnodes, nproc)
                continue
            except LaunchError as error:
                refused = error.diagnostic
            assert refused.code == "E710", refused.message
            fits = re.fullmatch(r"a node starts one process per device of the mesh on it: give (.*), so that every "
                                r"device has its rank", refused.hint)
            assert fits, refused.hint
            for fit in fits.group(1).split(" or "):
                given = re.search(r"--nnodes (\d+)", fit), re.search(r"--nproc-per-node (\d+)", fit)
                assert any(given), (size, nnodes, nproc, fit)
                _started(plan, int(given[0][1]) if given[0] else nnodes, int(given[1][1]) if given[1] else None)
    if size > 8:
        with pytest.raises(LaunchError) as caught:
            check_fits(plan, LaunchOptions())
        nodes = int(re.match(r"start it on every node with --nnodes (\d+) ", caught.value.diagnostic.hint)[1])
        assert _started(plan, nodes, None)[_started(plan, nodes, None).index("--nproc-per-node") + 1] \
            == str(size // nodes) and size // nodes <= 8, caught.value.diagnostic.hint


@pytest.mark.parametrize("size, gpus", [(8, 2), (8, 3), (12, 5), (7, 4), (16, 6)])
def test_e714s_hint_starts_the_mesh_on_nodes_of_that_many_gpus(monkeypatch, size, gpus):
    """E714's hint (more processes on this node than torch sees GPUs) names a --nproc-per-node within the GPUs and the
    --nnodes that start the mesh with it: `--nproc-per-node 3 with more nodes` for 8 devices was E710 next."""
    import re
    from plandsl.runtime import launch
    monkeypatch.setattr(launch, "cuda_device_count", lambda: gpus)
    plan = _dp_plan(size)
    with pytest.raises(LaunchError) as caught:
        launch.prepare(plan, "p.plan", None, {}, LaunchOptions(nproc_per_node=size))
    hint = caught.value.diagnostic.hint
    nproc, nnodes = re.search(r"--nproc-per-node (\d+) with --nnodes (\d+)", hint).groups()
    assert int(nproc) <= gpus, hint
    launch.prepare(plan, "p.plan", None, {}, LaunchOptions(nproc_per_node=int(nproc), nnodes=int(nnodes),
                                                           rdzv_endpoint="node0:29500"))
