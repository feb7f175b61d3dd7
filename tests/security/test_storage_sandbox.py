"""The embedded default's last line: trainers run under Landlock, so even with every storage check bypassed they
cannot read the server's database or token, nor another tenant's folder; they still write their own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kembed_api.backends.base import Launch
from kembed_api.backends.local import LocalBackend
from kembed_contract.spec import JobSpec
from kembed_contract.storage_policy import StoragePolicy
from kembed_platform import sandbox
from tests.builders import make_spec
from tests.security.storage_layout import SECRET, make_layout

pytestmark = pytest.mark.skipif(sandbox.abi_version() < 1, reason="the kernel has no Landlock")

_PROBE = """
import os, sys
for path in sys.argv[1:]:
    mode = "w" if path.endswith(".new") else "r"
    try:
        with open(path, mode) as f:
            f.write("x") if mode == "w" else f.read()
        print("allowed", path)
    except OSError as error:
        print("denied", path, error.errno)
"""


def _probe(read: list[str], write: list[str], paths: list[str]) -> dict[str, str]:
    """What a sandboxed process may open of `paths`: {path: allowed | denied}."""
    args = [f"--read={p}" for p in (*read, *sandbox.python_paths())] + [f"--write={p}" for p in write]
    out = subprocess.run([sys.executable, "-m", "kembed_platform.sandbox", *args, "--", sys.executable, "-c", _PROBE,
                          *paths], capture_output=True, text=True, timeout=60, check=True).stdout
    return {line.split()[1]: line.split()[0] for line in out.splitlines()}


def test_a_folder_that_contains_the_data_dir_is_granted_without_it(tmp_path):
    layout = make_layout(tmp_path)
    (tmp_path / "zz-link").symlink_to(layout.data_dir)  # granted as where it points: left out too
    read, write = sandbox.rules(read=[*sandbox.SYSTEM_READ, str(tmp_path)], write=[],
                                denied=[str(layout.data_dir)], granted_inside_denied=[str(layout.folder("b"))])
    seen = _probe(read, write, [str(layout.outside / "secret.csv"), str(layout.data_dir / "admin-token"),
                                str(layout.data_dir / "kembed.db"), str(layout.folder("a") / "job-a/step-10/COMPLETE"),
                                str(layout.folder("b") / "mine.new"), str(layout.folder("a") / "theirs.new"),
                                str(tmp_path / "zz-link" / "admin-token")])
    assert seen == {str(layout.outside / "secret.csv"): "allowed",
                    str(layout.data_dir / "admin-token"): "denied",
                    str(layout.data_dir / "kembed.db"): "denied",
                    str(layout.folder("a") / "job-a/step-10/COMPLETE"): "denied",
                    str(layout.folder("b") / "mine.new"): "allowed",
                    str(layout.folder("a") / "theirs.new"): "denied",
                    str(tmp_path / "zz-link" / "admin-token"): "denied"}


def test_other_processes_environment_is_out_of_reach():
    """The server's environment (a bootstrap admin token, a database password) through /proc."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={"KEMBED_BOOTSTRAP_ADMIN_TOKEN": SECRET})
    try:
        environ = f"/proc/{holder.pid}/environ"
        deadline = time.monotonic() + 30
        while SECRET not in Path(environ).read_text():  # readable without the sandbox, once it has exec'd
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _probe(list(sandbox.SYSTEM_READ), [], [environ]) == {environ: "denied"}
    finally:
        holder.kill()
        holder.wait()


def test_a_trainer_whose_checks_were_all_bypassed_still_cannot_read_the_admin_token(tmp_path):
    """The local backend, launching a job whose spec and policy (both forged here) let it read anything: the
    kernel refuses, the job fails, and its logs hold no trace of the token."""
    layout = make_layout(tmp_path)
    spec = make_spec("bypass").build()
    spec["trainer"]["data"] = {"kind": "table", "uri": str(layout.data_dir / "admin-token"), "label": "label",
                               "sparse": {f"c{i}": "c" for i in range(8)}, "eval_fraction": 0.0}
    spec["trainer"]["checkpoint"] = {"uri": str(layout.folder("b") / "bypass")}
    anything = StoragePolicy(own=(layout.folder("b").as_uri(),), read=(f"file://{tmp_path.anchor}tmp",))
    backend = LocalBackend(data_dir=layout.data_dir, slots=1, sandbox="landlock", stop_grace_s=10)
    backend.start(Launch(job_id="bypass-x1y2z", tenant="b", spec=JobSpec.model_validate(spec), attempt=1,
                         report_url="http://127.0.0.1:1/none", report_token="t", storage_policy=anything))
    deadline = time.monotonic() + 300
    while (ended := backend.poll("bypass-x1y2z")) is None:
        assert time.monotonic() < deadline, "the trainer did not end"
        time.sleep(0.5)
    logs = backend.read_logs("bypass-x1y2z")
    assert not ended.succeeded
    assert "Permission denied" in logs or "PermissionError" in logs, logs[-2000:]
    assert SECRET not in logs and SECRET not in ended.message
