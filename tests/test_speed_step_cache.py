"""The replica's step-time memo (twin/perf/step_cache.py) answers exactly what the backend
answers, bit for bit, and asks the backend nothing a run would not have asked beyond the
mean KV length where the backend starts warning."""

from __future__ import annotations

import numpy as np
import pytest

from twin.config import ServerArgs, derive_capacity
from twin.overlap import OverlapStepTime
from twin.perf import make_step_time
from twin.perf.step_cache import BLOCK, StepTimeCache, quiet_kv_mean

pytestmark = pytest.mark.offline

ARGS = ServerArgs(model_path="meta-llama/Llama-3.1-8B")


def _model(backend: str, overlap: bool):
    cap = derive_capacity(ARGS, "a100-sxm-80gb")
    st = make_step_time(backend, cap, ARGS)
    return OverlapStepTime(st) if overlap else st


@pytest.mark.parametrize("backend,overlap", [("roofline", False), ("roofline", True),
                                             ("opdb", True)])
def test_decode_and_prefill_match_the_backend_bit_for_bit(backend, overlap):
    st = _model(backend, overlap)
    cache = StepTimeCache(st, max_entries=300)  # small: clearing happens too
    rng = np.random.default_rng(0)
    for _ in range(3000):
        b = int(rng.integers(1, 300))
        kv0 = int(rng.integers(b, b * 9000))
        k = int(rng.integers(1, 3 * BLOCK))
        if (kv0 + b * (k - 1)) / b > cache.quiet:
            continue  # the replica asks the backend itself there
        want = st.decode_times(b, np.arange(kv0, kv0 + b * k, b))
        got = cache.decode(b, kv0, k)
        assert got.tobytes() == want.tobytes(), (b, kv0, k)
        assert cache.first(b, kv0) == float(want[0])
        span = float(rng.uniform(0.0, 2.0))  # a run bounded by its first step, as before
        bounded = want[:int(span / float(want[0])) + 1] if k > 1 else want
        assert cache.run(b, kv0, k, span).tobytes() == bounded.tobytes(), (b, kv0, k, span)
        # a run continuing the same batch reads on from the same blocks
        kv1 = kv0 + b * k
        assert cache.decode(b, kv1, 5).tobytes() == st.decode_times(
            b, np.arange(kv1, kv1 + 5 * b, b)).tobytes()
    for _ in range(500):
        chunks = [(int(rng.integers(1, 8000)), int(rng.integers(0, 4)) * 1024)
                  for _ in range(int(rng.integers(1, 4)))]
        assert cache.prefill(chunks) == st.step_time(chunks, [])
        assert cache.prefill(chunks) == st.step_time(chunks, [])  # the memo's answer


def test_quiet_limit_comes_through_wrappers():
    opdb = _model("opdb", False)
    assert quiet_kv_mean(OverlapStepTime(opdb)) == opdb.extents.decode_kv
    assert quiet_kv_mean(_model("roofline", True)) == float("inf")

    class Unknown:  # a backend that says nothing: no block is computed ahead
        name = "unknown"

    assert quiet_kv_mean(Unknown()) == float("-inf")


class Spy:
    """A linear backend that warns above mean KV `quiet`, recording every mean asked."""

    name = "spy"

    def __init__(self, quiet: float) -> None:
        self.quiet_kv_mean = quiet
        self.asked: list[float] = []

    def decode_times(self, b, kv_sums):
        mean = np.asarray(kv_sums, dtype=float) / b
        self.asked.append(float(mean.max()))
        return 0.01 + 1e-6 * mean

    def step_time(self, chunks, lens):
        return 0.02


def test_blocks_never_ask_beyond_the_quiet_limit():
    spy = Spy(quiet=1000.0)
    cache = StepTimeCache(spy)
    rng = np.random.default_rng(1)
    for _ in range(2000):
        b = int(rng.integers(1, 40))
        k = int(rng.integers(1, BLOCK))
        top = int(1000 * b - b * (k - 1))  # the run's last step at mean <= 1000
        kv0 = int(rng.integers(0, max(top, 1)))
        run_max = (kv0 + b * (k - 1)) / b
        n = len(spy.asked)
        want = 0.01 + 1e-6 * (np.arange(kv0, kv0 + b * k, b) / b)
        assert cache.decode(b, kv0, k).tobytes() == want.tobytes()
        # anything asked ahead stays at or below the limit; a direct ask is the run itself
        assert all(m <= max(spy.quiet_kv_mean, run_max) for m in spy.asked[n:])
    assert max(spy.asked) <= 1000.0


