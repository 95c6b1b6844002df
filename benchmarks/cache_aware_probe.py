"""Where does the real sglang-router 0.3.2 `cache_aware` send cache misses?

    python benchmarks/cache_aware_probe.py

Two CPU SGLang servers (runtime/fleet.py), a fresh cache_aware router (`--log-level debug`,
its log and Prometheus text printed at the end), ten sequential requests (each answered
before the next): five distinct 256-token templates, two repeated, two with no template;
once as `input_ids`, once as `text`. Then, on a fresh router, a miss while another request
is in flight: A (64 output tokens) is sent, B (another template) 0.5 s later while A still
runs, then C (a third template) after both ended. Prints the replica that served each
request and its cached tokens. docs/fleet-live.md has the result.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.fleet import Fleet, FleetSpec  # noqa: E402
from runtime.router import RouterOptions, RouterProcess  # noqa: E402
from runtime.token_ids import SegmentTokens  # noqa: E402

SEQUENCE = (("A", 1), ("B", 2), ("C", 3), ("A", 4), ("B", 5), ("N", 6), ("C", 7), ("N", 8),
            ("D", 9), ("E", 10))
TEMPLATES = {"A": 1000, "B": 1001, "C": 1002, "D": 1003, "E": 1004}


def generate(url: str, rid: str, ids: list[int] | None, text: str | None,
             max_new: int = 2) -> dict:
    body: dict = {"rid": rid, "sampling_params": {"max_new_tokens": max_new,
                                                  "ignore_eos": True}}
    body.update({"input_ids": ids} if text is None else {"text": text})
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["meta_info"]


def main() -> int:
    tokens = SegmentTokens(4096, 0)
    logs = Path(tempfile.mkdtemp(prefix="cache-aware-probe-"))
    with Fleet(FleetSpec(replicas=2, log_dir=logs)) as fleet:
        for mode in ("input_ids", "text"):
            opts = RouterOptions(policy="cache_aware", log_level="debug")
            with RouterProcess(fleet.worker_urls, opts, env=fleet.router_env,
                               log_path=logs / f"router-{mode}.log") as router:
                served = []
                for name, i in SEQUENCE:
                    segs = ([(TEMPLATES[name], 256)] if name in TEMPLATES else []) + [
                        (50_000 + i, 48)]
                    text = None
                    if mode == "text":
                        text = (f"template {name} " * 150 if name in TEMPLATES else "") + (
                            f" own part {i} " * 30)
                    meta = generate(router.url, f"{mode}-{name}{i}", tokens.prompt(segs), text)
                    served.append(f"{name}{i}:{meta.get('weight_version')}"
                                  f"(cached {meta.get('cached_tokens')})")
                print(f"{mode}: " + "  ".join(served), flush=True)
        opts = RouterOptions(policy="cache_aware", log_level="debug")
        with RouterProcess(fleet.worker_urls, opts, env=fleet.router_env,
                           log_path=logs / "router-concurrent.log") as router:
            print("concurrent: " + "  ".join(concurrent(router.url, tokens)), flush=True)
        print(f"router logs in {logs}")
    return 0


def concurrent(url: str, tokens: SegmentTokens) -> list[str]:
    """A long request A; B (a miss) while A is in flight; C (a miss) once both ended."""
    out: dict[str, dict] = {}

    def send(name: str, i: int, max_new: int) -> None:
        segs = [(TEMPLATES[name], 256), (60_000 + i, 48)]
        out[name] = generate(url, f"conc-{name}{i}", tokens.prompt(segs), None, max_new)

    first = threading.Thread(target=send, args=("A", 1, 64))
    first.start()
    time.sleep(0.5)
    send("B", 2, 2)
    first.join()
    send("C", 3, 2)
    return [f"{n}:{m.get('weight_version')}(cached {m.get('cached_tokens')})"
            for n, m in sorted(out.items())]


if __name__ == "__main__":
    sys.exit(main())
