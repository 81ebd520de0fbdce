"""The examples in jshard's docstrings run (under the 8-device set-up of conftest.py)."""

import doctest
import importlib
import pkgutil

import pytest

import jshard

MODULES = sorted(m.name for m in pkgutil.walk_packages(jshard.__path__, "jshard.")
                 if m.name not in ("jshard.demo", "jshard.tour"))


@pytest.mark.parametrize("name", ["jshard", *MODULES])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