def test_memo_shared_by_the_same_backend_under_the_same_wrappers():
    from twin.perf.step_cache import memo_for

    a, b = _model("roofline", False), _model("roofline", False)
    m = memo_for(OverlapStepTime(a))
    assert memo_for(OverlapStepTime(a)) is m  # another replica, another run on `a`
    assert memo_for(a) is not m and memo_for(a) is memo_for(a)
    assert memo_for(OverlapStepTime(b)) is not m
    # a shared memo answers for any of the equal wrappers
    other = OverlapStepTime(a)
    assert m.decode(7, 7 * 1500, 40).tobytes() == other.decode_times(
        7, np.arange(7 * 1500, 7 * 1540, 7)).tobytes()


def test_a_shared_memo_goes_with_its_backend():
    import gc
    import weakref

    from twin.perf.step_cache import memo_for

    st = _model("roofline", False)
    memo_for(OverlapStepTime(st)).decode(3, 3000, 10)
    gone = weakref.ref(st)
    del st
    gc.collect()
    assert gone() is None  # nothing module-level keeps a backend (or its memo) alive


@pytest.mark.parametrize("gpu,overlap", [("a100-sxm-80gb", False), ("a100-sxm-80gb", True),
                                         ("h100-sxm-80gb", True)])
def test_the_typed_cores_decode_kernel_is_the_backends_decode_times(gpu, overlap):
    """The typed core computes opdb's decode steps itself (twin/_corec.pyx `Kernel`,
    np.interp and np.maximum replayed): the backend's own floats, bit for bit, for
    tabulated and in-between batch sizes, batches beyond the table, and KV lengths
    below, inside and beyond the measured range."""
    core = pytest.importorskip("twin._corec", reason="the typed core is not built")
    cap = derive_capacity(ARGS, gpu)
    st = make_step_time("opdb", cap, ARGS)
    st = OverlapStepTime(st) if overlap else st
    rng = np.random.default_rng(1)
    for b in [1, 2, 3, 7, 8, 9, 31, 64, 100, 257, 1000, *rng.integers(1, 2000, 40).tolist()]:
        kern = core.decode_kernel(st, b)
        assert kern is not None
        xp = st.inner.ds if overlap else st.ds
        kv = np.concatenate([rng.integers(0, b * int(xp[-1]) * 2, 2000),
                             (xp.astype(np.int64) * b)[:50], [0, 1, b, b * 2**20]])
        want = st.decode_times(b, kv)
        assert kern.times(b, kv).tobytes() == want.tobytes(), b
    assert core.decode_kernel(make_step_time("roofline", cap, ARGS), 4) is None


@pytest.mark.parametrize("gpu,overlap", [("a100-sxm-80gb", False), ("a100-sxm-80gb", True),
                                         ("h100-sxm-80gb", True)])
def test_the_typed_cores_prefill_kernel_is_the_backends_step_time(gpu, overlap):
    """The typed core computes opdb's prefill-only steps itself (twin/_corec.pyx
    `PrefillKernel`): the backend's own float, bit for bit, for one and several chunks,
    on and between the context grid's points and beyond the measured context; it declines
    exactly where opdb would warn now (beyond the measured context or a table's end, not
    yet warned there), and the backend answers (and warns) there."""
    core = pytest.importorskip("twin._corec", reason="the typed core is not built")
    cap = derive_capacity(ARGS, gpu)
    st = make_step_time("opdb", cap, ARGS)
    inner = st
    st = OverlapStepTime(st) if overlap else st
    kern = core.prefill_kernel(st)
    assert kern is not None
    rng = np.random.default_rng(2)
    grid_n, grid_p = inner._cn_list, inner._cp_list
    declined = computed_beyond = 0
    for _ in range(3000):
        m = int(rng.integers(1, 5))
        chunks = []
        for _c in range(m):
            n = int(rng.choice([rng.integers(1, 9000), rng.choice(grid_n)]))
            pre = int(rng.choice([0, rng.integers(0, 40000), rng.choice(grid_p)]))
            chunks.append((max(n, 1), pre))
        got = kern.step(chunks)
        warned = set(inner._warned)
        beyond = ((any(n + p > inner.extents.context_tokens for n, p in chunks)
                   and "ctx" not in warned)
                  or (sum(n for n, _ in chunks) >= len(inner.tok_ctx)
                      and "step tokens" not in warned)
                  or (m >= len(inner.head) and "lm head" not in warned))
        assert (got is None) is beyond, chunks
        want = st.step_time(chunks, [])  # (warns where beyond: the kernel computes next)
        if got is None:
            declined += 1
            continue
        assert repr(got) == repr(want), chunks
        computed_beyond += any(n + p > inner.extents.context_tokens for n, p in chunks)
    assert 0 < declined < 3000 and computed_beyond > 100
    assert core.prefill_kernel(make_step_time("roofline", cap, ARGS)) is None
