"""The systemd units in deploy/systemd and the exit-code table they rely on.

Always: a structural check of each unit (the keys service mode depends on, an ExecStart
that the real ``fcl`` parser accepts). Where ``systemd-analyze`` exists: ``verify`` on
the unit with @VENV@ substituted, and the offline security score.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.timescale import scaled

from fcl_edge.cli import _parser
from fclcore.exitcodes import ExitCode

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"fcl-aggregator": "aggregator", "fcl-client": "client"}  # unit name -> fcl subcommand


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's INI dialect: repeated keys accumulate (configparser would reject them)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if current is None or not sep or not key.strip().isidentifier():
            raise ValueError(f"line {number}: not a key=value in a section: {raw!r}")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict, section: str, key: str) -> str:
    values = unit.get(section, {}).get(key)
    assert values, f"[{section}] {key}= is missing"
    assert len(values) == 1, f"[{section}] {key}= given {len(values)} times: {values}"
    return values[0]


def load(name: str) -> dict:
    return parse_unit((ROOT / "deploy" / "systemd" / f"{name}.service").read_text())


REQUIRED = {  # (section, key) -> exact value, or None for "present"
    ("Unit", "Description"): None,
    ("Service", "Type"): "notify",
    ("Service", "NotifyAccess"): "main",
    ("Service", "User"): "fcl",
    ("Service", "WatchdogSec"): None,
    ("Service", "TimeoutStopSec"): None,
    ("Service", "KillSignal"): "SIGTERM",
    ("Service", "Restart"): "on-failure",
    ("Service", "RestartPreventExitStatus"): None,  # PREVENT below
    ("Service", "SuccessExitStatus"): str(int(ExitCode.INTERRUPTED)),
    ("Service", "NoNewPrivileges"): "yes",
    ("Service", "ProtectSystem"): "strict",
    ("Service", "ProtectHome"): "yes",
    ("Service", "PrivateTmp"): "yes",
    ("Install", "WantedBy"): "multi-user.target",
}


PREVENT = {  # exit codes a restart cannot help: bad input; a device refusing a newer run, or stuck in a stale one
    "client": f"{int(ExitCode.BAD_INPUT)} {int(ExitCode.OTHER_RUN)} {int(ExitCode.RUN_STALLED)}",
    "aggregator": str(int(ExitCode.BAD_INPUT)),
}


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_has_the_service_mode_keys(name):
    unit = load(name)
    assert one(unit, "Service", "RestartPreventExitStatus") == PREVENT[UNITS[name]]
    for (section, key), expected in REQUIRED.items():
        value = one(unit, section, key)
        if expected is not None:
            assert value == expected, f"{name}: [{section}] {key}={value}, expected {expected}"
    assert one(unit, "Service", "EnvironmentFile") == f"-/etc/fcl-edge/{UNITS[name]}.env"


@pytest.mark.parametrize("name", sorted(UNITS))
def test_execstart_is_a_real_fcl_subcommand(name):
    argv = shlex.split(one(load(name), "Service", "ExecStart"))
    assert argv[0] == "@VENV@/bin/fcl", argv
    assert argv[1:] == [UNITS[name], "--config", f"/etc/fcl-edge/{UNITS[name]}.yaml"]
    args = _parser().parse_args(argv[1:])  # the real parser: a renamed option fails here
    assert args.command == UNITS[name] and args.config == argv[3]
    help_out = subprocess.run(
        [sys.executable, "-m", "fcl_edge.cli", UNITS[name], "--help"],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert help_out.returncode == 0, help_out.stderr
    assert "--config" in help_out.stdout


@pytest.mark.parametrize("name", sorted(UNITS))
def test_state_directory_is_the_shipped_out_dir(name):
    """The service config's out_dir must be the one directory the sandbox lets it write."""
    unit = load(name)
    state = one(unit, "Service", "StateDirectory")
    cfg = yaml.safe_load((ROOT / "configs" / "services" / f"{UNITS[name]}.yaml").read_text())
    assert cfg["out_dir"] == f"/var/lib/{state}"
    assert one(unit, "Service", "WorkingDirectory") == f"%S/{state}"


def test_parser_rejects_garbage():
    with pytest.raises(ValueError):
        parse_unit("[Service]\nType notify\n")
    assert parse_unit("[S]\nEnvironment=A=1\nEnvironment=B=2\n") == {"S": {"Environment": ["A=1", "B=2"]}}


def _installed_units(tmp_path: Path) -> list[Path]:
    """The units as the installer writes them: @VENV@ replaced by a venv with a working fcl."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    fcl = bin_dir / "fcl"
    fcl.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m fcl_edge.cli "$@"\n')
    fcl.chmod(0o755)
    out = []
    for name in sorted(UNITS):
        text = (ROOT / "deploy" / "systemd" / f"{name}.service").read_text()
        path = tmp_path / f"{name}.service"
        path.write_text(text.replace("@VENV@", str(tmp_path / "venv")))
        assert "@" + "VENV@" not in path.read_text()
        out.append(path)
    return out


def test_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd); structural checks above still ran")
    for path in _installed_units(tmp_path):
        argv = shlex.split(one(parse_unit(path.read_text()), "Service", "ExecStart"))
        ran = subprocess.run([argv[0], argv[1], "--help"], capture_output=True, text=True, timeout=scaled(120))
        assert ran.returncode == 0, ran.stderr
        result = subprocess.run(
            [analyze, "verify", str(path)], capture_output=True, text=True, cwd=tmp_path, timeout=scaled(60)
        )
        ours = [line for line in (result.stdout + result.stderr).splitlines() if path.name in line]
        assert result.returncode == 0 and not ours, result.stdout + result.stderr


def test_systemd_security_exposure(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    for path in _installed_units(tmp_path):
        result = subprocess.run(
            [analyze, "security", "--offline=yes", str(path)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=scaled(60),
        )
        if "--offline" in result.stderr:
            pytest.skip(f"systemd-analyze too old for --offline: {result.stderr.strip()}")
        match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
        assert match, result.stdout + result.stderr
        assert float(match.group(1)) <= 3.0, f"{path.name}: exposure {match.group(1)}; hardening was lost"


# -- exit codes ------------------------------------------------------------------------------
_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([A-Z_]+)`\s*\|", re.MULTILINE)


def documented_codes(text: str) -> dict[int, str]:
    rows = _ROW.findall(text)
    codes = {int(number): name for number, name in rows}
    assert len(codes) == len(rows), f"a number is documented twice: {rows}"
    return codes


def test_every_exit_code_is_documented_once():
    codes = documented_codes((ROOT / "docs" / "exit-codes.md").read_text())
    enum = {int(member): member.name for member in ExitCode}
    missing = {n: name for n, name in enum.items() if codes.get(n) != name}
    extra = {n: name for n, name in codes.items() if n not in enum}
    assert not missing, f"ExitCode members not in docs/exit-codes.md (or under another name): {missing}"
    assert not extra, f"docs/exit-codes.md documents numbers ExitCode lacks: {extra}"


def test_exit_code_table_parser_sees_drift():
    doc = "| 0 | `OK` | fine |\n| 2 | `BAD_INPUT` | no |\n| 99 | `NEW` | ? |\n"
    assert documented_codes(doc) == {0: "OK", 2: "BAD_INPUT", 99: "NEW"}
    with pytest.raises(AssertionError):
        documented_codes("| 1 | `A` | x |\n| 1 | `B` | y |\n")
