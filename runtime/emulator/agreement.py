"""SGLang's own `bench_serving` (the CPU harness's) against an emulated server, and the same
workload through `servetwin simulate`: the emulator's agreement with the twin
(tests/test_emulator_live.py, benchmarks/emulator.py).

The workload is a closed loop (`--max-concurrency C`, as the twin's `arrival=closed`) of
N requests of fixed prompt and output lengths, random token ids sent as `input_ids`
(`--dataset-name random-ids --tokenize-prompt`: exact prompt lengths, no shared prefixes).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from runtime.cpu.install import harness_env
from twin.errors import ServetwinError
from twin.sim import SimConfig, simulate
from twin.workload import from_spec

HARNESS = Path(os.environ.get("SERVETWIN_SGLANG_ENV", "~/.cache/servetwin/sglang-cpu"))
TOKENIZER = "models/tiny-llama-l6-h512-v4096"  # the harness model's tokenizer (vocab 4096)


@dataclass(frozen=True)
class ClosedLoop:
    concurrency: int = 4
    requests: int = 24
    prompt_tokens: int = 512
    output_tokens: int = 32
    seed: int = 7

    @property
    def spec(self) -> str:
        return (f"arrival=closed,concurrency={self.concurrency},n={self.requests},"
                f"prompt=fixed:{self.prompt_tokens},output=fixed:{self.output_tokens}")


def bench_serving(url: str, work: ClosedLoop, timeout_s: float = 600.0) -> dict:
    """Run `python -m sglang.bench_serving` against `url`; its result line (JSON)."""
    harness = HARNESS.expanduser()
    python = harness / "bin" / "python"
    if not python.exists():
        raise ServetwinError(f"the CPU harness is not installed at {harness}: run "
                             "`servetwin live install-cpu`")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.jsonl"
        cmd = [str(python), "-m", "sglang.bench_serving", "--backend", "sglang",
               "--base-url", url, "--dataset-name", "random-ids",
               "--random-input-len", str(work.prompt_tokens),
               "--random-output-len", str(work.output_tokens), "--random-range-ratio", "1",
               "--num-prompts", str(work.requests), "--max-concurrency",
               str(work.concurrency), "--tokenize-prompt", "--tokenizer",
               str(harness / TOKENIZER), "--seed", str(work.seed), "--output-file",
               str(out), "--disable-tqdm"]
        res = subprocess.run(cmd, env=harness_env(dict(os.environ)), capture_output=True,
                             text=True, timeout=timeout_s)
        if res.returncode != 0 or not out.exists():
            raise ServetwinError(f"bench_serving failed (code {res.returncode}): "
                                 f"{(res.stdout + res.stderr)[-1500:]}")
        return json.loads(out.read_text().splitlines()[-1])


def replayed(url: str, work: ClosedLoop) -> dict:
    """Mean TTFT and TPOT (ms) of the same closed loop sent by servetwin's own replay
    client (`runtime.client.replay`, the twin's model of a closed-loop client)."""
    from runtime.client import ReplayConfig, replay
    from twin.metrics import summarize

    res = replay(from_spec(work.spec, 0), ReplayConfig(url=url, max_lateness_s=60.0))
    s = summarize(res.records)
    return {"mean_ttft_ms": s["ttft_s"]["mean"] * 1e3, "mean_tpot_ms": s["tpot_s"]["mean"] * 1e3}


def simulated(cfg: SimConfig, work: ClosedLoop) -> dict:
    """Mean TTFT and TPOT (ms) of the same closed loop in `servetwin simulate`."""
    s = simulate(from_spec(work.spec, 0), cfg).summary
    return {"mean_ttft_ms": s["ttft_s"]["mean"] * 1e3, "mean_tpot_ms": s["tpot_s"]["mean"] * 1e3}
