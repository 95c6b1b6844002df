"""SGLang's own `bench_serving` (the CPU harness's) against an emulated server, and the same
workload through `servetwin simulate`: the emulator's agreement with the twin
(tests/test_emulator_live.py, benchmarks/emulator.py).

The workload is a closed loop (`--max-concurrency C`, as the twin's `arrival=closed`) of
N requests of fixed prompt and output lengths, random token ids sent as `input_ids`
(`--dataset-name random-ids --tokenize-prompt`: exact prompt lengths).

`bench_workload` is the twin's copy of what bench_serving sends: its random-ids draw
(prompt i is the run of ids `(offset_i + i + j) % vocab`, so two prompts are the same
exactly when they start at the same id: with 24 prompts in a vocabulary of 4096 that
happens in about 7 % of seeds) and its clients (`clients=bench`: the warm-up copy of the
first request, 1 s, then the loop; twin/workload.py CLIENTS).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.cpu.install import harness_env
from twin.errors import ServetwinError
from twin.sim import SimConfig, simulate
from twin.workload import Request, Workload, from_spec

HARNESS = Path(os.environ.get("SERVETWIN_SGLANG_ENV", "~/.cache/servetwin/sglang-cpu"))
TOKENIZER = "models/tiny-llama-l6-h512-v4096"  # the harness model's tokenizer (vocab 4096)
VOCAB = 4096


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

    def bench_prompts(self) -> list[tuple[int, int, int]]:
        """(first id, prompt length, output length) of each request bench_serving sends with
        `--seed`: `sample_random_requests(random_sample=False, return_text=False)` after
        `np.random.seed(seed)` (two `compute_random_lens` draws, then the offsets)."""
        rs = np.random.RandomState(self.seed)  # np.random.seed(seed): the same generator
        lo = lambda full: max(int(full * 1.0), 1)  # noqa: E731  --random-range-ratio 1
        ins = rs.randint(lo(self.prompt_tokens), self.prompt_tokens + 1, size=self.requests)
        outs = rs.randint(lo(self.output_tokens), self.output_tokens + 1, size=self.requests)
        offsets = rs.randint(0, VOCAB, size=self.requests)
        return [(int((offsets[i] + i) % VOCAB), int(ins[i]), int(outs[i]))
                for i in range(self.requests)]

    def bench_workload(self, clients: str = "bench") -> Workload:
        """The twin's copy of bench_serving's requests, in its order; the same prompt (same
        first id and length) is the same segment, so the radix cache shares it as the
        server's does. (Runs of different lengths from one id share a prefix in SGLang;
        here they do not: with fixed lengths there are none.)"""
        reqs = tuple(Request.make(f"r{i}", 0.0, [(_segment(first, n), n)], out)
                     for i, (first, n, out) in enumerate(self.bench_prompts()))
        return Workload(f"bench_serving random-ids seed {self.seed}", reqs, self.concurrency,
                        description=self.spec, clients=clients)


def _segment(first_id: int, n: int) -> int:
    return (1 << 41) + zlib.crc32(f"{first_id}:{n}".encode())


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


def simulated(cfg: SimConfig, work: ClosedLoop, clients: str = "replay") -> dict:
    """Mean TTFT and TPOT (ms) of the same closed loop in `servetwin simulate`: with
    `clients="replay"` the spec's workload (unique prompts, all clients start at 0), with
    `clients="bench"` bench_serving's own requests and clients (`bench_workload`)."""
    wl = from_spec(work.spec, 0) if clients == "replay" else work.bench_workload(clients)
    s = simulate(wl, cfg).summary
    return {"mean_ttft_ms": s["ttft_s"]["mean"] * 1e3, "mean_tpot_ms": s["tpot_s"]["mean"] * 1e3}
