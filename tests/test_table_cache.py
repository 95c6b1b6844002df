"""The opdb tables' disk cache (twin/perf/table_cache.py): a hit gives the same step times
as a build, a changed key or a corrupt file rebuilds, and nothing is pickled."""

from __future__ import annotations

import numpy as np
import pytest

from twin.config import ServerArgs, derive_capacity
from twin.perf import default_backend, default_step_time, table_cache
from twin.perf import opdb as opdb_mod
from twin.perf.opdb import OpdbStepTime

pytestmark = pytest.mark.offline

ARGS = ServerArgs(model_path="meta-llama/Llama-3.1-8B", context_length=4096)
BATCHES = [([], [100]), ([], [3000] * 7), ([], [50] * 300), ([(512, 0)], []),
           ([(300, 2048), (17, 0)], [900, 1200]), ([(4096, 0)], [10] * 64)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(table_cache.ENV, str(tmp_path))
    return tmp_path / "opdb"


@pytest.fixture(scope="module")
def cap():
    return derive_capacity(ARGS, "a100-sxm-80gb")


def _times(st) -> list[float]:
    out = [st.step_time(p, d) for p, d in BATCHES]
    out += st.decode_times(5, np.array([10.0, 5000.0, 20000.0])).tolist()
    return out


def test_a_hit_gives_the_same_step_times_as_the_build(cache, cap):
    built = OpdbStepTime(cap, ARGS)
    assert not built.from_cache
    assert len(list(cache.glob("*.npz"))) == 1
    hit = OpdbStepTime(cap, ARGS)
    assert hit.from_cache
    assert _times(hit) == _times(built)
    assert hit.describe() == built.describe()
    assert hit.extents == built.extents
    for a, b in ((hit.ctx_table, built.ctx_table), (hit.dec_table, built.dec_table),
                 (hit.tok_ctx, built.tok_ctx), (hit.head, built.head)):
        assert np.array_equal(a, b)


def test_the_entry_holds_no_pickled_objects(cache, cap):
    OpdbStepTime(cap, ARGS)
    (path,) = cache.glob("*.npz")
    with np.load(path, allow_pickle=False) as z:  # raises on any object array
        assert all(z[name].dtype != object for name in z.files)


def test_a_changed_key_rebuilds(cache, cap, monkeypatch):
    OpdbStepTime(cap, ARGS)
    monkeypatch.setattr(opdb_mod, "_version",
                        lambda module: "0.0-other" if module == "aiconfigurator_core" else None)
    other = OpdbStepTime(cap, ARGS)
    assert not other.from_cache
    assert len(list(cache.glob("*.npz"))) == 2
    smaller = derive_capacity(ServerArgs(model_path="meta-llama/Llama-3.1-8B",
                                         context_length=2048), "a100-sxm-80gb")
    assert not OpdbStepTime(smaller, ARGS).from_cache


def test_a_corrupt_or_foreign_entry_is_rebuilt_not_trusted(cache, cap):
    good = OpdbStepTime(cap, ARGS)
    (path,) = cache.glob("*.npz")
    path.write_bytes(b"not a zip file")
    again = OpdbStepTime(cap, ARGS)
    assert not again.from_cache and _times(again) == _times(good)
    assert OpdbStepTime(cap, ARGS).from_cache  # the rebuild replaced it
    # an entry whose stored key is another's (a hash clash, a hand-copied file)
    with np.load(path, allow_pickle=False) as z:
        arrays = {n: z[n] for n in z.files}
    arrays["__key__"] = np.array("{}")
    with path.open("wb") as fh:
        np.savez(fh, **arrays)
    assert not OpdbStepTime(cap, ARGS).from_cache


def test_cache_off_builds_every_time(tmp_path, monkeypatch, cap):
    monkeypatch.setenv(table_cache.ENV, "off")
    assert table_cache.cache_dir("opdb") is None
    assert not OpdbStepTime(cap, ARGS).from_cache
    assert not OpdbStepTime(cap, ARGS).from_cache


def test_default_step_time_picks_what_default_backend_names(cache):
    for args, gpu in ((ARGS, "a100-sxm-80gb"), (ARGS, "a100-pcie-80gb"),
                      (ServerArgs(model_path="meta-llama/Llama-3.1-8B", context_length=4096,
                                  kv_cache_dtype="fp8_e4m3"), "a100-sxm-80gb")):
        c = derive_capacity(args, gpu)
        assert default_step_time(c, args).name == default_backend(c)


def test_concurrent_writers_leave_one_whole_entry(cache):
    import threading

    key = {"what": "concurrent"}
    arrays = {"a": np.arange(100_000, dtype=float), "b": np.array(["x", "yz"])}
    seen = []

    def write_then_read():
        table_cache.store("opdb", key, arrays)
        seen.append(table_cache.load("opdb", key))

    threads = [threading.Thread(target=write_then_read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.suffix for p in cache.iterdir()] == [".npz"]  # no temporary file left
    for got in seen:
        assert got is not None and np.array_equal(got["a"], arrays["a"])
        assert got["b"].tolist() == ["x", "yz"]
