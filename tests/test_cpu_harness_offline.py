"""The CPU harness's pure parts: command builder, model config, shims, install marker."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from runtime.cpu import install, model, pins, serve, shim
from servetwin.cli import build_parser

pytestmark = pytest.mark.offline


def test_command_has_harness_flags_and_defaults():
    cmd = serve.build_command("/env/bin/python", "/m", 1234)
    assert cmd[:3] == ["/env/bin/python", "-m", "sglang.launch_server"]
    assert _value(cmd, "--model-path") == "/m"
    assert _value(cmd, "--port") == "1234"
    assert _value(cmd, "--load-format") == "dummy"
    assert _value(cmd, "--attention-backend") == "torch_native"
    assert _value(cmd, "--max-total-tokens") == serve.DEFAULT_ARGS["--max-total-tokens"]
    for switch in ("--disable-overlap-schedule", "--enable-metrics", "--skip-server-warmup"):
        assert cmd.count(switch) == 1


def test_user_args_override_defaults_in_both_spellings():
    user = ["--port", "9", "--max-total-tokens=2048", "--enable-priority-scheduling"]
    cmd = serve.build_command("py", "/m", 1234, user)
    assert cmd[-len(user) :] == user
    assert cmd.count("--port") == 1 and "1234" not in cmd
    assert not any(a == "--max-total-tokens" for a in cmd)
    assert serve.port_of(cmd) == 9


def test_user_model_path_replaces_the_tiny_model():
    cmd = serve.build_command("py", "/tiny", 1, ["--model-path", "/other"])
    assert "/tiny" not in cmd and _value(cmd, "--model-path") == "/other"


def test_port_of_equals_form():
    assert serve.port_of(["x", "--port=77"]) == 77
    with pytest.raises(ValueError):
        serve.port_of(["x"])


def test_model_config_is_a_consistent_llama(tmp_path):
    spec = model.ModelSpec(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           intermediate_size=128, vocab_size=512)  # fmt: skip
    model.write_config(tmp_path, spec)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]
    assert config["vocab_size"] == 512
    tokenizer = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer["eos_token"] == model.SPECIAL_TOKENS[config["eos_token_id"]]
    assert spec.name == "tiny-llama-l2-h64-v512"


def test_model_config_is_deterministic(tmp_path):
    model.write_config(tmp_path / "a")
    model.write_config(tmp_path / "b")
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert model.synthetic_corpus(50) == model.synthetic_corpus(50)


def test_model_spec_refuses_inconsistent_shapes():
    with pytest.raises(ValueError):
        model.ModelSpec(hidden_size=100, num_heads=8)
    with pytest.raises(ValueError):
        model.ModelSpec(vocab_size=100)


def test_placeholder_finder_serves_sgl_kernel_submodules():
    finder = shim._PlaceholderFinder()
    assert finder.find_spec("numpy") is None
    spec = finder.find_spec("sgl_kernel.flash_attn")
    module = importlib.util.module_from_spec(spec)
    assert module.__path__ == []
    dummy = module.anything(1, x=2)
    assert "placeholder" in repr(dummy.attr[0])
    with pytest.raises(AttributeError):
        _ = module.__wrapped__


def test_shim_is_off_without_the_switch(monkeypatch):
    monkeypatch.delenv(shim.ENV_SWITCH, raising=False)
    before = list(__import__("sys").meta_path)
    shim.activate()
    assert __import__("sys").meta_path == before


def test_prefix_from_argument_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv(install.ENV_VAR, str(tmp_path / "env"))
    assert install.resolve_prefix() == tmp_path / "env"
    assert install.resolve_prefix(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(install.ENV_VAR)
    assert install.resolve_prefix() == install.DEFAULT_PREFIX.expanduser().resolve()


def test_missing_harness_says_how_to_install(tmp_path):
    with pytest.raises(install.HarnessError, match="servetwin live install-cpu"):
        install.require_harness(tmp_path)


def test_install_is_a_no_op_when_the_marker_matches(tmp_path):
    harness = install.Harness(tmp_path)
    harness.marker.write_text(json.dumps(harness.recipe()))
    lines: list[str] = []
    assert install.install(tmp_path, log=lines.append) == harness
    assert lines == [f"CPU SGLang harness already installed at {tmp_path}"]


def test_stale_marker_means_not_installed(tmp_path):
    harness = install.Harness(tmp_path)
    harness.marker.write_text(json.dumps(harness.recipe() | {"sglang": "0.0.1"}))
    assert not harness.is_installed()
    with pytest.raises(install.HarnessError, match="out of date"):
        install.require_harness(tmp_path)


def test_serve_cpu_passes_unknown_args_through_in_order():
    args = build_parser().parse_args(
        ["live", "serve-cpu", "--port", "3000", "--prefix", "/h", "--enable-metrics", "--x=1"]
    )
    assert args.prefix == "/h"
    assert args.sglang_args == ["--port", "3000", "--enable-metrics", "--x=1"]


def test_install_cpu_refuses_unknown_args(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["live", "install-cpu", "--bogus"])


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_stop_escalates_until_the_whole_group_is_gone():
    # A leader that ignores SIGINT and SIGTERM, with a child that does the same.
    stubborn = "trap '' INT TERM; sleep 60 & echo ready; wait"
    leader = subprocess.Popen(
        ["bash", "-c", stubborn], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert leader.stdout.readline() == "ready\n"
    assert serve._group_alive(leader.pid)
    signals = ((signal.SIGINT, 0.3), (signal.SIGTERM, 0.3), (signal.SIGKILL, 5.0))
    serve.stop_process_group(leader, signals)
    assert not serve._group_alive(leader.pid)
    assert leader.returncode == -signal.SIGKILL


def test_stop_sends_only_what_is_needed():
    # SIGINT at its default even when the test runs in a background job (which ignores it)
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    cmdline = Path(f"/proc/{leader.pid}/cmdline")
    while leader.poll() is None and not cmdline.read_bytes().startswith(b"sleep"):  # exec
        time.sleep(0.01)  # done, its session set up (a loaded machine can take a while)
    serve.stop_process_group(leader)
    assert leader.returncode == -signal.SIGINT


def test_locked_versions_are_exact_and_leave_the_core_pins_alone():
    names = [line.split("==")[0].lower() for line in pins.LOCKED]
    assert all(line.count("==") == 1 for line in pins.LOCKED)
    assert not {"torch", "torchvision", "triton", "sglang"} & set(names)
    assert len(names) == len(set(names))
