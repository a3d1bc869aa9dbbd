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


def _aborts_once(rank: int, marker: str) -> int:
    import os
    if rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()  # as glibc's heap check aborts a rank ("malloc(): unaligned tcache chunk detected")
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return rank


def _aborts(rank: int) -> int:
    import os
    if rank == 0:
        os.abort()
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return rank


def test_ranks_run_again_once_where_a_rank_died_by_a_signal_it_was_not_sent(tmp_path, capfd):
    """A `.ci/run` on a loaded machine failed test_state_dtypes' fsdp_bf16_weights: its rank 0 aborted ("malloc():
    unaligned tcache chunk detected") and rank 1 raised at the collective it was waiting in; the same test passes alone.
    The ranks run again once, saying so on stderr; a rank that dies so again fails the test, naming the signal."""
    assert harness.run_ranks(2, _aborts_once, str(tmp_path / "aborted"), deadline_s=20.0) == [0, 1]
    assert "running the 2 ranks again once" in capfd.readouterr().err
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0\] died by signals \{0: -6\} without a result \(twice"):
        harness.run_ranks(2, _aborts, deadline_s=20.0)
