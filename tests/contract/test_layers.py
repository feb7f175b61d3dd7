"""The layering of .importlinter holds (docs/architecture.md): the API and the operator side by side on the
contract, the contract free of web, database and torch, the trainer alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_import_contracts_hold():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    # The packages as this test process imports them (a worktree's folders before an installed copy).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([str(lint_imports), "--config", str(REPO / ".importlinter"), "--no-cache"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
