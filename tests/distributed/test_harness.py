"""The forked ranks' harness itself (`tests.distributed.harness`)."""
import socket

import pytest

from tests.distributed import harness

pytestmark = pytest.mark.dist


def _joins(rank: int) -> int:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return dist.get_world_size() * 10 + rank


def test_ranks_run_again_on_another_port_where_the_free_one_was_taken(monkeypatch):
    """`free_port` finds a port free and lets it go; another process (another test run on the machine) can take it
    before rank 0's store binds it, and the rank raised EADDRINUSE at `init_process_group` (a `.ci/run` beside other
    test runs failed test_local_plans' pp_custom_schedule so). The ranks run again on a fresh port."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    found = harness.free_port
    monkeypatch.setattr(harness, "free_port", lambda: next(ports, None) or found())
    with taken:
        assert harness.run_ranks(2, _joins, deadline_s=20.0) == [20, 21]
    assert next(ports, None) is None  # the taken port was tried first
