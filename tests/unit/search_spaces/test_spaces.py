"""Every search space names a registered method and only that method's declared parameters."""

from __future__ import annotations

import pytest

from dpsweep.core.params import Param
from dpsweep.search_spaces import SGD_CLIP, SPACES, STEP, Range, Space, searched_params
from dpsweep.trainables.dp.contract import CLIP
from dpsweep.trainables.methods import METHODS
from dpsweep.trainables.methods.dpsgd import DPSGD


@pytest.mark.parametrize("name", sorted(SPACES))
def test_space_names_a_registered_method_and_its_declared_params(name: str) -> None:
    space = SPACES[name]
    assert METHODS[name] is space.method
    declared = space.method.declaration()
    keys = set(space.ranges)
    if space.per_model is not None:
        keys |= set(space.per_model(4))
    assert keys <= set(declared.names), keys - set(declared.names)
    assert STEP not in keys
    if space.step is not None:
        assert "clip_norm" in space.ranges and "lr" in declared
    assert searched_params(name) <= set(declared.names)


def test_every_method_has_a_space() -> None:
    assert set(SPACES) == set(METHODS)


def test_a_space_over_an_undeclared_parameter_is_refused() -> None:
    extra = Param("not_declared", 1.0, "a parameter no method declares")
    with pytest.raises(RuntimeError, match="undeclared"):
        Space(method=DPSGD, ranges={CLIP.name: SGD_CLIP, extra.name: Range(0.1, 1.0)})
