"""A draft process that dies during load, silently, the way a crash there would.

Test-only: `Launcher(cfg, child_modules={"draft": "fault_child"})` starts it in place of
draft_proc (with this folder on PYTHONPATH). It completes the handshake up to Init, then
exits with code 3 before sending Ready or any error.
"""

from __future__ import annotations

import os

from spec_runtime.child import run_child


def build(cfg, init):
    os._exit(3)


if __name__ == "__main__":
    run_child("draft", build)
