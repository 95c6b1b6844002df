"""Alert rules over a fleet: per replica and fleet-wide on hand-built records and series,
`servetwin simulate --deployment ... --alerts` and `alerts eval` over a fleet directory,
the per-instance Prometheus export checked and evaluated by the real promtool."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest
import yaml
from test_alerts import promtool
from test_monitoring import rec

from servetwin.cli import main
from twin.alerts import Rule, default_rules
from twin.errors import ConfigError
from twin.fleet_alerts import ReplicaView, evaluate_fleet, fleet_windows
from twin.prometheus_rules import prometheus_fleet_rules

pytestmark = pytest.mark.offline

P99 = Rule("p99", "ttft_p99", 1.5, windows=3, severity="yellow")


def tagged(replica: str, pattern: str, per_window: int = 1) -> list[dict]:
    """`per_window` requests per 60 s window on `replica`: TTFT 2 s ('x') or 0.5 s ('.')."""
    out = []
    for k, c in enumerate(pattern):
        for j in range(per_window):
            r = rec(f"{replica}{k}_{j}", k * 60 + 1 + j, 2.0 if c == "x" else 0.5, 3.0)
            out.append({**r, "replica": replica, "pool": "p"})
    return out


def view(name: str, cap: int = 100, budget: int | None = 10, gauges: dict | None = None):
    return ReplicaView(name, "p", "sglang", cap, budget, gauges or {})


def test_p99_per_replica_and_for_what_the_clients_see():
    # a: over in three windows; b: never over, with 99 requests a window, so the fleet's
    # P99 over 100 requests a window (one of them a's 2 s) stays under 1.5 s
    records = tagged("a", "xxx.") + tagged("b", "....", per_window=99)
    alerts = evaluate_fleet([P99], records, [view("a"), view("b")])
    assert [(a.replica, a.pool, a.since_s, a.start_s, a.end_s) for a in alerts] == [
        ("a", "p", 0.0, 180.0, 240.0)]
    # with b's load light, the clients see a's P99: the fleet fires too, listed first
    records = tagged("a", "xxx.") + tagged("b", "....")
    alerts = evaluate_fleet([P99], records, [view("a"), view("b")])
    assert [(a.replica, a.start_s, a.end_s) for a in alerts] == [("fleet", 180.0, 240.0),
                                                                 ("a", 180.0, 240.0)]
    assert alerts[0].to_json()["replica"] == "fleet" and alerts[0].to_json()["pool"] is None


def test_a_request_no_replica_took_counts_for_the_fleet_only():
    lost = [{**r, "replica": None, "pool": None} for r in tagged("x", "xxx")]
    alerts = evaluate_fleet([P99], lost, [view("a"), view("b")])
    assert [a.replica for a in alerts] == ["fleet"]


def test_fleet_gauges_weight_capacity_and_hold_an_idle_replica():
    # a (capacity 100) samples every window; b (capacity 300) only at t=0 and t=130
    a = {"memory_pressure_score": ([0.0, 61.0, 121.0], [0.9, 0.9, 0.9]),
         "num_running_reqs": ([0.0, 61.0, 121.0], [4.0, 4.0, 4.0])}
    b = {"memory_pressure_score": ([0.0, 130.0], [0.1, 0.5]),
         "num_running_reqs": ([0.0, 130.0], [2.0, 0.0])}
    w = fleet_windows([], [view("a", 100, gauges=a), view("b", 300, gauges=b)], 60.0, 130.0)
    assert [x.value for x in w["memory_pressure_score"]] == [0.3, 0.3, 0.6]
    assert [x.value for x in w["num_running_reqs"]] == [6.0, 6.0, 4.0]
    assert "kv_external_fragmentation" not in w or not w["kv_external_fragmentation"]


def test_a_crashed_replica_is_left_out_of_the_fleet_gauges():
    # b crashed from 50 s to 130 s: windows 1 ([60, 120)) has neither its sample nor it
    a = {"memory_pressure_score": ([0.0, 61.0, 121.0], [0.9, 0.9, 0.9]),
         "num_running_reqs": ([0.0, 61.0, 121.0], [4.0, 4.0, 4.0])}
    b = {"memory_pressure_score": ([0.0, 130.0], [0.1, 0.0]),
         "num_running_reqs": ([0.0, 130.0], [2.0, 0.0])}
    reps = [view("a", 100, gauges=a), replace(view("b", 300, gauges=b), down=((50.0, 130.0),))]
    w = fleet_windows([], reps, 60.0, 130.0)
    assert [x.value for x in w["memory_pressure_score"]] == [0.3, 0.9, 0.225]
    assert [x.value for x in w["num_running_reqs"]] == [6.0, 4.0, 4.0]


def test_defragment_is_per_replica_and_batch_efficiency_sums_the_budgets():
    frag = {"kv_external_fragmentation": ([0.0, 61.0], [0.5, 0.1])}
    rule = Rule("defrag", "kv_external_fragmentation", 0.25, action="defragment")
    alerts = evaluate_fleet([rule], [], [view("a", gauges=frag), view("b")])
    assert [(a.replica, a.start_s, a.end_s, a.action) for a in alerts] == [
        ("a", 60.0, 120.0, "defragment")]
    with pytest.raises(ConfigError, match="defrag read a sampled series no replica"):
        evaluate_fleet([rule], [], [view("a"), view("b")])
    # 6 requests busy through window 0 on a (budget 10): a at 0.6; the fleet's budget 20
    busy = [{**rec(f"r{i}", 0.0, 1.0, 60.0), "replica": "a", "pool": "p"} for i in range(6)]
    eff = Rule("eff", "batch_efficiency", 0.5)
    alerts = evaluate_fleet([eff], busy, [view("a"), view("b")], t_end=60.0)
    assert [(a.replica, a.peak) for a in alerts] == [("a", 0.6)]
    assert fleet_windows(busy, [view("a"), view("b")], 60.0, 60.0)[
        "batch_efficiency"][0].value == 0.3


TINY = """name: tiny-fleet
router: {name: round_robin}
replicas:
  - {name: sg, count: 2, engine: sglang,
     server_args: {model_path: Qwen/Qwen3-8B, tp_size: 1, max_total_tokens: 20000},
     twin: {kv_allocator: buddy, buddy_min_block_bytes: 16777216}}
