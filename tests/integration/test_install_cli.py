"""
`rhapsode install`, `jobs`, `uninstall` and `reinstall` as a person runs them, against a
real `rhapsode serve`: the licence is asked for or refused, Ctrl-C detaches from a job that
goes on, `rhapsode jobs JOB` follows it to its end, and an uninstall removes it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from _worker import get, interruptible, serving_core, wait_for

RHAPSODE = str(Path(sys.executable).parent / "rhapsode")


def rhapsode(port: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RHAPSODE, *args, "--url", f"http://127.0.0.1:{port}"], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_install_asks_for_the_licence_detaches_on_ctrl_c_and_follows_again(tmp_path: Path) -> None:
    """
    Without a terminal, installing Piper without --accept or --yes prints both licences
    and refuses, exit 1, starting no job; `rhapsode install tone` prints a line per step;
    Ctrl-C detaches with exit 130, naming the job, which goes on; `rhapsode jobs JOB`
    follows it to done; `rhapsode jobs` lists it; `rhapsode uninstall tone` removes it.
    """
    with serving_core(tmp_path, {}, install={"venvDir": str(tmp_path / "venvs")}) as (_, port):
        refused = rhapsode(port, "install", "piper")
        assert refused.returncode == 1
        assert "weights CC0-1.0 AND LicenseRef-Blizzard-2013-Lessac-Research (commercial use: NO)" in refused.stdout
        assert "--accept 'CC0-1.0 AND LicenseRef-Blizzard-2013-Lessac-Research'" in refused.stderr
        assert get(port, "/installs") == []

        process = subprocess.Popen([RHAPSODE, "install", "tone", "--url", f"http://127.0.0.1:{port}"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   stdin=subprocess.DEVNULL, preexec_fn=interruptible)
        assert process.stdout is not None
        lines = []
        while True:
            line = process.stdout.readline()
            assert line, "".join(lines) + process.stderr.read() if process.stderr else ""
            lines.append(line)
            if line.startswith("packages (2/4)"):
                break
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
        assert process.returncode == 130, out + err
        assert lines[0] == "Tone: code MIT; weights MIT (commercial use: yes)\n"
        assert lines[1] == "venv (1/4)\n"
        (job,) = get(port, "/installs")
        assert f"detached: the install of tone goes on in the server. Follow it again with `rhapsode jobs {job['id']}`" in out

        followed = rhapsode(port, "jobs", job["id"])
        assert followed.returncode == 0, followed.stdout + followed.stderr
        assert followed.stdout.splitlines()[-1] == "install tone: done"
        assert get(port, f"/installs/{job['id']}")["state"] == "succeeded"
        listed = rhapsode(port, "jobs")
        assert listed.returncode == 0 and job["id"] in listed.stdout and "succeeded" in listed.stdout
        finished = rhapsode(port, "jobs", job["id"])
        assert finished.stdout == "install tone: succeeded\n"

        said = rhapsode(port, "say", "tone", "Installed from the command line.", "-o", str(tmp_path / "a.wav"))
        assert said.returncode == 0, said.stderr
        again = rhapsode(port, "install", "tone")
        assert again.returncode == 1 and again.stderr.startswith("conflict: ")

        gone = rhapsode(port, "uninstall", "tone")
        assert gone.returncode == 0, gone.stderr
        assert get(port, "/engines") == []
        missing = rhapsode(port, "uninstall", "tone")
        assert missing.returncode == 1 and missing.stderr.startswith("unknown_engine: ")
