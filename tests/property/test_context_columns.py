"""Context parallelism's split of a sequence (`runtime.context_parallel.sequence_columns`): every
token on exactly one rank, as many on each, and with the head-tail split the same causal work."""
from hypothesis import given
from hypothesis import strategies as st

from support import lazy

context_parallel = lazy("plandsl.runtime.parallel.context_parallel")


@given(cp=st.integers(1, 16), chunks=st.integers(1, 8), balanced=st.booleans())
def test_every_token_on_one_rank_and_the_causal_work_balanced(cp, chunks, balanced):
    seq = (2 * cp if balanced else cp) * chunks
    if not balanced and seq % (2 * cp) == 0:
        seq += cp  # odd number of chunks per rank pair: the contiguous split
        chunks = seq // cp
    parts = [context_parallel.sequence_columns(seq, rank, cp).tolist() for rank in range(cp)]
    assert sorted(p for part in parts for p in part) == list(range(seq))
    assert all(len(part) == seq // cp for part in parts)
    assert all(part == sorted(part) for part in parts)
    work = {sum(p + 1 for p in part) for part in parts}  # keys each rank's queries attend to
    if seq % (2 * cp) == 0:
        assert len(work) == 1
    else:
        assert parts == [list(range(r * chunks, (r + 1) * chunks)) for r in range(cp)]
