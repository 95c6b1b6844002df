"""twin/collector.py: the cyclic collector paused over a block, and off for the rest of a
console `servetwin simulate` process (and nothing it leaves collected on the way out),
while a caller of `main` with arguments (a test session) keeps its collector."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

from twin.collector import paused

ROOT = Path(__file__).resolve().parent.parent
TINY = ["simulate", "--step-time-backend", "roofline", "--workload",
        "arrival=poisson,rate=2,n=20,prompt=uniform:50:100,output=uniform:5:10"]


def test_paused_restores_what_the_caller_had():
    assert gc.isenabled()
    with paused():
        assert not gc.isenabled()
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block's choice is kept
    assert gc.isenabled()
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()  # a caller that turned it off keeps it off
    finally:
        gc.enable()


def _after(code: str, tmp_path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_console_simulate_ends_with_the_collector_off_and_nothing_to_walk(tmp_path):
    code = f"""
import gc, json, sys
from servetwin.cli import main
sys.argv = ["servetwin", *{TINY + ['--out', str(tmp_path / 'o')]!r}]
rc = main()
print(json.dumps({{"rc": rc, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                  "tracked": len(gc.get_objects())}}))
"""
    got = _after(code, tmp_path)
    assert got["rc"] == 0 and not got["enabled"]
    assert got["frozen"] > 1000 and got["tracked"] < 100  # what is alive is frozen
    assert (tmp_path / "o" / "requests.jsonl").read_text().count("\n") == 20


def test_main_with_arguments_keeps_the_callers_collector(tmp_path):
    code = f"""
import gc, json
from servetwin.cli import main
rc = main({TINY + ['--out', str(tmp_path / 'o')]!r})
print(json.dumps({{"rc": rc, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}}))
"""
    got = _after(code, tmp_path)
    assert got == {"rc": 0, "enabled": True, "frozen": 0}
