"""The environment that switches the plugin on in an SGLang server (used by the CLI and
tests; imports no SGLang)."""

from __future__ import annotations

from pathlib import Path

from runtime.plugin import FAULTS_ENV, PLUGIN_NAME, POLICY_ENV, STEP_PROBE_ENV

LOG_ENV = "SERVETWIN_DECISION_LOG"
BUDGET_ENV = "SERVETWIN_POLICY_BUDGET_MS"


def plugin_env(spec: str, decision_log: str | Path | None = None,
               budget_ms: float | None = None, faults: bool = False) -> dict[str, str]:
    """`SGLANG_PLUGINS`, `SERVETWIN_POLICY` (a spec file made absolute: the server runs in
    another directory) and the optional log and budget. Raises `PolicyError` on a bad spec,
    before any server starts."""
    if faults:
        from runtime.plugin.faults import register_all

        register_all()
    from twin.policy.registry import read_spec

    parsed = read_spec(spec)
    where = parsed.text or (str(Path(parsed.source).resolve()) if parsed.source
                            else parsed.name)
    env = {"SGLANG_PLUGINS": PLUGIN_NAME, POLICY_ENV: where}
    if decision_log:
        env[LOG_ENV] = str(Path(decision_log).resolve())
    if budget_ms is not None:
        env[BUDGET_ENV] = str(budget_ms)
    if faults:
        env[FAULTS_ENV] = "1"
    return env


def step_probe_env(prefix: str | Path) -> dict[str, str]:
    """The environment that loads the plugin with the step probe writing `PREFIX.<pid>`
    (runtime/plugin/step_probe.py); merge it with `plugin_env` for both."""
    return {"SGLANG_PLUGINS": PLUGIN_NAME, STEP_PROBE_ENV: str(Path(prefix).resolve())}

