"""What-if capacity planning (`servetwin plan`; docs/what-if.md): for a workload at a target
load and SLOs, every candidate deployment of a search space is simulated, its largest
sustainable load found by a search over load, and the cheapest one meeting the SLOs, the
Pareto fronts of cost against P99 TTFT and goodput, and the users' stepped ramp reported.

- `question.py`: SLOs, the target load, the workload at a load multiplier;
- `space.py`: the search space file and its candidates;
- `evaluate.py`: feasibility, one candidate's simulations, the load search;
- `prices.py`: GPU-hour prices (a documented default table, `--prices FILE`);
- `ramp.py`: the stepped ramp to 200 %, per-window P99 and the three-in-a-row alert rule;
- `run.py`: serial, process-pool or Ray execution, progress, resume;
- `commands.py`: the winner's `servetwin simulate` and `sglang.launch_server` commands;
- `plan.py`: winner, Pareto fronts, plan.json and the output directory.
"""
