"""servetwin's SGLang plugin: the twin's scheduling policy inside SGLang's scheduler.

SGLang 0.5.23 calls `load()` (entry point `servetwin` in the group `sglang.srt.plugins`)
in every process it starts, then applies the hooks registered here. With
`SERVETWIN_POLICY` unset it does nothing; with `SERVETWIN_POLICY=NAME|FILE.json|.yaml` it
registers the hooks of `runtime.plugin.hooks` (docs/plugin.md). With
`SERVETWIN_STEP_PROBE=PREFIX` (independently) it times the scheduler loop's CPU work per
step into `PREFIX.<pid>` (runtime.plugin.step_probe; `servetwin live step-cpu` reads it).
Importing this package is cheap and imports neither SGLang nor a policy.
"""

from __future__ import annotations

import logging
import os

POLICY_ENV = "SERVETWIN_POLICY"
FAULTS_ENV = "SERVETWIN_FAULT_POLICIES"
PLUGIN_NAME = "servetwin"


STEP_PROBE_ENV = "SERVETWIN_STEP_PROBE"


def load() -> None:
    """The entry point. Never raises: a bad spec is logged and the plugin stays off."""
    probe = os.environ.get(STEP_PROBE_ENV, "").strip()
    if probe:
        try:
            from runtime.plugin import step_probe

            step_probe.install(probe)
        except Exception:
            logging.getLogger("servetwin.plugin").exception(
                "servetwin plugin: the step probe (%s=%r) is not installed", STEP_PROBE_ENV,
                probe)
    text = os.environ.get(POLICY_ENV, "").strip()
    if not text:
        return
    log = logging.getLogger("servetwin.plugin")
    try:
        from runtime.plugin import hooks

        hooks._setup_logger()
        if os.environ.get(FAULTS_ENV) == "1":
            from runtime.plugin import faults

            faults.register_all()
        from twin.policy.registry import read_spec

        spec = read_spec(text)
        hooks.install(spec)
    except Exception:
        log.exception("servetwin plugin: %s=%r not installed; SGLang's own scheduling runs",
                      POLICY_ENV, text)
