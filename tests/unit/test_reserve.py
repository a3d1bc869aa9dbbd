"""A device's reserve: the memory no plan's tensors may use (docs/cost-model.md, "Reserve")."""
import pytest

from plandsl import api, ir

GIB = 2**30


def _text(memory: str, reserve: str | None = None, micro_batch: int = 4) -> str:
    line = f"  reserve = {reserve}\n" if reserve is not None else ""
    return (f"device d {{\n  memory = {memory}\n  bandwidth = 100 GB/s\n  peak = {{ fp32: 1 TFLOP/s }}\n{line}}}\n"
            "node n {\n  devices = 2 x d\n  link = { bandwidth: 10 GB/s }\n}\n"
            "model m = gpt(layers=2, hidden=256, heads=4, seq=512, vocab=32000)\n"
            "plan p {\n  model = m\n  cluster = n\n  mesh = [dp = 2] over devices[0:2]\n"
            f"  train = {{ global_batch: 8, micro_batch: {micro_batch}, precision: fp32 }}\n}}\n")


def _codes(text: str) -> list[str]:
    return [d.code for d in api.checks(text).diagnostics if d.severity == "error"]


def _total(text: str) -> float:
    return api.estimate(api.select_plan(api.loads(text))).peak_memory_bytes


def test_a_device_keeps_the_reserve_its_description_gives():
    device = api.select_plan(api.loads(_text("10 GiB"))).cluster.groups[0].node.device
    assert device.reserve is None and device.usable_memory == pytest.approx(10 * GIB * (1 - ir.DEFAULT_RESERVE))
    assert ir.DEFAULT_RESERVE == 0.08  # docs/cost-model.md, "Reserve"
    written = api.select_plan(api.loads(_text("10 GiB", "512 MiB"))).cluster.groups[0].node.device
    assert written.reserve == 512 * 2**20 and written.usable_memory == 10 * GIB - 512 * 2**20


def test_the_memory_check_leaves_the_reserve_free():
    """A plan whose tensors fit the device's memory but not what its reserve leaves is E503, naming the
    reserve, whether the description gives it or the default (8 %) does; with `reserve = 0 GiB` it fits."""
    total = _total(_text("100 GiB"))
    memory = f"{total / 0.96 / GIB:.4f} GiB"  # the tensors take 96 % of it: inside memory, outside the 92 %
    reserve = f"{0.08 * total / 0.96 / GIB:.4f} GiB"
    assert _codes(_text(memory)) == ["E503"]
    assert _codes(_text(memory, reserve)) == ["E503"]
    [message] = [d.message for d in api.checks(_text(memory, reserve)).diagnostics if d.code == "E503"]
    assert "less a reserve of" in message
    assert _codes(_text(memory, "0 GiB")) == []
    estimate = api.estimate(api.select_plan(api.loads(_text(memory, "0 GiB"))))
    assert estimate.fits and estimate.memory[0].total <= estimate.capacity[0]


@pytest.mark.parametrize("reserve", ["10 GiB", "12 GiB"])
def test_a_reserve_that_leaves_nothing_is_e205(reserve):
    analysis = api.checks(_text("10 GiB", reserve))
    [error] = [d for d in analysis.diagnostics if d.severity == "error"]
    assert error.code == "E205" and "leaves nothing" in error.message


def test_a_reserve_is_a_size():
    assert _codes(_text("10 GiB", "2 GB/s")) == ["E203"]


def test_the_search_proposes_no_plan_inside_the_reserve():
    """generate on devices the model nearly fills: the plan written with micro-batch 4 takes 96 % of a
    device, so the search must find layouts whose counted tensors stay below memory − reserve (ZeRO,
    a smaller micro-batch, recomputation), and proposes nothing above that."""
    from plandsl.search import Problem, search
    memory = _total(_text("100 GiB")) / 0.96
    analysis = api.checks(_text(f"{memory / GIB:.4f} GiB", f"{0.08 * memory / GIB:.4f} GiB"))
    assert [d.code for d in analysis.errors] == ["E503"]  # the written plan does not fit what the reserve leaves
    plan = analysis.document.plans[0]
    result = search(Problem(plan.model, plan.cluster, 8, 512), top=20)
    assert result.candidates
    for scored in result.candidates:
        estimate = scored.estimate
        assert all(c == pytest.approx(0.92 * memory, rel=1e-3) for c in estimate.capacity)
        assert all(m.total <= c for m, c in zip(estimate.memory, estimate.capacity))