"""
SPEC = ("arrival=poisson,rate=6,n=60,prompt=lognormal:3000:0.8,output=uniform:50:200,"
        "templates=2,template_len=1024,share=0.5")


def test_simulate_a_fleet_with_alerts_and_eval_its_directory(tmp_path, capsys):
    dep = tmp_path / "tiny.yaml"
    dep.write_text(TINY)
    flags = ["simulate", "--deployment", str(dep), "--workload", SPEC]
    out, plain = tmp_path / "alerts", tmp_path / "plain"
    assert main([*flags, "--alerts", "default", "--alert-window", "10", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "burn-rate windows x" in printed and "(auto: the longest window spans" in printed
    summary = json.loads((out / "summary.json").read_text())["alerts"]
    fired = summary["fired"]
    assert [json.loads(x) for x in (out / "alerts.jsonl").read_text().splitlines()] == fired
    assert {a["replica"] for a in fired} == {"fleet", "sg0", "sg1"}
    assert {a["replica"] for a in fired if a["rule"] == "kv_fragmentation_defragment"} <= {
        "sg0", "sg1"}  # per replica only
    assert summary["replicas"]["sg0"]["capacity_tokens"] == 20000
    assert summary["replicas"]["sg0"]["compactions"]["by_cause"].get("threshold", 0) > 0
    assert summary["burn_scale_from"] == "auto" and 0 < summary["burn_scale"] < 1
    # the defragment rule is the replicas' defrag_threshold: the same records as the file's
    with_thr = tmp_path / "thr.yaml"
    with_thr.write_text(TINY.replace("kv_allocator: buddy,", "kv_allocator: buddy, "
                                     "defrag_threshold: 0.25,"))
    assert main(["simulate", "--deployment", str(with_thr), "--workload", SPEC,
                 "--out", str(plain)]) == 0
    assert (plain / "requests.jsonl").read_bytes() == (out / "requests.jsonl").read_bytes()
    assert not (plain / "alerts.jsonl").exists()
    assert "alerts" not in json.loads((plain / "summary.json").read_text())
    capsys.readouterr()
    assert main(["alerts", "eval", str(out), "--window", "10", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["run"] == "fleet" and again["alerts"] == fired
    assert set(again["windows"]) == {"fleet", "sg0", "sg1"}
    # without an alerts section the capacities come from the deployment, which is asked for
    assert main(["alerts", "eval", str(plain), "--window", "10"]) == 2
    assert "give --deployment FILE" in capsys.readouterr().err
    assert main(["alerts", "eval", str(plain), "--window", "10", "--json",
                 "--deployment", str(with_thr)]) == 0
    third = json.loads(capsys.readouterr().out)
    assert third["alerts"] == fired and third["windows"] == again["windows"]
    assert main(["alerts", "eval", str(out), "--window", "10"]) == 0
    text = capsys.readouterr().out
    assert "fleet run, 60 records, replicas sg0, sg1" in text
    assert "\nfleet:\n" in text and "\nsg0:\n" in text and "\nsg1:\n" in text
    assert "  fleet: ttft_p99_three_windows [yellow]" in text
    one = tmp_path / "one"
    assert main(["simulate", "--workload", "arrival=poisson,rate=4,n=10", "--out",
                 str(one)]) == 0
    capsys.readouterr()
    assert main(["alerts", "eval", str(one), "--deployment", str(dep)]) == 2
    assert "a twin run of one server, not a fleet's" in capsys.readouterr().err


def test_fleet_runs_without_alerts_are_unchanged(tmp_path):
    out, plain = tmp_path / "a", tmp_path / "p"
    flags = ["simulate", "--deployment", "finance-sglang-pool", "--workload",
             "arrival=poisson,rate=8,n=60,prompt=lognormal:800:0.7,output=uniform:20:80"]
    assert main([*flags, "--alerts", "default", "--burn-scale", "0.01", "--out", str(out)]) == 0
    assert main([*flags, "--out", str(plain)]) == 0
    for f in ("requests.jsonl", "timeseries.csv"):
        assert (plain / f).read_bytes() == (out / f).read_bytes()
    s = json.loads((out / "summary.json").read_text())["alerts"]
    assert s["burn_scale"] == 0.01 and s["burn_scale_from"] == "given"
    assert s["burn_windows_s"]["ttft_slo_fast_burn"] == [36.0, 3.0]


def test_a_bad_fleet_series_names_file_and_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["simulate", "--deployment", "finance-sglang-pool", "--workload",
                 "arrival=poisson,rate=4,n=10", "--out", str(out)]) == 0
    csv = out / "timeseries.csv"
    lines = csv.read_text().splitlines()
    lines[2] = "nosuch" + lines[2][lines[2].index(","):]
    csv.write_text("\n".join(lines) + "\n")
    assert main(["alerts", "eval", str(out)]) == 2
    assert f"{csv}:3: replica 'nosuch' is not in the deployment" in capsys.readouterr().err
    cells = lines[1].split(",")
    cells[2] = "many"
    lines[2] = ",".join(cells)
    csv.write_text("\n".join(lines) + "\n")
    assert main(["alerts", "eval", str(out)]) == 2
    assert f"{csv}:3: running 'many': not a number" in capsys.readouterr().err


def test_per_instance_rules_from_the_command_line(capsys):
    assert main(["alerts", "rules", "--per-instance", "--max-running", "48"]) == 0
    rules = yaml.safe_load(capsys.readouterr().out)["groups"][0]["rules"]
    scopes = [(r["alert"], r["labels"]["scope"]) for r in rules]
    assert ("kv_fragmentation_defragment", "replica") in scopes
    assert ("kv_fragmentation_defragment", "fleet") not in scopes  # per replica only
    assert ("ttft_p99_three_windows", "fleet") in scopes
    p99 = {r["labels"]["scope"]: r["expr"] for r in rules
           if r["alert"] == "ttft_p99_three_windows"}
    assert "sum by (le, instance) (rate(sglang:time_to_first_token_seconds_bucket[1m]))" \
        in p99["replica"]
    assert "sum by (le) (rate(" in p99["fleet"]


def test_per_instance_rules_pass_promtool_and_fire_per_instance(tmp_path):
    tool = promtool()
    rules = tmp_path / "rules.yml"
    every = [Rule(f"m_{i}", m, 0.5, windows=2) for i, m in enumerate(
        ("ttft_p50", "e2e_p99", "itl_p99", "tpot_p99", "queue_p99", "radix_sharing_ratio",
         "batch_efficiency", "memory_pressure_score", "kv_eviction_rate",
         "kv_external_fragmentation", "num_running_reqs", "num_queue_reqs"))]
    for max_running in (None, 48):
        rules.write_text(prometheus_fleet_rules(every + default_rules(), 60, max_running))
        res = subprocess.run([tool, "check", "rules", str(rules)], capture_output=True,
                             text=True)
        assert res.returncode == 0, res.stdout + res.stderr
    # evaluated by promtool: instance a answers in over 2 s, b under 1 s, as many each
    pressure = Rule("pressure", "memory_pressure_score", 0.8, severity="warning")
    fleet_pressure = Rule("fleet_pressure", "memory_pressure_score", 0.4, severity="warning")
    rules.write_text(prometheus_fleet_rules([default_rules()[0], pressure, fleet_pressure]))
    doc = yaml.safe_load(rules.read_text())["groups"][0]["rules"]
    assert [(r["alert"], r["labels"]["scope"]) for r in doc] == [
        ("ttft_p99_three_windows", "replica"), ("ttft_p99_three_windows", "fleet"),
        ("pressure", "replica"), ("pressure", "fleet"), ("fleet_pressure", "replica"),
        ("fleet_pressure", "fleet")]
    ttft = "sglang:time_to_first_token_seconds_bucket"
    series = [{"series": f'{ttft}{{instance="a",le="{le}"}}', "values": v}
              for le, v in (("1.0", "0x10"), ("2.0", "0x10"), ("+Inf", "0+60x10"))]
    series += [{"series": f'{ttft}{{instance="b",le="{le}"}}', "values": "0+60x10"}
               for le in ("1.0", "2.0", "+Inf")]
    for inst, avail in (("a", 10), ("b", 90)):  # pressure 0.9 and 0.1; the fleet's 0.5
        series += [{"series": f'sglang:kv_available_tokens{{instance="{inst}",tp_rank="0"}}',
                    "values": f"{avail}x10"},
                   {"series": f'sglang:max_total_num_tokens{{instance="{inst}",tp_rank="0"}}',
                    "values": "100x10"}]
    desc = default_rules()[0].description

    def fired(name, scope, inst=None, severity="yellow", summary=None):
        labels = {"severity": severity, "scope": scope, **({"instance": inst} if inst else {})}
        what = f"on {inst}" if inst else "over the fleet"
        return {"exp_labels": labels, "exp_annotations": {"summary": f"{summary or name} "
                                                                    f"({what})"}}

    tests = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series, "alert_rule_test": [
            {"eval_time": "5m", "alertname": "ttft_p99_three_windows", "exp_alerts": [
                fired("ttft_p99_three_windows", "replica", "a", summary=desc),
                fired("ttft_p99_three_windows", "fleet", summary=desc)]},
            {"eval_time": "2m", "alertname": "ttft_p99_three_windows", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "pressure", "exp_alerts": [
                fired("pressure", "replica", "a", "warning")]},
            {"eval_time": "5m", "alertname": "fleet_pressure", "exp_alerts": [
                fired("fleet_pressure", "replica", "a", "warning"),
                fired("fleet_pressure", "fleet", severity="warning")]}]}]}
    spec = tmp_path / "test.yml"
    spec.write_text(yaml.safe_dump(tests, sort_keys=False))
    res = subprocess.run([tool, "test", "rules", str(spec)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    # and the test can fail: b is not over
    spec.write_text(spec.read_text().replace("instance: a", "instance: b", 1))
    assert subprocess.run([tool, "test", "rules", str(spec)],
                          capture_output=True).returncode != 0


def test_the_fleet_registry_labels_each_replica():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from twin.monitoring import ReplicaMetrics, fleet_registry, sglang_registry

    a, b = tagged("a", "xx."), tagged("b", "..", per_window=3)
    reg = fleet_registry([ReplicaMetrics("a", a, {"sglang:num_running_reqs": 2.0}, 100, 10),
                          ReplicaMetrics("b", b, {"sglang:num_running_reqs": 5.0}, 300, 10)])
    text = generate_latest(reg).decode()
    assert text.count("# TYPE sglang:num_requests_total counter") == 1  # one family a name
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    reqs = {s.labels["replica"]: s.value for s in fams["sglang:num_requests"].samples
            if s.name.endswith("_total")}
    assert reqs == {"a": 3.0, "b": 6.0}
    running = {s.labels["replica"]: s.value for s in fams["sglang:num_running_reqs"].samples}
    assert running == {"a": 2.0, "b": 5.0}
    # each replica's samples are its own server's registry, with the label added
    alone = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in
             text_string_to_metric_families(generate_latest(sglang_registry(
                 a, capacity_tokens=100, max_running=10)).decode()) for s in f.samples}
    mine = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica"))):
            s.value for f in fams.values() for s in f.samples if s.labels.get("replica") == "a"
            and s.name != "sglang:num_running_reqs"}
    assert mine == alone


def test_a_live_replay_through_a_fleet_is_evaluated_per_replica(tmp_path, capsys):
    # the records of `servetwin live replay --url ROUTER` name each request's replica
    # (`--weight-version replica-N`); the router's /metrics is no server's: no gauges
    from twin.metrics import write_records

    records = [{k: v for k, v in r.items() if k != "pool"}
               for r in tagged("replica-0", "xxx.") + tagged("replica-1", "....")]
    records.sort(key=lambda r: r["arrival_s"])
    write_records(tmp_path / "requests.jsonl", records)
    (tmp_path / "server_info_after.json").write_text(
        json.dumps({"internal_states": [{"max_running_requests": 16}]}))
    assert main(["alerts", "eval", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"] == "live" and out["replicas"] == ["replica-0", "replica-1"]
    assert out["skipped"] == ["kv_fragmentation_defragment"]
    p99 = [(a["replica"], a["pool"], a["start_s"], a["end_s"]) for a in out["alerts"]
           if a["rule"] == "ttft_p99_three_windows"]
    assert p99 == [("fleet", None, 180.0, 240.0), ("replica-0", "live", 180.0, 240.0)]
    assert main(["alerts", "eval", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "live replay through a fleet" in text
    assert "not evaluated: kv_fragmentation_defragment" in text
    (tmp_path / "server_info_after.json").write_text('{"unavailable": "through a router"}')
    assert main(["alerts", "eval", str(tmp_path), "--json", "--max-running", "8"]) == 0
    eff = json.loads(capsys.readouterr().out)["windows"]["replica-0"]["batch_efficiency"]
    assert eff[0] == pytest.approx(3.0 / 60 / 8, abs=1e-6)  # one request in the batch 3 s


def test_twin_flags_with_a_deployment_are_refused_not_dropped(capsys):
    # the fleet's replicas take their twin settings from the deployment's `twin:` sections
    for flags, named in ((["--defrag-threshold", "0.3"], "--defrag-threshold"),
                         (["--kv-allocator", "buddy"], "--kv-allocator"),
                         (["--no-ignore-eos"], "--no-ignore-eos")):
        assert main(["simulate", "--deployment", "finance-hybrid", *flags]) == 2
        assert f"twin settings come from the deployment; drop {named}" in \
            capsys.readouterr().err
