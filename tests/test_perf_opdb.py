"""The opdb step-time backend against aiconfigurator-core itself (real, not mocked)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.config import ServerArgs, derive_capacity
from twin.perf import default_backend, make_step_time
from twin.perf.opdb import OpdbParams, OpdbStepTime

pytestmark = pytest.mark.offline

EPS = 1e-12  # "non-decreasing" up to float rounding of the interpolation
ARGS = ServerArgs(model_path="meta-llama/Llama-3.1-8B", context_length=8192)


@pytest.fixture(scope="module")
def cap():
    return derive_capacity(ARGS, "h100-sxm-80gb")


@pytest.fixture(scope="module")
def raw(cap):
    return OpdbStepTime(cap, ARGS, OpdbParams(smooth=False))


@pytest.fixture(scope="module")
def smooth(cap):
    return make_step_time("opdb", cap, ARGS)


@pytest.fixture(scope="module")
def aic_direct():
    """aiconfigurator-core's own engine and op list for the same model, system and TP."""
    from aiconfigurator_core.sdk import engine
    from aiconfigurator_core.sdk.models import get_model

    mc = engine.build_model_config(
        tp_size=1, pp_size=1, attention_dp_size=1, moe_tp_size=1, moe_ep_size=1,
        gemm_quant_mode=None, kvcache_quant_mode="bfloat16", fmha_quant_mode=None,
        moe_quant_mode=None, comm_quant_mode=None, forward_model=None, attention_backend=None)
    model = get_model("meta-llama/Meta-Llama-3.1-8B", mc, "sglang")
    handle = engine.EngineHandle.compile("meta-llama/Meta-Llama-3.1-8B", "h100_sxm", "sglang",
                                         backend_version="current", tp_size=1,
                                         kvcache_quant_mode="bfloat16")
    return handle, model


def _names(ops):
    return [op._name for op in ops]


def test_prefill_step_is_the_sum_of_its_queried_parts(raw, aic_direct):
    handle, model = aic_direct
    n = 1024
    assert n in raw.cn and n in raw._cn_list
    names = _names(model.context_ops)
    body = [i for i, nm in enumerate(names) if not nm.endswith("logits_gemm")]
    ctx = sum(v[1] for v in handle.evaluate_context_ops(body, batch_size=1, s=n, prefix=0, x=n))
    logits = names.index("context_logits_gemm")
    head = handle.evaluate_generation_ops([logits], batch_size=1, s=1)[0][1]
    expected = (ctx + head) / 1e3 + raw._eager + raw._per_request  # scheduler: 1 request
    assert raw.step_time([(n, 0)], []) == pytest.approx(expected, rel=1e-9)


def test_decode_step_is_the_sum_of_its_queried_parts(raw, aic_direct):
    handle, model = aic_direct
    b, kv = 32, int(raw.ds[40])  # 32 is a captured CUDA-graph batch size
    assert b in raw.db
    idx = list(range(len(model.generation_ops)))
    parts = handle.evaluate_generation_ops(idx, batch_size=b, s=kv)
    expected = sum(v[1] for v in parts) / 1e3 + raw._graph + raw._per_request * b
    assert raw.step_time([], [kv] * b) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("chunks,decode", [
    ([(1024, 0)], []), ([(3000, 500), (17, 4096)], [100, 5000, 7000]), ([], [2048] * 37),
    ([], [10] * 300), ([(8192, 0)], [1] * 5)])
def test_breakdown_sums_to_step_time(smooth, chunks, decode):
    parts = smooth.breakdown(chunks, decode)
    assert set(parts) >= {"gemm", "lm_head", "prefill_attention", "decode_attention",
                          "allreduce", "overhead"}
    assert sum(parts.values()) == pytest.approx(smooth.step_time(chunks, decode), rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 400), kv=st.integers(1, 8000), extra=st.integers(1, 50))
def test_decode_is_non_decreasing_in_batch_and_kv(smooth, b, kv, extra):
    t = smooth.step_time([], [kv] * b) * (1 - EPS)
    assert smooth.step_time([], [kv] * (b + extra)) >= t
    assert smooth.step_time([], [kv + extra] * b) >= t


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8000), pre=st.integers(0, 8000), extra=st.integers(1, 500),
       dec=st.integers(0, 64))
def test_prefill_is_non_decreasing_in_chunk_and_prefix(smooth, n, pre, extra, dec):
    d = [1000] * dec
    t = smooth.step_time([(n, pre)], d) * (1 - EPS)
    assert smooth.step_time([(n + extra, pre)], d) >= t
    assert smooth.step_time([(n, pre + extra)], d) >= t
    assert smooth.step_time([(n, pre)], d + [1000]) >= t


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 8000), min_size=1, max_size=300))
def test_decode_times_equals_step_time(smooth, lens):
    got = smooth.decode_times(len(lens), np.array([sum(lens), sum(lens) + 7]))
    assert got[0] == smooth.step_time([], lens)
    assert got[1] == smooth.step_time([], [*lens[:-1], lens[-1] + 7])


