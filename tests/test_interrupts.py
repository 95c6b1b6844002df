"""Ctrl-C and faults in the long-running commands, as a user meets them: a real
subprocess, SIGINT once its progress line shows it is under way (no fixed sleeps), then
the files it leaves are checked: complete, parseable, every request accounted for, and
exit code 130. `live replay`'s own: tests/test_replay_faults.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_sglang import FakeSglang
from test_replay_faults import wait_for_line

from calibration.profile import Store
from servetwin.cli import main
from twin.metrics import read_records

pytestmark = pytest.mark.offline


def servetwin(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`servetwin ARGS` in a subprocess that reacts to SIGINT even when this one was
    started with SIGINT ignored (a background job); `env` adds to the environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "servetwin", *args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def interrupt(proc: subprocess.Popen, progress: str) -> tuple[str, str]:
    """SIGINT once `progress` shows on stderr; (stdout, the rest of stderr)."""
    wait_for_line(proc, progress)
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=120)


def _runs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_calibrate_ctrl_c_keeps_the_finished_runs_and_resumes(tmp_path):
    out = tmp_path / "profile.json"
    with FakeSglang(token_delay=0.03) as fake:
        args = ("calibrate", "--url", fake.url, "--out", str(out), "--budget-s", "600")
        proc = servetwin(*args)
        _, err = interrupt(proc, " runs ")
        assert proc.returncode == 130, err
        assert "interrupted (Ctrl-C)" in err and "profile.runs.jsonl" in err
        assert not out.exists()  # no profile from a half-done plan
        runs = _runs(out.with_suffix(".runs.jsonl"))  # every line whole
        assert runs and len({r["tag"] for r in runs}) == len(runs)
        again = servetwin(*args)
        line = wait_for_line(again, "resuming after", stream="stdout")
        again.send_signal(signal.SIGINT)
        again.communicate(timeout=120)
    assert again.returncode == 130
    assert f"resuming after {len(runs)} runs" in line


def test_calibrate_drops_a_run_cut_off_mid_write(tmp_path):
    store = Store(tmp_path / "p.json", {"engine": "sglang"})
    good = json.dumps({"tag": "a", "kind": "prefill", "server": store.identity,
                       "traces": []})
    store.runs_path.write_text(good + "\n" + good[:30])  # the second run torn
    store.load()
    assert list(store.done) == ["a"]
    assert store.runs_path.read_text() == good + "\n"


def test_calibrate_stops_when_the_server_dies(tmp_path, capsys):
    out = tmp_path / "profile.json"
    with FakeSglang(token_delay=0.01, die_after=6) as fake:
        code = main(["calibrate", "--url", fake.url, "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "stopped answering mid-profile" in err and "run the same command again" in err
    assert all(r["traces"] for r in _runs(out.with_suffix(".runs.jsonl")))


@pytest.mark.parametrize("loop", ["python", "typed"])
def test_simulate_ctrl_c_writes_every_request(tmp_path, loop):
    # the typed core (twin/_corec.pyx) takes the signal between passes; it is faster, so
    # its run is longer: the first progress line comes 2 s (wall) after the start, when
    # the core has done about 160,000 of these (3.4 s in all for 200,000 here on
    # 2026-12-07, so that the signal could land after the run)
    out = tmp_path / "sim"
    n = 20_000 if loop == "python" else 500_000  # stopped long before the end
    env = {"SERVETWIN_PYTHON_LOOP": "1"} if loop == "python" else None
    proc = servetwin("simulate", "--workload", f"arrival=poisson,rate=20,n={n},"
                     "prompt=uniform:100:2000,output=uniform:50:500", "--out", str(out),
                     env=env)
    wait_for_line(proc, " requests, ")  # the first progress line may show 0 done (load):
    _busy_for(proc, 0.5)  # half a CPU-second more of simulation finishes some
    proc.send_signal(signal.SIGINT)
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert ("scheduler loop: the typed core" in stdout) == (loop == "typed"), stdout
    assert "interrupted (Ctrl-C) at simulated time" in err and "marked partial" in err
    recs = read_records(out / "requests.jsonl")
    assert len(recs) == len({r["rid"] for r in recs}) == n
    statuses = {r["status"] for r in recs}
    assert "ok" in statuses and "aborted" in statuses
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == n
    assert summary["partial"]["unfinished"] == sum(r["status"] == "aborted" for r in recs)
    assert (out / "timeseries.csv").read_text().startswith("t_s,")


def test_simulate_closed_loop_ctrl_c_stops_at_once(tmp_path):
    # Ctrl-C is taken between events (twin/interrupt.py), and the Python replica stops
    # moving the clock on without yielding (Replica.wait_in_events): the run stops long
    # before its end (about 30 CPU-s away here). test_simulate_ctrl_c_writes_every_request
    # is the one that fails without the latter: its arrivals are over when the signal
    # comes. (The typed core takes it between passes, and that test stops it: it runs
    # this workload too fast for a half-second's wait to land early.)
    out = tmp_path / "sim"
    n = 100_000
    proc = servetwin("simulate", "--workload", f"finance-qa,n={n}", "--out", str(out),
                     env={"SERVETWIN_PYTHON_LOOP": "1"})
    wait_for_line(proc, " requests, ")
    _busy_for(proc, 0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    recs = read_records(out / "requests.jsonl")
    assert len(recs) == len({r["rid"] for r in recs}) == n
    aborted = sum(r["status"] == "aborted" for r in recs)
    assert aborted > n // 2, aborted  # stopped early, not at the end


def test_sigint_is_taken_between_events_not_inside_one():
    # what lost one request of 40,000 in a fleet: a KeyboardInterrupt raised in the middle
    # of an event's bookkeeping; taken between events, the event in which it came ends
    import simpy

    from twin.interrupt import run_interruptible

    # Python's own handler, as in a foreground run (a suite started as a background job
    # inherits SIGINT ignored, and run_interruptible rightly leaves that alone)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    env = simpy.Environment()
    done = []

    def proc():
        for i in range(10):
            yield env.timeout(1)
            if i == 3:
                signal.raise_signal(signal.SIGINT)
            done.append(i)  # after the signal, in the same event

    env.process(proc())
    assert run_interruptible(env) is True
    assert done == [0, 1, 2, 3] and env.now == 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    env2 = simpy.Environment()

    def one():
        yield env2.timeout(1)

    env2.process(one())
    assert run_interruptible(env2) is False and env2.now == 1  # ran to its end


def test_fleet_simulate_ctrl_c_writes_every_request(tmp_path):
    out = tmp_path / "fleet"
    n = 40_000
    proc = servetwin("simulate", "--deployment", "finance-sglang-pool", "--workload",
                     f"arrival=poisson,rate=60,n={n},prompt=uniform:100:2000,"
                     "output=uniform:50:500", "--out", str(out))
    wait_for_line(proc, "simulating ")  # the fleet is built, the simulation starts
    _busy_for(proc, 0.5)  # the fleet has no progress line: half a CPU-second into the run
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    recs = read_records(out / "requests.jsonl")
    assert len(recs) == len({r["rid"] for r in recs}) == n
    aborted = [r for r in recs if r["status"] == "aborted"]
    assert aborted and all("interrupted (Ctrl-C)" in r["error"] for r in aborted)
    assert json.loads((out / "summary.json").read_text())["partial"]["unfinished"] == len(
        aborted)


def _busy_for(proc: subprocess.Popen, cpu_s: float, timeout: float = 120.0) -> None:
    """Until the process has used `cpu_s` more seconds of CPU (Linux /proc)."""
    def used() -> float:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    start, deadline = used(), time.monotonic() + timeout
    while used() - start < cpu_s:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)


def test_rl_train_ctrl_c_keeps_a_checkpoint_and_resumes(tmp_path):
    pytest.importorskip("stable_baselines3")
    out = tmp_path / "rl"
    args = ("rl", "train", "--env", "tiny", "--timesteps", "1000000", "--eval-every",
            "1000000", "--out", str(out))
    proc = servetwin(*args)
    wait_for_line(proc, " episodes, recent return", stream="stdout")  # a rollout done
    proc.send_signal(signal.SIGINT)
    outs, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted (Ctrl-C) at" in outs and "run the same command again" in outs
    state = json.loads((out / "checkpoint.json").read_text())
    steps = state["num_timesteps"]
    assert 0 < steps < 1_000_000 and state["partial"]["timesteps"] == steps
    again = servetwin(*args)
    line = wait_for_line(again, "resumed from", stream="stdout")
    again.send_signal(signal.SIGINT)
    again.communicate(timeout=120)
    assert f"at {steps} steps" in line and again.returncode == 130


def test_plan_ctrl_c_keeps_the_finished_candidates_and_resumes(tmp_path):
    out = tmp_path / "plan"
    args = ("plan", "--workload", "arrival=poisson,rate=10,n=200,prompt=uniform:1000:3000,"
            "output=uniform:20:60", "--gpus", "a100-sxm-80gb", "--tp", "1", "--replicas", "1",
            "--policies", "fcfs,lpm,lof,hrrn,dfs-weight,random", "--models",
            "meta-llama/Llama-3.1-8B", "--slo", "ttft:p99:0.5", "--out", str(out),
            "--jobs", "1", "--no-ramp", "--no-report")
    proc = servetwin(*args)
    _, err = interrupt(proc, "1/6 candidates")  # the first progress line: one is done
    assert proc.returncode == 130, err
    kept = sorted(p.name for p in (out / "candidates").glob("*.json"))
    assert kept and f"{len(kept)} of 6 candidates finished" in err and "resumes" in err
    assert not (out / "plan.json").exists()  # no plan from half a search
    for p in kept:  # every kept file whole
        assert json.loads((out / "candidates" / p).read_text())["status"] == "ok"
    again = servetwin(*args)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    assert f"({len(kept)} resumed)" in err
    assert len(json.loads((out / "plan.json").read_text())["candidates"]) == 6
