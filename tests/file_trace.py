"""Run a ``tessera`` role with a record of which project files' code runs, between two signals.

``python -m tests.file_trace ROLE ...`` is ``tessera ROLE ...`` with a profile
hook on every thread that notes the file of each Python function called.
SIGUSR1 forgets what was noted (the start of the window), SIGUSR2 writes the
project files noted since then, with the names of the functions that ran in
them, to ``$TESSERA_FILE_TRACE_DIR/<pid>.txt`` (``path<TAB>function`` lines).
The local-cluster launcher starts roles this way with ``entry_module``.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1]) + os.sep
_seen: set[str] = set()


def _hook(frame, event, arg) -> None:
    if event == "call":
        code = frame.f_code
        _seen.add((code.co_filename, code.co_name))


def _forget(signum, frame) -> None:
    _seen.clear()


def _dump(signum, frame) -> None:
    project = sorted((f[len(ROOT):], name) for f, name in set(_seen) if f.startswith(ROOT) and "/.venv/" not in f)
    out = Path(os.environ["TESSERA_FILE_TRACE_DIR"]) / f"{os.getpid()}.txt"
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(f"{path}\t{name}\n" for path, name in project))
    tmp.rename(out)


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _forget)
    signal.signal(signal.SIGUSR2, _dump)
    threading.setprofile(_hook)
    sys.setprofile(_hook)
    from common.cli.main import main

    sys.exit(main(sys.argv[1:]))
