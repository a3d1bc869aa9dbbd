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
    with pytest.raises(LaunchError, match=r"--nnodes 128 needs --rdzv-endpoint"):
        _args(GPT3, nnodes=128)
    with pytest.raises(LaunchError, match=r"mesh has 1024 devices, but nnodes\(2\) \* nproc-per-node\(8\) = 16"):
        _args(GPT3, nnodes=2, nproc_per_node=8, rdzv_endpoint="node0:29500")


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
        with pytest.raises(LaunchError, match=r"mesh spans 1024 devices, 128 nodes of cluster 'dgx_a100 x 128'"):
            check_fits(plan, LaunchOptions(**options))


@pytest.mark.parametrize("path", sorted((STDLIB / "local").glob("*.plan")), ids=lambda p: p.stem)
def test_every_local_plan_fits_this_machine(path):
    check_fits(api.load_plan(path), LaunchOptions())
