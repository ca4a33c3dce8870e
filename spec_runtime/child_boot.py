"""First code a child process runs: tie its life to the launcher's, then start the role.

    python -m spec_runtime.child_boot ROLE --parent-pid PID [--module MODULE] [the role's own arguments]

Before the role's imports (torch takes seconds), the child asks Linux for SIGTERM when
its parent dies (prctl PR_SET_PDEATHSIG) and then checks that its parent is still the
launcher that started it: a parent that died before the prctl would otherwise never be
noticed, since the child is already re-parented. Then the role's module (target_proc,
draft_proc, or target_proc.follower for a tensor-parallel rank of the target; --module
names another) runs as if started with `python -m`, given `--parent-pid PID` after its
own arguments. This module imports nothing heavy, so the window is milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1
ROLES = {"target": "target_proc", "draft": "draft_proc", "target-rank": "target_proc.follower"}


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM on the parent's death (Linux), and exit now if `parent_pid` is already gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the parent-watch thread of spec_runtime.child still covers it
    if os.getppid() != parent_pid:
        os._exit(1)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] not in ROLES or argv[1] != "--parent-pid":
        sys.exit(f"usage: python -m spec_runtime.child_boot {{{','.join(ROLES)}}} --parent-pid PID "
                 f"[--module MODULE] ARGS...")
    role, parent_pid, rest = argv[0], int(argv[2]), argv[3:]
    module = ROLES[role]
    if rest[:1] == ["--module"] and len(rest) >= 2:
        module, rest = rest[1], rest[2:]
    die_with_parent(parent_pid)
    sys.argv = [module, *rest, "--parent-pid", str(parent_pid)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
