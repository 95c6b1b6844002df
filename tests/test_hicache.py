"""SGLang's hierarchical cache (twin/hicache.py): hand-worked scenarios and the refusals.

One Llama-3.1-8B GPU (TP 1, 32 layers, 131,072 KV bytes per token) with a 2,500-token pool:
a 1,000-token document is cached, pushed off the GPU by a 1,500-token one, then asked again.
"""

from __future__ import annotations

import pytest

from tests.helpers import req, run_replica
from tests.stepmodels import FixedStepTime
from twin.config import ServerArgs
from twin.errors import ConfigError
from twin.hardware import get_gpu
from twin.hicache import host_capacity_tokens, host_link, layerwise_step

pytestmark = pytest.mark.offline

KV = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B bf16, one GPU
BW = 32e9  # aiconfigurator-core a100_sxm.yaml node.pcie_bw
DOC, DOC2, Q = (1, 1000), (2, 1500), 8


def scenario(**server):
    reqs = [req("a", 0.0, [DOC, (10, Q)], 2), req("b", 1.0, [DOC2, (11, Q)], 2),
            req("c", 2.0, [DOC, (12, Q)], 2)]
    return run_replica(reqs, FixedStepTime(prefill_s=0.001, decode_s=0.001),
                       max_total_tokens=2500, **server)


def test_host_link_is_aiconfigurators_pcie_bandwidth():
    assert host_link(get_gpu("a100-sxm-80gb")) == (
        BW, "aiconfigurator-core systems/a100_sxm.yaml node.pcie_bw")
    assert host_link(get_gpu("a100-pcie-80gb"))[0] == 32e9  # systems/a100_pcie.yaml


def test_a_document_evicted_from_the_gpu_is_loaded_back_from_host():
    rep, recs = scenario(enable_hierarchical_cache=True)
    st = rep.hicache.stats
    assert recs["c"]["cached_tokens"] == 1000  # the whole document, from host
    assert st["host_hits"] == 1 and st["host_hit_tokens"] == 1000
    assert st["loaded_back_tokens"] == 1000
    load = 1000 * KV / BW  # 4.096 ms over the host link
    assert st["load_back_s"] == pytest.approx(load)
    # the forward's layer i waits for layer i's copy: 4.096 ms + 1 ms / 32 layers
    step = layerwise_step(0.001, load, 32)
    assert step == pytest.approx(load + 0.001 / 32)
    assert st["load_back_wait_s"] == pytest.approx(step - 0.001)
    starts = {e[2][0][0]: e[1] for e in rep.step_log if e[0] == "prefill"}
    nxt = min(e[1] for e in rep.step_log if e[1] > starts["c"])
    assert nxt - starts["c"] == pytest.approx(step)
    # write_through: each prompt was copied to host at its insert, outputs too
    assert st["written_tokens"] >= 1008 + 1508


def test_without_the_host_tier_the_document_is_recomputed():
    rep, recs = scenario()
    assert rep.hicache is None and recs["c"]["cached_tokens"] == 0


def test_write_through_selective_copies_only_on_the_second_insert():
    rep, recs = scenario(enable_hierarchical_cache=True,
                         hicache_write_policy="write_through_selective")
    assert recs["c"]["cached_tokens"] == 0  # seen once: never copied, recomputed
    assert rep.hicache.stats["host_hits"] == 0


def test_write_back_copies_at_eviction_and_waits_for_it():
    rep, recs = scenario(enable_hierarchical_cache=True, hicache_write_policy="write_back")
    st = rep.hicache.stats
    assert recs["c"]["cached_tokens"] == 1000
    assert st["written_tokens"] >= 1000  # a's path, when b pushed it off the GPU
    assert st["write_back_stall_s"] == pytest.approx(st["written_tokens"] * KV / BW)


def test_a_full_host_pool_evicts_its_least_recent_gpu_evicted_copies():
    # host pool of 1,600 tokens (ratio 0.64): b's copy needs a's host-only copy gone
    rep, recs = scenario(enable_hierarchical_cache=True, hicache_ratio=0.64)
    st = rep.hicache.stats
    assert st["host_capacity_tokens"] == 1601
    assert st["host_evictions"] >= 1 and recs["c"]["cached_tokens"] == 0


def test_host_pool_size_as_sglang_computes_it():
    assert host_capacity_tokens(None, 0, 1000, KV, 1) == 2001  # ratio 2.0, page_num + 1
    assert host_capacity_tokens(1.0, 0, 1000, KV, 64) == 1024
    assert host_capacity_tokens(3.0, 1, 1000, KV, 1) == int(1e9 // KV)  # size wins


@pytest.mark.parametrize("kw, words", [
    (dict(disable_radix_cache=True), "The arguments enable-hierarchical-cache and "
     "disable-radix-cache are mutually exclusive"),
    (dict(hicache_host_memory_mode="buffer_only"), "buffer_only requires a storage backend"),
    (dict(hicache_storage_backend="file"), "host-memory tier only"),
    (dict(hicache_write_policy="write_sometimes"), "allowed values: write_back, write_through"),
    (dict(hicache_ratio=0.0), "--hicache-ratio"),
])
def test_refused_where_sglang_refuses(kw, words):
    with pytest.raises(ConfigError, match=words):
        ServerArgs(enable_hierarchical_cache=True, **kw)


def test_off_by_default_and_the_flags_alone_change_nothing():
    _, plain = scenario()
    _, flags = scenario(hicache_write_policy="write_back", hicache_ratio=4.0)
    assert plain == flags


def _docs_workload():
    from twin.workload import Request, Workload

    reqs = []
    for i in range(40):  # three 3k-token documents asked again and again, open loop
        doc = (100 + i % 3, 3000)
        reqs.append(Request.make(f"r{i}", 0.05 * i, [(1, 64), doc, (1000 + i, 32)], 16, 0))
    return Workload("docs", tuple(reqs), None)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_the_host_tier_passes_the_integrity_checks(policy):
    from twin.sim import SimConfig, simulate

    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B", max_total_tokens=7000,
                      enable_hierarchical_cache=True, hicache_write_policy=policy)
    cfg = SimConfig(args=args, gpu="a100-sxm-80gb")
    plain = simulate(_docs_workload(), cfg)
    hc = plain.summary["engine"]["hicache"]
    assert hc["host_hits"] > 0 and hc["loaded_back_tokens"] > 0  # the scenario exercises it
    debug = simulate(_docs_workload(), SimConfig(args=args, gpu="a100-sxm-80gb",
                                                 debug_checks=True))  # integrity every pass
    assert list(debug.records) == list(plain.records)


def test_the_text_summary_shows_the_host_tier_only_when_it_is_on():
    from twin.metrics import format_summary
    from twin.sim import SimConfig, simulate

    base = dict(model_path="meta-llama/Llama-3.1-8B", max_total_tokens=7000)
    on = simulate(_docs_workload(), SimConfig(args=ServerArgs(
        **base, enable_hierarchical_cache=True), gpu="a100-sxm-80gb"))
    off = simulate(_docs_workload(), SimConfig(args=ServerArgs(**base), gpu="a100-sxm-80gb"))
    hc = on.summary["engine"]["hicache"]
    line = [x for x in format_summary(on.summary).splitlines() if "hierarchical" in x]
    assert line and f"{hc['host_hits']} host hits" in line[0]
    assert "hierarchical" not in format_summary(off.summary)
