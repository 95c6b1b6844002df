"""Alert rules: firing exactly on hand-built series, rules files, the Prometheus export
checked by the real promtool, and the rules in `servetwin simulate` and `alerts eval`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml
from test_monitoring import rec

from servetwin.cli import main
from twin.alerts import (
    Rule,
    default_rules,
    evaluate,
    load_rules,
    threshold_alerts,
)
from twin.errors import ConfigError
from twin.monitoring import Window
from twin.prometheus_rules import prometheus_rules

pytestmark = pytest.mark.offline

P99 = Rule("p99", "ttft_p99", 1.5, windows=3, severity="yellow")


def ttft_records(pattern: str, window_s: float = 60.0) -> list[dict]:
    """One request per window whose TTFT is over 1.5 s ('x'), under ('.'), or none ('_')."""
    out = []
    for k, c in enumerate(pattern):
        if c != "_":
            out.append(rec(f"r{k}", k * window_s + 1, 2.0 if c == "x" else 0.5, 3.0))
    return out


def test_three_windows_over_fire_at_the_third_and_recovery_ends_it():
    alerts = evaluate([P99], ttft_records("xxx.."))
    assert len(alerts) == 1
    a = alerts[0]
    assert (a.since_s, a.start_s, a.end_s) == (0.0, 180.0, 240.0)
    assert a.peak == 2.0 and a.severity == "yellow"


def test_two_windows_over_do_not_fire():
    assert evaluate([P99], ttft_records("xx.xx.x")) == []


def test_still_firing_at_the_end_has_no_end():
    (a,) = evaluate([P99], ttft_records(".xxxx"))
    assert (a.since_s, a.start_s, a.end_s) == (60.0, 240.0, None)


def test_an_empty_window_breaks_the_run_as_in_promql():
    assert evaluate([P99], ttft_records("xx_x")) == []  # no samples: no value, not over


def test_threshold_alerts_on_a_hand_built_series():
    vals = [0.3, 0.2, 0.3, 0.4, 0.1, 0.26]
    ws = [Window(10.0 * k, 10.0 * (k + 1), v, 1) for k, v in enumerate(vals)]
    rule = Rule("frag", "kv_external_fragmentation", 0.25, windows=2, action="defragment")
    got = [(a.since_s, a.start_s, a.end_s, a.peak) for a in threshold_alerts(rule, ws)]
    assert got == [(20.0, 40.0, 50.0, 0.4)]
    assert threshold_alerts(rule, ws)[0].action == "defragment"


def test_burn_rate_needs_both_windows_over():
    rule = Rule("burn", "ttft", 1.5, kind="burn_rate", objective=0.9, long_window_s=100,
                short_window_s=20, factor=2.0)
    # one request every 10 s; TTFTs over 1.5 s from 100 s to 150 s
    recs = [rec(f"r{i}", 10.0 * i, 2.0 if 100 <= 10 * i <= 150 else 0.1, 2.5)
            for i in range(30)]
    (a,) = evaluate([rule], recs, window_s=10.0)
    # TTFTs are observed at arrival + TTFT. At 120 s the long window (20, 120] has 2 over
    # of 10 (burn 2.0: not over 2x); at 130 s 3 of 10 (burn 3) and the short one (110, 130]
    # 2 of 2: fires. At 170 s the short window (150, 170] still has 1 of 2 (burn 5); at
    # 180 s (160, 180] has none: resolved. The peak is the long window's 6 of 10.
    assert (a.since_s, a.start_s, a.end_s) == (130.0, 130.0, 180.0)
    assert a.peak == pytest.approx(6.0)


def test_evaluate_is_deterministic_and_refuses_missing_series():
    recs = ttft_records("xxx.xxxx.")
    assert evaluate(default_rules()[:1], recs) == evaluate(default_rules()[:1], recs)
    with pytest.raises(ConfigError, match="kv_fragmentation_defragment"):
        evaluate(default_rules(), recs)  # the fragmentation rule reads the series


def test_rules_file_errors_name_file_line_and_key(tmp_path):
    p = tmp_path / "rules.yml"
    p.write_text("rules:\n  - name: a\n    metric: ttft_p99\n    threshold: 1.5\n"
                 "  - name: b\n    metric: ttft_p99\n    threshold: 1\n    window: 3\n")
    with pytest.raises(ConfigError, match=r"rules.yml:5: rule 2: unknown key 'window'"):
        load_rules(p)
    p.write_text("rules:\n  - {name: a, metric: p99, threshold: 1.5}\n")
    with pytest.raises(ConfigError, match=r"rules.yml:2: rule 1: .*metric 'p99': allowed"):
        load_rules(p)
    p.write_text("rules:\n  - {name: a, metric: ttft_p99, threshold: 1}\n"
                 "  - {name: a, metric: ttft_p99, threshold: 2}\n")
    with pytest.raises(ConfigError, match="rules.yml:3: rule 2: duplicate rule name 'a'"):
        load_rules(p)
    p.write_text(json.dumps({"rules": [{"name": "a", "metric": "ttft", "threshold": 1,
                                        "kind": "burn_rate"}]}))
    with pytest.raises(ConfigError, match="objective None"):
        load_rules(p)


def promtool() -> str | None:
    path = shutil.which("promtool")
    if path is None and not os.environ.get("SERVETWIN_CI"):
        pytest.skip("promtool is not installed (Debian's prometheus package)")
    assert path, "promtool missing in CI (.ci/run installs it)"
    return path


def test_exported_rules_pass_promtool(tmp_path, capsys):
    tool = promtool()
    assert main(["alerts", "rules", "--burn-scale", "0.0833"]) == 0
    out = tmp_path / "rules.yml"
    out.write_text(capsys.readouterr().out)
    first = yaml.safe_load(out.read_text())["groups"][0]["rules"][0]
    assert first["expr"] == ("histogram_quantile(0.99, sum by (le) (rate("
                             "sglang:time_to_first_token_seconds_bucket[1m]))) > 1.5")
    assert first["for"] == "2m"  # three 1-minute windows in a row
    res = subprocess.run([tool, "check", "rules", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 rules found" in res.stdout
    every = [Rule(f"m_{i}", m, 0.5, windows=2) for i, m in enumerate(
        ("ttft_p50", "e2e_p99", "itl_p99", "tpot_p99", "queue_p99", "radix_sharing_ratio",
         "batch_efficiency", "memory_pressure_score", "kv_eviction_rate",
         "kv_external_fragmentation", "num_running_reqs", "num_queue_reqs"))]
    out.write_text(prometheus_rules(every, window_s=30, max_running=48))
    res = subprocess.run([tool, "check", "rules", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text(out.read_text().replace("histogram_quantile(", "histogram_quantile(("))
    assert subprocess.run([tool, "check", "rules", str(bad)],
                          capture_output=True).returncode != 0  # the check can fail


SPEC = ("arrival=poisson,rate=4,n=60,prompt=lognormal:3000:0.8,output=uniform:50:200,"
        "templates=2,template_len=1024,share=0.5")


def test_simulate_alerts_and_eval_agree(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["simulate", "--workload", SPEC, "--alerts", "default", "--alert-window",
                 "10", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    fired = summary["alerts"]["fired"]
    assert "ttft_p99_three_windows" in {a["rule"] for a in fired}  # this load is too much
    lines = [json.loads(x) for x in (out / "alerts.jsonl").read_text().splitlines()]
    assert lines == fired
    capsys.readouterr()
    assert main(["alerts", "eval", str(out), "--window", "10", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["alerts"] == fired and again["run"] == "twin"
    plain = tmp_path / "plain"
    assert main(["simulate", "--workload", SPEC, "--out", str(plain)]) == 0
    assert not (plain / "alerts.jsonl").exists()
    assert "alerts" not in json.loads((plain / "summary.json").read_text())
    for f in ("requests.jsonl", "timeseries.csv"):  # rules observe; they change nothing
        assert (plain / f).read_bytes() == (out / f).read_bytes()


def test_the_defragment_rule_is_the_defrag_threshold(tmp_path):
    rules = tmp_path / "defrag.yml"
    rules.write_text("rules:\n  - name: defrag\n    metric: kv_external_fragmentation\n"
                     "    threshold: 0.25\n    action: defragment\n")
    flags = ["simulate", "--workload", SPEC, "--kv-allocator", "buddy"]
    by_rule, by_flag = tmp_path / "rule", tmp_path / "flag"
    assert main([*flags, "--alerts", str(rules), "--out", str(by_rule)]) == 0
    assert main([*flags, "--defrag-threshold", "0.25", "--out", str(by_flag)]) == 0
    assert (by_rule / "requests.jsonl").read_bytes() == (by_flag / "requests.jsonl").read_bytes()
    comp = json.loads((by_rule / "summary.json").read_text())["alerts"]["compactions"]
    assert comp["by_cause"].get("threshold", 0) > 0
    assert comp["count"] == len(comp["times_s"])


def test_bad_command_lines_name_the_flag(tmp_path, capsys):
    assert main(["alerts", "rules", "--rules", str(tmp_path / "none.yml")]) == 2
    assert "--rules " in capsys.readouterr().err
    assert main(["alerts", "rules", "--window", "0"]) == 2
    assert "--window 0.0: must be" in capsys.readouterr().err
    assert main(["alerts", "eval", str(tmp_path)]) == 2
    assert "no requests.jsonl" in capsys.readouterr().err
    (tmp_path / "bad.yml").write_text("rules: [")
    assert main(["simulate", "--alerts", str(tmp_path / "bad.yml")]) == 2
    err = capsys.readouterr().err
    assert "--alerts " in err and "not YAML or JSON" in err


def test_burn_scale_auto_spans_the_run_and_is_stored(tmp_path, capsys):
    from twin.alerts import auto_burn_scale, scale_burn

    rules = default_rules()
    assert auto_burn_scale(rules, 1200.0) == 0.05556  # 1200 / 21600, 4 digits
    assert auto_burn_scale(rules, 10 * 3600.0) == 1.0  # never stretched past SRE's
    assert auto_burn_scale(rules[:2], 1200.0) == 1.0  # no burn-rate rule: nothing to scale
    fast = scale_burn(rules, 0.05556)[2]
    assert (fast.long_window_s, fast.short_window_s) == (3600 * 0.05556, 300 * 0.05556)
    assert scale_burn(rules, 0.5)[0] == rules[0]  # threshold rules untouched
    out = tmp_path / "run"
    assert main(["simulate", "--workload", SPEC, "--alerts", "default", "--alert-window",
                 "10", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    s = json.loads((out / "summary.json").read_text())["alerts"]
    assert s["burn_scale_from"] == "auto"
    assert s["burn_scale"] == auto_burn_scale(rules, s["run_s"]) < 1
    assert s["burn_windows_s"]["ttft_slo_slow_burn"][0] == pytest.approx(s["run_s"], rel=1e-3)
    assert f"burn-rate windows x{s['burn_scale']:g} (auto" in printed
    assert main(["alerts", "eval", str(out), "--window", "10", "--burn-scale", "1",
                 "--json"]) == 0
    unscaled = json.loads(capsys.readouterr().out)
    assert unscaled["burn_scale_from"] == "given"
    assert unscaled["burn_windows_s"]["ttft_slo_fast_burn"] == [3600.0, 300.0]
    assert main(["simulate", "--alerts", "default", "--burn-scale", "fast"]) == 2
    assert "--burn-scale 'fast': allowed values: a positive number or 'auto'" in \
        capsys.readouterr().err
    assert main(["alerts", "rules", "--burn-scale", "auto"]) == 2
    assert "--burn-scale 'auto': allowed values: a positive number" in capsys.readouterr().err