def test_smoothing_stays_close_to_the_measurements(raw, smooth):
    for b in (1, 8, 64, 200):
        for kv in (512, 4096):
            r, s = raw.step_time([], [kv] * b), smooth.step_time([], [kv] * b)
            assert s == pytest.approx(r, rel=0.10)


# The two backends agree within this factor on the closing-note grid (docs/perf.md).
BACKEND_FACTOR = 2.5


@pytest.mark.parametrize("gpu", ["a100-sxm-80gb", "h100-sxm-80gb"])
@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B", "Qwen/Qwen3-32B"])
def test_opdb_and_roofline_agree_within_a_factor(model, gpu):
    args = ServerArgs(model_path=model, context_length=32768 + 2048)
    cap = derive_capacity(args, gpu)
    opdb, roof = make_step_time("opdb", cap, args), make_step_time("roofline", cap, args)
    batches = [([], [kv] * b) for b in (1, 32, 128) for kv in (2048, 32768)]
    batches += [([(n, 0)], []) for n in (1024, 8192, 32768)]
    for chunks, dec in batches:
        ratio = opdb.step_time(chunks, dec) / roof.step_time(chunks, dec)
        assert 1 / BACKEND_FACTOR < ratio < BACKEND_FACTOR, (chunks, len(dec), ratio)


def test_a100_pcie_is_derived_from_sxm_and_says_so():
    args = ServerArgs(model_path="meta-llama/Llama-3.1-8B", tp_size=2, context_length=8192)
    pcie = make_step_time("opdb", derive_capacity(args, "a100-pcie-80gb"), args)
    sxm = make_step_time("opdb", derive_capacity(args, "a100-sxm-80gb"), args)
    assert "A100 SXM data x 1.054" in pcie.describe()
    for chunks, dec in (([], [2048] * 16), ([(4096, 0)], [])):
        assert pcie.step_time(chunks, dec) > sxm.step_time(chunks, dec)
    # PCIe all-reduce dominates the difference for a large prefill
    diff = pcie.breakdown([(4096, 0)], [])["allreduce"] - sxm.breakdown([(4096, 0)], [])["allreduce"]
    assert diff > 0


def test_extrapolation_is_logged_once(smooth, caplog):
    with caplog.at_level(logging.WARNING, logger="twin.perf.opdb"):
        smooth._warned.discard("ctx")
        smooth.step_time([(20000, 0)], [])
        smooth.step_time([(30000, 0)], [])
    msgs = [r.message for r in caplog.records if "context attention" in r.message]
    assert len(msgs) == 1 and "measured" in msgs[0]


def test_cuda_graph_lowers_decode_overhead_only_up_to_its_max_batch():
    on = ServerArgs(model_path="meta-llama/Llama-3.1-8B", context_length=8192)
    off = ServerArgs(model_path="meta-llama/Llama-3.1-8B", context_length=8192,
                     disable_cuda_graph=True)
    cap = derive_capacity(on, "a100-sxm-80gb")
    g, e = make_step_time("opdb", cap, on), make_step_time("opdb", cap, off)
    assert e.step_time([], [2048] * 32) > g.step_time([], [2048] * 32)
    big = cap.cuda_graph_max_bs + 1
    assert e.step_time([], [2048] * big) == pytest.approx(g.step_time([], [2048] * big))
    assert e.step_time([(512, 0)], []) == g.step_time([(512, 0)], [])


def test_default_backend_uses_data_where_it_covers():
    llama = ServerArgs(model_path="meta-llama/Llama-3.1-8B")
    assert default_backend(derive_capacity(llama, "a100-sxm-80gb")) == "opdb"
    assert default_backend(derive_capacity(llama, "a100-pcie-80gb")) == "opdb"
    fp8_kv_on_a100 = ServerArgs(model_path="meta-llama/Llama-3.1-8B", kv_cache_dtype="fp8_e4m3")
    assert default_backend(derive_capacity(fp8_kv_on_a100, "a100-sxm-80gb")) == "roofline"


class _BreakdownOnly:
    """A backend that answers `breakdown` but has no `overhead` shortcut."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name

    def step_time(self, chunks, decode):
        return self.inner.step_time(chunks, decode)

    def breakdown(self, chunks, decode):
        return self.inner.breakdown(chunks, decode)


@pytest.mark.parametrize("chunks,decode", [
    ([(1024, 0)], []), ([(3000, 500), (17, 4096)], [100, 5000, 7000]), ([], [2048] * 37),
    ([], [10] * 300), ([(8192, 0)], [1] * 5)])
def test_the_overlap_loop_reads_the_overhead_alone_as_from_the_breakdown(smooth, chunks,
                                                                         decode):
    """OverlapStepTime takes opdb's `overhead` instead of a whole breakdown: the same
    float, and the CPU part as the model defines it (eager with a prefill, the graph's
    launch for a decode batch it captures)."""
    from twin.overlap import OverlapStepTime
    assert (OverlapStepTime(smooth).step_time(chunks, decode)
            == OverlapStepTime(_BreakdownOnly(smooth)).step_time(chunks, decode))
    graph = not chunks and len(decode) <= smooth._graph_bs
    assert smooth.overhead(chunks, decode) == ((smooth._graph if graph else smooth._eager)
                                               + smooth._per_request
                                               * (len(chunks) + len(decode)))
