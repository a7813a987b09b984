"""``fcl simulate --help-method NAME``: a method's summary and every option with its type,
default and help text, printed before the scenario and ``--out`` are asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.timescale import scaled

import methods
from fcl_edge.cli import main
from fclcore.config import options_help


@pytest.mark.parametrize("name", methods.names())
def test_every_option_of_every_method_says_what_it_does(name: str) -> None:
    fields = options_help(methods.lookup(name).options)
    assert fields and all(text for _, _, text in fields), [field for field, _, text in fields if not text]


def test_help_method_prints_the_summary_and_each_option(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--help-method", "fedavgm"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"fedavgm: {methods.lookup('fedavgm').summary}"
    assert "  server_momentum: float = 0.9\n      server momentum beta" in out
    assert "  order_per: one of ['batch', 'round'] = 'batch'\n" in out  # the MADE base's option, with its help


def test_a_preset_keeps_its_base_options_help() -> None:
    base = dict((name, text) for name, _, text in options_help(methods.lookup("filver").options))
    preset = {name: (default, text) for name, default, text in options_help(methods.lookup("filver-stats").options)}
    assert preset["upload"] == ("one of ['z', 'stats', 'none'] = 'stats'", base["upload"])


def test_an_unknown_method_is_one_line_and_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fcl_edge.cli", "simulate", "--help-method", "fedavgg"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--help-method: federation.method: unknown method 'fedavgg'" in proc.stderr.splitlines()[-1]
