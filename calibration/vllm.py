"""Calibrate the twin's vLLM replica against a live vLLM V1 server (`servetwin calibrate`).

What the server says about itself, from vLLM's own HTTP API (`server_facts`): `/version`,
`/v1/models` (model path, `max_model_len`), `/metrics`' `vllm:cache_config_info` (block
size, KV blocks, prefix caching) and, in vLLM's dev mode, `/server_info` (device, TP). vLLM
reports neither `max_num_seqs` nor `max_num_batched_tokens` anywhere, so the caller says
them (`--max-num-seqs`, `--max-num-batched-tokens`: the values the server was started with).

vLLM has no `/generate`, no `/flush_cache` and no per-request stamps; the profiling runs go
through servetwin's length router (`runtime/length_router.py`, its `/generate` front for a
vLLM pool, the hop the users' length-routed fleet has too), with the SGLang profiling plan
(`calibration.profile.make_plan`, sized by the vLLM limits: the token budget as the chunk).
Before and after every run, `/metrics` is read: vLLM's per-request prefill, decode and
queue histograms give engine-side samples (`calibration.vllm_derive`). Token gaps are read
under vLLM's rules (one token budget per step, prefill chunks beside decodes).

Every run's raw traces and metric delta are appended to `PROFILE.runs.jsonl` as it ends;
the same command resumes after the runs there (refusing runs of another server). The fit
is `calibration.fit.fit_step_time`'s (the `linear` form, runs held out for the choice of
target, as for SGLang). The profile has the SGLang profile's shape with `engine.name`
`vllm`, `server_args` by vLLM's names (`twin.vllm_replica.VllmArgs`) and
`request_path.total_s` (TTFT outside the engine, from lone requests).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from calibration.fit import fit_step_time
from calibration.profile import make_plan
from calibration.session import CalibrationError
from calibration.vllm_runs import (
    Store,
    VllmLimits,
    execute,
    request_path_s,
    run_plan,
    samples_of,
    sglang_rule_samples,
)

__all__ = ["Store", "VllmFacts", "VllmLimits", "cache_config", "calibrate", "describe",
           "execute", "fit_profile", "is_vllm", "profile", "request_path_s", "run_plan",
           "samples_of", "server_facts", "sglang_rule_samples"]
ENGINE = "vllm"


@dataclass(frozen=True)
class VllmFacts:
    """A live vLLM server as its HTTP API describes it."""

    url: str
    version: str
    model_path: str
    max_model_len: int
    block_size: int
    num_blocks: int
    prefix_caching: bool
    device: str
    tp_size: int
    vocab: int
    notes: tuple[str, ...] = field(default=())

    @property
    def model(self) -> str:
        return Path(self.model_path).name

    def identity(self) -> dict:
        return {"engine": ENGINE, "version": self.version, "model": self.model}

    def limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> VllmLimits:
        return VllmLimits(max_num_seqs, max_num_batched_tokens,
                          (self.num_blocks - 1) * self.block_size, self.max_model_len)

    def server_args(self, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
        """`VllmArgs` fields of the server (the twin's vLLM replica reads them)."""
        return {"tensor_parallel_size": self.tp_size, "max_model_len": self.max_model_len,
                "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
                "block_size": self.block_size, "num_gpu_blocks_override": self.num_blocks,
                "enable_prefix_caching": self.prefix_caching}


def _get_json(url: str, timeout: float = 10.0):
    from runtime.server_api import _get

    return json.loads(_get(url, timeout))


def is_vllm(url: str) -> bool:
    """Whether `url` answers like a vLLM OpenAI server (`/v1/models` owned by vllm)."""
    try:
        data = _get_json(url + "/v1/models", 5.0).get("data") or [{}]
        return data[0].get("owned_by") == "vllm"
    except (OSError, ValueError, AttributeError, IndexError):
        return False


def server_facts(url: str) -> VllmFacts:
    """The facts of the vLLM server at `url`, or `CalibrationError` saying what is missing."""
    from runtime.server_api import describe_url_error

    try:
        model = (_get_json(url + "/v1/models").get("data") or [{}])[0]
        version = str(_get_json(url + "/version").get("version") or "")
        text = _metrics_text(url)
    except (OSError, ValueError, AttributeError) as exc:
        why = describe_url_error(exc) if isinstance(exc, OSError) else str(exc)
        raise CalibrationError(f"{url} does not answer like a vLLM server (GET /v1/models, "
                               f"/version, /metrics: {why})") from None
    if model.get("owned_by") != ENGINE or not version or not model.get("root"):
        raise CalibrationError(f"{url} is not a vLLM server: its /v1/models names no "
                               "model owned by vllm, or /version has no version")
    cache = cache_config(text)
    if not cache.get("block_size") or not cache.get("num_gpu_blocks"):
        raise CalibrationError(f"{url}/metrics has no vllm:cache_config_info with block_size "
                               "and num_gpu_blocks; is it vLLM V1?")
    device, tp, notes = _dev_info(url)
    root = str(model["root"])
    vocab, note = _vocab(root)
    return VllmFacts(url, version, root, int(model.get("max_model_len") or 0),
                     int(cache["block_size"]), int(cache["num_gpu_blocks"]),
                     cache.get("enable_prefix_caching", "True") == "True", device, tp, vocab,
                     tuple(notes + ([note] if note else [])))


def _metrics_text(url: str) -> str:
    from runtime.server_api import _get

    return _get(url + "/metrics", 10.0).decode()


def cache_config(text: str) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` in a `/metrics` text."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
    return {}


def _dev_info(url: str) -> tuple[str, int, list[str]]:
    """(device, TP size, notes) from `/server_info` (vLLM's dev mode only)."""
    try:
        cfg = str(_get_json(url + "/server_info").get("vllm_config", ""))
    except (OSError, ValueError, AttributeError):
        return "cuda", 1, ["/server_info unavailable (vLLM runs it in dev mode only): device "
                           "taken as cuda, TP 1"]
    dev = re.search(r"device_config=(\w+)", cfg)
    tp = re.search(r"tensor_parallel_size=(\d+)", cfg)
    return (dev.group(1) if dev else "cuda"), int(tp.group(1)) if tp else 1, []


def _vocab(root: str) -> tuple[int, str | None]:
    try:
        return int(json.loads((Path(root) / "config.json").read_text())["vocab_size"]), None
    except (OSError, ValueError, KeyError, TypeError):
        return 1000, f"{root}/config.json unreadable here: token ids drawn below 1000"


# ---- the profile ------------------------------------------------------------------------
def fit_profile(rows: list[dict], lim: VllmLimits, server_args: dict,
                facts: VllmFacts | None = None, sources: list[str] | None = None,
                rules: str = "vllm") -> dict:
    """The profile of the runs (`rules`: "vllm", or "sglang" for the first profiles' way
    of reading token gaps, to compare against)."""
    from calibration.profiles import machine

    derive = samples_of if rules == "vllm" else sglang_rule_samples
    samples = [s for row in rows for s in derive(row, lim)]
    tp = facts.tp_size if facts else int(server_args.get("tensor_parallel_size") or 1)
    fitted = fit_step_time(samples, tp)
    fitted["step_time"]["label"] = f"{facts.model if facts else '?'} on vLLM " \
                                   f"({facts.device if facts else 'cpu'})"
    paths = [row for row in rows if len(row["traces"]) == 1]
    return {
        "servetwin_calibration": 1,
        "engine": {"name": ENGINE, "version": facts.version if facts else "0.32.0"},
        "model": {"name": facts.model if facts else None,
                  "path": facts.model_path if facts else None},
        "device": {"kind": facts.device if facts else "cpu", "tp_size": tp,
                   "machine": machine()},
        "server_args": dict(server_args),
        **fitted,
        "request_path": {"total_s": request_path_s(rows), "samples": len(paths)},
        "derivation": rules, "runs": len(rows), "sources": sources or [],
        "notes": list(facts.notes) if facts else [],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def profile(front: str, engine: str, lim: VllmLimits, out: Path, budget_s: float,
            vocab: int, server_args: dict, log=print, facts: VllmFacts | None = None) -> dict:
    """Run the plan within `budget_s` on a fresh `out` (earlier runs there are dropped),
    fit, write the profile to `out` and return it (tests and benchmarks)."""
    identity = facts.identity() if facts else {"engine": ENGINE}
    out.with_suffix(".runs.jsonl").unlink(missing_ok=True)
    store = Store(out, identity)
    run_plan(front, engine, store, lim, vocab, budget_s,
             lambda done, el, n, tag: log(f"  {tag}: {n} samples so far"))
    prof = fit_profile(list(store.rows.values()), lim, server_args, facts,
                       [f"live profile of {engine} ({store.runs_path})"])
    out.write_text(json.dumps(prof, indent=2) + "\n")
    return prof


def calibrate(url: str, out: Path, budget_s: float, max_num_seqs: int,
              max_num_batched_tokens: int, log=print, progress_factory=None) -> dict:
    """`servetwin calibrate` for a vLLM server: facts, the length router's `/generate`
    front, the plan (resumed from `out`'s runs), the fit; returns the profile (not
    written: the caller does)."""
    from runtime.length_router import LengthRouterProcess, Pool

    facts = server_facts(url)
    lim = facts.limits(max_num_seqs, max_num_batched_tokens)
    if max_num_batched_tokens < 16 or lim.kv_tokens < 2 * facts.block_size:
        raise CalibrationError(f"{url}: limits too small to profile ({lim})")
    _check_reset(url)
    # runs of other limits would be read under the wrong budget: they are another server's
    store = Store(out, facts.identity() | {"max_num_seqs": max_num_seqs,
                                           "max_num_batched_tokens": max_num_batched_tokens,
                                           "num_blocks": facts.num_blocks,
                                           "block_size": facts.block_size})
    store.load()
    log(f"server: vLLM {facts.version}, model {facts.model_path}, device {facts.device}; "
        f"limits: max_num_seqs {max_num_seqs}, max_num_batched_tokens "
        f"{max_num_batched_tokens}, {facts.num_blocks} KV blocks of {facts.block_size} "
        f"tokens, max_model_len {facts.max_model_len}"
        + (f"; resuming after {len(store.rows)} runs" if store.rows else ""))
    for note in facts.notes:
        log(f"note: {note}")
    front_log = out.parent / (out.stem + ".front.log")
    with LengthRouterProcess([Pool("vllm", url, ENGINE, None)], log_path=front_log) as front:
        bar = progress_factory(len(make_plan(lim.server_limits())), budget_s) \
            if progress_factory else None
        counts = run_plan(front.url, url, store, lim, facts.vocab, budget_s, bar)
        if bar:
            bar.close()
    log(f"runs: {counts['ran']} now, {counts['resumed']} resumed, {counts['over_budget']} "
        f"left out by the budget, of {counts['planned']} planned; failed requests "
        f"{counts['failed_requests']}")
    if not store.rows:
        raise CalibrationError(f"no profiling runs fit --budget-s {budget_s:g}")
    return fit_profile(list(store.rows.values()), lim,
                       facts.server_args(max_num_seqs, max_num_batched_tokens), facts,
                       [f"live profile of {url} through the length router "
                        f"({store.runs_path})"])


def _check_reset(url: str) -> None:
    """Every run starts on an empty prefix cache: vLLM resets it only in its dev mode."""
    import urllib.request

    from runtime.server_api import describe_url_error

    try:
        req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
    except OSError as exc:
        raise CalibrationError(
            f"{url}: POST /reset_prefix_cache failed ({describe_url_error(exc)}): profiling "
            "starts every run on an empty prefix cache, which vLLM resets only in its dev "
            "mode; start the server with VLLM_SERVER_DEV_MODE=1 (the CPU harness does; keep "
            "such a server on 127.0.0.1)") from None


def describe(prof: dict) -> str:
    from calibration.profiles import describe_fit

    lines = describe_fit(prof, "vLLM")
    rp = prof["request_path"]
    total = rp.get("total_s")
    lines.append("request path (TTFT outside the engine): "
                 + (f"{total * 1e3:.1f} ms" if total is not None else "not measured")
                 + f" ({rp.get('samples', 0)} lone requests)")
    return "\n".join(lines)
