"""scripts/install-client.sh into a fake root: venv, config, unit, enable; then uninstall and purge.

The virtualenv sees the system site-packages, so torch and friends are not downloaded again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.timescale import scaled

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install-client.sh"
UNIT = Path("etc/systemd/system/fcl-client.service")
WANTS = Path("etc/systemd/system/multi-user.target.wants/fcl-client.service")


def install(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow  # 18 s on an idle 2-core machine, ~60 s when it is busy
def test_install_then_uninstall_in_a_fake_root(tmp_path):
    root, venv = tmp_path / "root", tmp_path / "venv"
    common = ["--root", str(root), "--prefix", str(venv)]
    done = install(*common, "--no-systemd", "--system-site-packages")
    assert done.returncode == 0, done.stdout + done.stderr

    fcl = subprocess.run(
        [str(venv / "bin" / "fcl"), "client", "--help"],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        cwd=tmp_path,
    )
    assert fcl.returncode == 0 and "--config" in fcl.stdout, fcl.stderr
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import fcl_edge; print(fcl_edge.__file__)"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        cwd=tmp_path,
    )
    assert where.stdout.startswith(str(venv)), where.stdout  # the venv's copy, not the checkout

    unit = (root / UNIT).read_text()
    assert f"ExecStart={venv}/bin/fcl client --config /etc/fcl-edge/client.yaml" in unit
    assert "@VENV@" not in unit
    config = root / "etc/fcl-edge/client.yaml"
    assert config.read_text() == (ROOT / "configs/services/client.yaml").read_text()
    assert (root / "etc/fcl-edge/client.env").stat().st_mode & 0o077 == 0  # secrets: root only
    assert not (root / WANTS).exists()  # --no-systemd

    config.write_text("client_id: my-device\n")  # an operator's edit survives a re-install
    if shutil.which("systemctl"):
        again = install(*common, "--system-site-packages")  # now with systemd: systemctl --root enable
        assert again.returncode == 0, again.stdout + again.stderr
        assert "reusing the virtualenv" in again.stdout
        assert (root / WANTS).is_symlink()
    assert config.read_text() == "client_id: my-device\n"

    gone = install(*common, "--uninstall")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert not venv.exists() and not (root / UNIT).exists() and not (root / WANTS).exists()
    assert config.exists() and (root / "etc/fcl-edge/client.env").exists()  # kept without --purge

    purged = install(*common, "--uninstall", "--purge", "--no-systemd")
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert not (root / "etc/fcl-edge").exists()


def test_dry_run_changes_nothing(tmp_path, monkeypatch):
    root, venv, tmp = tmp_path / "root", tmp_path / "venv", tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # where a staged copy of the checkout would go
    done = install("--root", str(root), "--prefix", str(venv), "--no-systemd", "--dry-run", timeout=scaled(120))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "+ " in done.stdout and "-m venv" in done.stdout and "fcl-client.service" in done.stdout
    assert "would stage a clean copy" in done.stdout and "virtualenvs" in done.stdout
    assert not root.exists() and not venv.exists()
    assert list(tmp.iterdir()) == []  # nothing staged: no copy of the checkout (nor of a .venv in it)


def test_uninstall_refuses_to_remove_what_is_not_a_venv(tmp_path):
    precious = tmp_path / "data"
    precious.mkdir()
    (precious / "keep.txt").write_text("x")
    done = install(
        "--root", str(tmp_path / "root"), "--prefix", str(precious), "--no-systemd", "--uninstall", timeout=scaled(60)
    )
    assert done.returncode == 2 and "pyvenv.cfg" in done.stderr
    assert (precious / "keep.txt").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unknown option"),
        (["--purge"], "--purge only goes with --uninstall"),
        (["--prefix", "/opt/with space/venv", "--dry-run"], "no spaces"),
        (["--source", "/nonexistent/fcl-edge", "--dry-run"], "no such file"),
    ],
)
def test_bad_arguments_exit_2(tmp_path, args, message):
    done = install("--root", str(tmp_path / "root"), *args, timeout=scaled(60))
    assert done.returncode == 2 and message in done.stderr, done.stdout + done.stderr


def test_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    scripts = [str(ROOT / "scripts" / name) for name in ("install-client.sh", "arm64-check.sh")]
    done = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stdout
