"""Busy neighbours in a server's own session (the `busy` part of `bench cpu`).

    python -m loadtest.neighbours --count 4 --switch /tmp/on -- python -m service.cli serve

starts COUNT processes that spin while the switch file exists and sleep while it does not, then becomes the command
(exec), so the neighbours are its children in its session. Linux's scheduler shares CPU fairly between sessions
(autogroups) and by nice value inside one; neighbours in the same session are how a CI job's other work, or a
container's, competes with the service. They leave when the command's process is gone (ManagedProcess.stop also
kills its whole session).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# sleeps 50 ms while the switch is off; spins in 200 ms slices while it is on; leaves once reparented
SPIN = """
import os, sys, time
switch, parent = sys.argv[1], os.getppid()
while os.getppid() == parent:
    if not os.path.exists(switch):
        time.sleep(0.05)
        continue
    until = time.monotonic() + 0.2
    while time.monotonic() < until:
        pass
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.neighbours", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, required=True, help="spinning processes")
    parser.add_argument("--switch", required=True, help="they spin while this file exists")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run in this process")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to run is required (after --)")
    for _ in range(args.count):
        subprocess.Popen([sys.executable, "-c", SPIN, args.switch])
    os.execvp(command[0], command)


if __name__ == "__main__":
    raise SystemExit(main())
