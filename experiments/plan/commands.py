"""The exact commands of a candidate: `servetwin simulate` (the planner's run at the target
load, replayed from the workload file the plan writes) and `python -m sglang.launch_server`
(runtime/launch.py builds it from the same ServerArgs), with sglang-router in front of
several replicas."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from experiments.plan.evaluate import fleet_doc, sim_config
from experiments.plan.question import Question
from experiments.plan.space import Candidate
from twin.config import ServerArgs

WORKLOAD_FILE = "workload.jsonl"  # the question's workload at the target load
ROUTER_PORT, FIRST_PORT = 8000, 30000


def write_workload(q: Question, out: Path) -> Path:
    from twin.outputs import atomic_writer

    path = out / WORKLOAD_FILE
    with atomic_writer(path) as fh:
        for r in q.at(q.target_scale).requests:
            fh.write(json.dumps({"rid": r.rid, "arrival_s": r.arrival_s,
                                 "output_tokens": r.output_tokens, "priority": r.priority,
                                 "segments": [list(s) for s in r.segments]}) + "\n")
    return path


def deployment_path(out: Path, cand: Candidate) -> Path:
    return out / "deployments" / f"{cand.id}.json"


def write_deployment(out: Path, cand: Candidate, seed: int) -> None:
    from twin.outputs import atomic_write_text

    path = deployment_path(out, cand)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(fleet_doc(cand, seed), indent=1, sort_keys=True) + "\n")


def simulate_command(q: Question, cand: Candidate, out: Path) -> str:
    """`servetwin simulate` of the candidate on the target-load workload file."""
    cmd = ["servetwin", "simulate", "--trace", str(out / WORKLOAD_FILE), "--trace-format",
           "jsonl"]
    if cand.replicas > 1:
        cmd += ["--deployment", str(deployment_path(out, cand))]
    else:
        cmd += ["--gpu", cand.gpu, *_server_flags(cand.args())]
        if cand.twin_policy:
            cmd += ["--policy", cand.twin_policy]
        if cand.kv_allocator != "token":
            cmd += ["--kv-allocator", cand.kv_allocator]
        if cand.step_time_backend:
            cmd += ["--step-time-backend", cand.step_time_backend]
    first = {}
    for s in q.slos:
        first.setdefault(s.metric, s.threshold_s)
    for metric, thr in first.items():
        cmd += [f"--slo-{metric}", f"{thr:g}"]
    cmd += ["--out", str(out / "candidates" / cand.id)]
    return shlex.join(cmd)


def _server_flags(args: ServerArgs) -> list[str]:
    from runtime.launch import launch_command

    # the same flags the launch command carries: model, TP and every non-default value
    full = launch_command(args)
    at = full.index("--host")
    return full[3:at] + full[at + 4:]


def launch_command(cand: Candidate) -> str:
    """The real deployment: one `sglang.launch_server` per replica (ports 30000, 30001,
    ...), behind `sglang_router.launch_router` when there are several; a policy SGLang does
    not have runs through servetwin's plugin (its environment variables first)."""
    from runtime.launch import launch_command as sglang_command
    from runtime.launch import not_sglang

    env = ""
    if cand.twin_policy:
        from runtime.plugin.env import plugin_env

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in
                       sorted(plugin_env(cand.twin_policy).items())) + " "
    lines = [env + shlex.join(sglang_command(cand.args(), port=FIRST_PORT + i))
             for i in range(cand.replicas)]
    if cand.replicas > 1:
        from runtime.router import POLICIES, RouterOptions, router_command

        urls = [f"http://127.0.0.1:{FIRST_PORT + i}" for i in range(cand.replicas)]
        if cand.router in POLICIES:
            lines.append(shlex.join(router_command("python", urls, ROUTER_PORT,
                                                   ROUTER_PORT + 1,
                                                   RouterOptions(policy=cand.router))))
        else:
            lines.append(f"# router {cand.router}: not an sglang-router 0.3.2 policy "
                         f"({', '.join(POLICIES)}); the twin's own router")
    cfg = sim_config(cand)
    lines += [f"# {n}" for n in not_sglang(cfg) if not n.startswith("--gpu ")]
    lines.append(f"# on {cand.replicas * cand.tp}x {cand.gpu}")
    return "\n".join(lines)
