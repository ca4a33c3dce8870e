"""Run a script in a fresh interpreter with Triton compiling for real: the kernel tests that
run under Triton's interpreter set TRITON_INTERPRET for this process, and Triton reads it
once, at its import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_json(script: str, *args: str, timeout: float = 300):
    """The JSON the script prints last, run with this repository on its path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
