"""Running the CLI in tests: one error line a bad command gives, and, in a fresh interpreter,
what a command imports before it answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def error_line(argv, capsys) -> str:
    """`outpace argv` run here must fail with exit code 2 and one `outpace: error:` line on
    stderr: that line's text after the prefix."""
    from outpace.entrypoints.cli import main
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("outpace: error: "), err
    return err[0][len("outpace: error: "):]


def exit_codes_without(cases: list, modules: tuple = ("torch",)) -> list:
    """Run `outpace` with each argv of `cases` in one fresh interpreter and return the exit
    codes; fails if any of `modules` was imported by then (the checks that must come first)."""
    code = ("import sys, json\n"
            "from outpace.entrypoints.cli import main\n"
            "rcs = []\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    try:\n"
            "        rcs.append(main(argv))\n"
            "    except SystemExit as e:\n"
            "        rcs.append(e.code)\n"
            "for m in json.loads(sys.argv[2]):\n"
            "    assert m not in sys.modules, m + ' was imported'\n"
            "print(json.dumps(rcs))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code, json.dumps(cases), json.dumps(list(modules))],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)
