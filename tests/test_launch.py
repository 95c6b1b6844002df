"""One configuration, two engines: the launch command and the flags that do not carry over."""

import pytest

from runtime.launch import check_flags, launch_command, not_sglang, sglang_server_args
from twin.config import ServerArgs
from twin.sim import SimConfig


@pytest.mark.offline
def test_launch_command_passes_only_what_differs_from_sglang_defaults():
    args = ServerArgs(model_path="Qwen/Qwen3-32B", tp_size=2, max_total_tokens=140_000,
                      enable_mixed_chunk=True, schedule_policy="lpm")
    cmd = launch_command(args, port=31000)
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--model-path") + 1] == "Qwen/Qwen3-32B"
    assert cmd[cmd.index("--tp-size") + 1] == "2"
    assert cmd[cmd.index("--max-total-tokens") + 1] == "140000"
    assert "--enable-mixed-chunk" in cmd and cmd[cmd.index("--schedule-policy") + 1] == "lpm"
    assert "--max-prefill-tokens" not in cmd  # SGLang's default, not repeated


@pytest.mark.offline
def test_twin_only_settings_are_reported_not_dropped():
    cfg = SimConfig(kv_allocator="buddy", preemption_mode="moderate", swap_min_tokens=64_000)
    notes = "\n".join(not_sglang(cfg))
    for f in ("--kv-allocator buddy", "--preemption-mode moderate", "--swap-min-tokens 64000",
              "--gpu"):
        assert f in notes
    assert "--time-slice-ms" not in notes  # left at its default


@pytest.mark.offline
def test_check_flags_reports_missing_and_different_defaults():
    fields = {"max_prefill_tokens": 8192, "schedule_policy": "fcfs"}
    missing, differ = check_flags(fields)
    assert "--enable-mixed-chunk" in missing
    assert any(d.startswith("--max-prefill-tokens") for d in differ)


def test_every_twin_server_flag_is_a_flag_of_sglang_0_5_23(cpu_harness):
    """Against SGLang 0.5.23's own ServerArgs (from the harness): same names, same defaults.
    (This is how the twin learned that 0.5.23 has --cuda-graph-max-bs-decode, not
    --cuda-graph-max-bs.)"""
    from runtime.cpu.install import harness_env

    fields = sglang_server_args(cpu_harness.python, harness_env())
    assert check_flags(fields) == ([], [])
