"""A user's own module with its own tensor-parallel plan (a `tp_plan` dict, torch's styles by FQN pattern), for
tests/unit/test_torch_names.py: Megatron's pair in each block, or with a typo (`typo=true`: `layers.*.upp`)."""
from inspect_models.tiny import Tiny


class Planned(Tiny):
    def __init__(self, typo: bool):
        super().__init__(vocab=128, width=32, ffn=64, depth=2, tied=False)
        self.tp_plan = {f"layers.*.{'upp' if typo else 'up'}": "colwise", "layers.*.down": "rowwise"}


def build(typo: bool = False) -> Planned:
    return Planned(typo)
