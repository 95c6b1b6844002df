"""The `servetwin` command end to end, as a user runs it."""

import json
import subprocess
import sys

import pytest

DATA = __import__("pathlib").Path(__file__).parent / "data"


def run(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "servetwin", *args], capture_output=True,
                       text=True, timeout=600)
    if check and p.returncode:
        raise AssertionError(p.stdout + p.stderr)
    return p


def test_simulate_trace_writes_records_summary_and_series(tmp_path):
    out = tmp_path / "o"
    p = run("simulate", "--trace", str(DATA / "azure_conv_300.csv"), "--trace-format", "azure",
            "--trace-limit", "60", "--model-path", "meta-llama/Llama-3.1-8B", "--tp-size", "1",
            "--gpu", "a100-sxm-80gb", "--out", str(out))
    assert "ttft" in p.stdout and "KV Cache is allocated" in p.stdout
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 60
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"]["ok"] == 60
    assert (out / "timeseries.csv").read_text().startswith("t_s,running")


def test_same_seed_same_bytes(tmp_path):
    spec = "arrival=poisson,rate=3,n=80,templates=2,share=0.5"
    for d in ("a", "b"):
        run("simulate", "--workload", spec, "--seed", "3", "--out", str(tmp_path / d),
            "--model-path", "Qwen/Qwen3-8B", "--tp-size", "1", "--gpu", "h100-sxm-80gb")
    assert (tmp_path / "a/requests.jsonl").read_bytes() == \
        (tmp_path / "b/requests.jsonl").read_bytes()


@pytest.mark.parametrize("args,msg", [
    (["--bogus"], "valid flags"),
    (["--schedule-policy", "sjf"], "choose from"),
    (["--gpu", "t4"], "choose from"),
    (["--model-path", "acme/unknown-9B"], "catalog"),
    (["--model-path", "deepseek-ai/DeepSeek-V3"], "does not fit"),
    (["--trace", "x.csv", "--trace-format", "azure"], "no such file"),
    (["--trace", "x.csv"], "needs --trace-format"),
    (["--workload", "finance"], "not a preset"),
])
def test_bad_input_is_one_clear_error(args, msg):
    p = run("simulate", *args, check=False)
    assert p.returncode == 2
    assert msg in p.stderr


def test_default_run_says_which_model_and_why_deepseek_does_not_fit():
    p = run("simulate", "--horizon", "60")
    assert "DeepSeek-R1-Distill-Qwen-32B" in p.stdout
    assert "DeepSeek-V3" in p.stdout and "does not fit" in p.stdout
    assert "SLO" in p.stdout


def test_simulate_finance_qa_open_loop_accounts_for_every_request(tmp_path):
    """The users' mix at a rate (a preset with arrival keys) through the whole command:
    every request comes out once with a status, the summary names the spec."""
    out = tmp_path / "o"
    spec = "finance-qa,arrival=poisson,rate=0.3,n=40"
    p = run("simulate", "--workload", spec, "--step-time-backend", "roofline", "--out", str(out))
    assert "requests 40:" in p.stdout
    rids = [json.loads(line)["rid"] for line in (out / "requests.jsonl").read_text().splitlines()]
    assert sorted(rids) == sorted(f"r{i}" for i in range(40))
    summary = json.loads((out / "summary.json").read_text())
    assert sum(summary["status"].values()) == 40
    bad = run("simulate", "--workload", "finance-qa,output=fixed:3", check=False)
    assert bad.returncode != 0 and "output cannot be set on the finance-qa preset" in bad.stderr


@pytest.mark.parametrize("command,preset,expect", [
    ("simulate", None, "1"), ("plan", None, "1"), ("simulate", "4", "4"),
    ("live", None, None), ("calibrate", None, None), ("rl", None, None)])
def test_one_openblas_thread_only_where_no_server_or_torch_runs(command, preset, expect):
    """simulate and the other twin-only commands run numpy's OpenBLAS on one thread (its
    per-core threads cost CPU at import); the commands that start servers or torch keep the
    environment their children inherit; a user's own setting always wins."""
    code = ("import os, sys\nfrom servetwin import cli\ntry:\n"
            f"    cli.main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
            "print('BLAS', os.environ.get('OPENBLAS_NUM_THREADS'))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if preset is not None:
        env["OPENBLAS_NUM_THREADS"] = preset
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=300)
    assert f"BLAS {expect}" in p.stdout.splitlines()[-1], p.stdout[-500:] + p.stderr[-2000:]


def test_python_cores_say_so_and_write_the_same_bytes(tmp_path):
    """With SERVETWIN_PURE_PYTHON=1 the Python code writes the records and runs the decode
    passes, says so once on stderr, and writes the compiled modules' bytes; without it a
    build that has them says nothing."""
    spec = ["simulate", "--workload", "arrival=poisson,rate=4,n=60", "--model-path",
            "meta-llama/Llama-3.1-8B", "--step-time-backend", "roofline"]
    env = {**__import__("os").environ, "SERVETWIN_PURE_PYTHON": "1"}
    slow = subprocess.run([sys.executable, "-m", "servetwin", *spec, "--out",
                           str(tmp_path / "py")], capture_output=True, text=True, env=env,
                          timeout=600, check=True)
    assert slow.stderr.count("servetwin: note: the Python code runs requests.jsonl's writer "
                             "(SERVETWIN_PURE_PYTHON is set) and the decode passes") == 1
    fast = run(*spec, "--out", str(tmp_path / "c"))
    from twin import record_table, replica
    if record_table._C is not None and replica._LOOP_C is not None:
        assert "note: the Python code" not in fast.stderr
    for f in ("requests.jsonl", "summary.json", "timeseries.csv"):
        assert (tmp_path / "py" / f).read_bytes() == (tmp_path / "c" / f).read_bytes(), f
