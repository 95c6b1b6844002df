"""Issue 12's examples: bad input gets one clear error (exit code 2), never a traceback, a
hang or numbers from nonsense. The CLI runs in-process (`servetwin.cli.main`)."""

from __future__ import annotations

import pytest

from servetwin.cli import main
from twin.errors import ConfigError
from twin.workload import from_spec, get_workload

BASE = ["--model-path", "meta-llama/Llama-3.1-8B", "--tp-size", "1", "--gpu", "a100-sxm-80gb"]
SMALL = "n=5,prompt=fixed:100,output=fixed:10"


def cli_error(capsys, *args: str) -> str:
    """Run `servetwin ARGS`; assert exit code 2 and one error line; return that line."""
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "error:" in err, err
    return err


def simulate_error(capsys, *args: str) -> str:
    return cli_error(capsys, "simulate", *BASE, *args)


# ---- workload specs ----------------------------------------------------------------------
@pytest.mark.parametrize("spec,msg", [
    # used to hang: 0.5 passed the > 0 check, then became 0 clients
    ("arrival=closed,concurrency=0.5,n=5,prompt=fixed:100,output=fixed:10",
     "concurrency=0.5: must be an integer >= 1"),
    ("rate=nan,n=5", "rate=nan: must be a finite number > 0"),
    ("rate=inf,n=5", "rate=inf"),
    ("arrival=ramp,steps=", "steps='': fraction ''"),
    ("arrival=ramp,steps=0:0", "expects 0 requests"),
    ("arrival=ramp,steps=1:-1", "fraction '-1'"),
    ("n=0.5", "n=0.5: must be an integer"),
    ("n=2.5", "n=2.5: must be an integer"),
    ("n=0", "n=0: must be an integer in [1, "),
    ("share=2", "share=2: must be a finite number in [0, 1]"),
    ("templates=-3", "templates=-3: must be an integer"),
    ("templates=1.5", "templates=1.5"),
    ("system_prompt=-50", "system_prompt=-50: must be an integer"),
    ("template_len=0,templates=2", "template_len=0"),
    ("prompt=fixed:2.5", "'2.5': must be an integer"),
    ("prompt=fixed:nan", "'nan'"),
    ("prompt=uniform:1:1e12", "'1e12'"),
    ("prompt=lognormal:800:-1", "'-1'"),
    ("prompt=lognormal:800:50", "'50'"),
    ("output=empirical:5:0", "'0'"),
    ("tiers=0:nan", "weight 'nan'"),
    ("tiers=0:0/1:0", "must not all be 0"),
    ("tiers=0.5:1", "priority '0.5'"),
    ("tiers=0:1:2", "PRIORITY:WEIGHT"),
    ("arrival=gamma,cv=0", "cv=0"),
    ("rate=1e-300,n=5", "would span"),
    ("n=5,n=6", "given twice"),
    ("arrival=closed,rate=2", "rate has no effect with arrival=closed"),
    ("arrival=poisson,concurrency=4", "concurrency has no effect"),
    ("arrival=ramp,n=4", "n has no effect"),
])
def test_bad_workload_keys_are_refused_naming_key_and_value(spec, msg):
    with pytest.raises(ConfigError) as exc:
        get_workload(spec, 0)
    assert msg in str(exc.value)


@pytest.mark.parametrize("seed", [-1, 2**40, 1.5])
def test_bad_seed_is_refused(seed):
    with pytest.raises(ConfigError, match=r"--seed .*: must be an integer in \[0, 4294967295\]"):
        from_spec(SMALL, seed)
    with pytest.raises(ConfigError, match="--seed"):
        get_workload("finance-qa", seed)


def test_seed_minus_one_on_the_command_line(capsys):
    assert "--seed -1: must be an integer" in simulate_error(capsys, "--seed", "-1",
                                                             "--workload", SMALL)


def test_ramp_with_an_idle_step_still_runs():
    w = from_spec("arrival=ramp,rate=10,steps=1:0:1,step_s=10", 1)
    t = [r.arrival_s for r in w.requests]
    assert t and not any(10 <= x < 20 for x in t) and any(x >= 20 for x in t)
