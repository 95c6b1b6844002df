"""Records streamed to disk (twin/record_sink.py): the same bytes as the in-memory path for
any chunk size, only a chunk of finished requests alive at a time, and nothing left
behind or half-written when a run or its final merge is interrupted."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
from pathlib import Path

import pytest
from helpers import GPU, MODEL, req
from record_digests import RUNS, run_digests, stored
from test_fleet import CRASH, FAST_HEALTH, stream
from test_fleet import build as fleet_build

from servetwin.cli import main
from twin.config import ServerArgs
from twin.fleet import run_deployment
from twin.metrics import read_records
from twin.request_state import SimRequest
from twin.sim import SimConfig, simulate
from twin.workload import from_spec

pytestmark = pytest.mark.offline

STORED = stored()
SPEC = "arrival=poisson,rate=6,n=160,prompt=uniform:100:3000,output=uniform:1:200"
CFG = SimConfig(args=ServerArgs(model_path=MODEL), gpu=GPU, step_time_backend="roofline")


def _lines(res) -> list[str]:
    return [json.dumps(r, separators=(",", ":")) for r in res.records]


@pytest.mark.parametrize("name", [n for n in RUNS if n != "fleet"])
def test_stored_digests_hold_with_tiny_chunks(name: str, monkeypatch) -> None:
    """Every pinned run, spilled every 7 requests, writes the stored bytes."""
    import record_digests

    monkeypatch.setitem(record_digests.RUNS, name, [*RUNS[name], "--record-chunk", "7"])
    got = run_digests(name)
    assert {f: got.get(f) for f in STORED[name]} == STORED[name]


@pytest.mark.parametrize("chunk", [1, 13, 10_000])
def test_streamed_run_equals_the_in_memory_one(tmp_path: Path, chunk: int) -> None:
    w = from_spec(SPEC, seed=2)
    mem = simulate(w, CFG)
    res = simulate(w, CFG, out=tmp_path, record_chunk=chunk)
    text = (tmp_path / "requests.jsonl").read_text()
    assert text == "".join(line + "\n" for line in _lines(mem))
    assert res.summary == mem.summary
    assert list(res.records) == list(mem.records) and len(res.records) == len(w.requests)
    summary_only = simulate(w, CFG, keep_records=False, record_chunk=chunk)
    assert summary_only.summary == mem.summary
    assert sorted(os.listdir(tmp_path)) == ["requests.jsonl"]  # no spill left behind


def _stop_after(n: int):
    def progress(done: int, _t: float) -> None:
        if done >= n:
            raise KeyboardInterrupt
    return progress


def test_ctrl_c_streamed_equals_in_memory(tmp_path: Path) -> None:
    """A Ctrl-C mid-run: every request once (finished ones as they ended, the rest
    aborted), in the same order and bytes as the in-memory path; the summary alike."""
    w = from_spec(SPEC, seed=4)
    mem = simulate(w, CFG, progress=_stop_after(60))
    res = simulate(w, CFG, progress=_stop_after(60), out=tmp_path, record_chunk=9)
    assert mem.interrupted and res.interrupted == mem.interrupted
    got = read_records(tmp_path / "requests.jsonl")
    assert got == list(mem.records) and len(got) == len(w.requests)
    assert 0 < sum(r["status"] == "ok" for r in got) < len(got)
    assert res.summary == mem.summary and res.summary["partial"]["unfinished"] > 0


def test_only_a_chunk_of_finished_requests_is_alive(tmp_path: Path) -> None:
    """Neither the replica nor the deployment keeps a finished request beyond its chunk."""
    w = from_spec(SPEC, seed=5)
    mine = {id(r) for r in w.requests}

    def finished_alive() -> int:
        return sum(isinstance(o, SimRequest) and bool(o.status) and id(o.req) in mine
                   for o in gc.get_objects())

    gc.collect()
    most: list[int] = []
    simulate(w, CFG, progress=lambda d, t: most.append(finished_alive()), out=tmp_path,
             record_chunk=10)
    assert most and max(most) < 10
    kept: list[int] = []
    simulate(w, CFG, progress=lambda d, t: kept.append(finished_alive()))
    assert max(kept) > 100  # the in-memory path holds them all: the check can fail


IN_ORDER = "arrival=poisson,rate=2,n=90,prompt=fixed:300,output=fixed:12"  # FCFS leaves in order


def test_a_spill_in_order_becomes_the_file(tmp_path: Path, monkeypatch) -> None:
    """Requests that leave in the records' order: the spill is linked into place, nothing
    copied (the merge's copies fail here), the same bytes, nothing else left behind."""
    import twin.record_sink as rs

    w = from_spec(IN_ORDER, seed=3)
    mem = simulate(w, CFG)

    def no_copy(*a, **k):
        raise AssertionError("the spill was copied")

    monkeypatch.setattr(rs, "_copy_span", no_copy)
    monkeypatch.setattr(rs._Gatherer, "__init__", no_copy)
    res = simulate(w, CFG, out=tmp_path, record_chunk=7)
    assert (tmp_path / "requests.jsonl").read_text() == "".join(
        line + "\n" for line in _lines(mem))
    assert res.summary == mem.summary
    assert os.listdir(tmp_path) == ["requests.jsonl"]
    assert oct(os.stat(tmp_path / "requests.jsonl").st_mode & 0o777) == "0o600"  # as mkstemp's


def test_out_of_order_chunks_and_an_unlinkable_spill_are_merged(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """Requests leaving far out of order (a chunk holds back at most half of itself: then
    it spills all), and a system without O_TMPFILE (the spill cannot be given a name):
    merged, the same bytes."""
    w = from_spec(SPEC, seed=2)
    want = "".join(line + "\n" for line in _lines(simulate(w, CFG)))
    simulate(w, CFG, out=tmp_path, record_chunk=3)
    assert (tmp_path / "requests.jsonl").read_text() == want
    import tempfile

    import twin.record_sink as rs

    monkeypatch.setattr(rs, "_unnamed_file", lambda where: tempfile.TemporaryFile(dir=where))
    simulate(from_spec(IN_ORDER, seed=3), CFG, out=tmp_path, record_chunk=7)
    simulate(w, CFG, out=tmp_path, record_chunk=7)
    assert (tmp_path / "requests.jsonl").read_text() == want
    assert os.listdir(tmp_path) == ["requests.jsonl"]


def test_interrupted_publish_leaves_the_old_file(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C as the spill is renamed into place: the old requests.jsonl stays whole, the
    spill's temporary name is gone."""
    old = tmp_path / "requests.jsonl"
    old.write_text('{"old": true}\n')

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        simulate(from_spec(IN_ORDER, seed=3), CFG, out=tmp_path, record_chunk=7)
    assert old.read_text() == '{"old": true}\n'
    assert os.listdir(tmp_path) == ["requests.jsonl"]


def test_interrupted_merge_leaves_the_old_file(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C while the chunks are merged: the old requests.jsonl stays whole, nothing else
    is left in the directory."""
    import twin.record_sink as rs

    monkeypatch.setattr(rs, "_publish", lambda fd, path: False)  # (the merge, always)
    old = tmp_path / "requests.jsonl"
    old.write_text('{"old": true}\n')
    calls = []

    def interrupting(real):  # the merge's first read, copy or write is interrupted
        def call(*a):
            calls.append(a)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return real(*a)
        return call

    merge = rs.RecordSink._merge

    def merging(self, *a):  # (the spill's own writes before it go through)
        monkeypatch.setattr(os, "pread", interrupting(os.pread))
        monkeypatch.setattr(os, "write", interrupting(os.write))  # (short spans: gathered)
        if hasattr(os, "copy_file_range"):
            monkeypatch.setattr(os, "copy_file_range", interrupting(os.copy_file_range))
        return merge(self, *a)

    monkeypatch.setattr(rs.RecordSink, "_merge", merging)
    with pytest.raises(KeyboardInterrupt):
        simulate(from_spec(SPEC, seed=2), CFG, out=tmp_path, record_chunk=5)
    assert old.read_text() == '{"old": true}\n'
    assert os.listdir(tmp_path) == ["requests.jsonl"]


@pytest.mark.parametrize("refusal", ["raises", "copies nothing", "absent"])
def test_the_merge_without_in_kernel_copies_writes_the_same_bytes(tmp_path: Path, monkeypatch,
                                                                  refusal) -> None:
    """A file system without `copy_file_range` (it raises, or copies nothing), or a
    platform without it: the merge copies through Python, the same bytes."""
    import errno

    import twin.record_sink as rs

    monkeypatch.setattr(rs, "_publish", lambda fd, path: False)  # (the merge, always)

    want = tmp_path / "want"
    want.mkdir()
    simulate(from_spec(SPEC, seed=2), CFG, out=want, record_chunk=5)
    if refusal == "absent":
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    else:
        def refuse(*a):
            if refusal == "raises":
                raise OSError(errno.EXDEV, "cross-device")
            return 0
        monkeypatch.setattr(os, "copy_file_range", refuse)
    got = tmp_path / "got"
    got.mkdir()
    simulate(from_spec(SPEC, seed=2), CFG, out=got, record_chunk=5)
    assert (got / "requests.jsonl").read_bytes() == (want / "requests.jsonl").read_bytes()


def test_record_chunk_flag_is_checked(capsys) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["simulate", "--workload", SPEC, "--record-chunk", "0"])
    assert rc == 2
    assert "--record-chunk 0: must be" in capsys.readouterr().err


def test_summary_only_cli_run_matches_the_written_summary(tmp_path: Path) -> None:
    """Without --out the CLI keeps no records, yet prints the summary --out writes."""
    args = ["simulate", "--model-path", MODEL, "--gpu", GPU, "--step-time-backend",
            "roofline", "--workload", SPEC, "--json"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*args, "--out", str(tmp_path), "--record-chunk", "3"]) == 0
    assert json.loads(buf.getvalue()) == json.loads((tmp_path / "summary.json").read_text())


# ---- fleets (twin/record_sink_fleet.py) ------------------------------------------------
FLEETS = {  # test_fleet.py's small deployments: faults, retries, vLLM, pools, a horizon
    "crash+retry": dict(faults=CRASH, streaming=False, **FAST_HEALTH),
    "crash+streaming": dict(faults=CRASH, streaming=True, **FAST_HEALTH),
    "vllm+length-pools": dict(router="length", engines=("sglang", "vllm", "sglang", "vllm")),
    "horizon": dict(horizon=9.0),
}


def by_dicts(monkeypatch, build):
    """A fleet run kept in memory the reference way: `Deployment.records` and `summarize`
    over the dicts (not the columns twin/fleet.py's in-memory path summarises from)."""
    import twin.fleet

    with monkeypatch.context() as m:
        m.setattr(twin.fleet, "IN_MEMORY_COLUMNS", False)
        return run_deployment(build())


@pytest.mark.parametrize("name", list(FLEETS))
@pytest.mark.parametrize("chunk", [1, 4])
def test_fleet_streamed_equals_in_memory(tmp_path: Path, name: str, chunk: int,
                                         monkeypatch) -> None:
    mixed = [req(f"q{i:02d}", i * 0.3, 100 + 300 * (i % 2), 6 + i % 5) for i in range(40)]
    mem = by_dicts(monkeypatch, lambda: fleet_build(mixed, **FLEETS[name]))
    cols = run_deployment(fleet_build(mixed, **FLEETS[name]))
    assert type(cols.records).__name__ == "FleetList" and type(mem.records) is list
    assert list(cols.records) == mem.records and cols.summary == mem.summary
    res = run_deployment(fleet_build(mixed, **FLEETS[name]), out=tmp_path, record_chunk=chunk)
    text = (tmp_path / "requests.jsonl").read_text()
    assert text == "".join(line + "\n" for line in _lines(mem)) and len(res.records) == 40
    assert res.summary == mem.summary
    # the case does what it is named for: retries, failures or aborts; both engines
    assert any(r["attempts"] > 1 or r["status"] != "ok" for r in mem.records) or \
        {r["replica"] for r in mem.records} == {"r0", "r1", "r2", "r3"}


def test_fleet_ctrl_c_streamed_equals_in_memory(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C in a fleet: the rewritten errors of the requests it gave up, in every path."""
    def build_stopped():
        dep = fleet_build(stream(n=40, gap=0.3))
        stop = dep.env.timeout(4.0)
        stop.callbacks.append(lambda _: (_ for _ in ()).throw(KeyboardInterrupt()))
        return dep

    mem = by_dicts(monkeypatch, build_stopped)
    cols = run_deployment(build_stopped())
    assert list(cols.records) == mem.records and cols.summary == mem.summary
    res = run_deployment(build_stopped(), out=tmp_path, record_chunk=3)
    assert mem.interrupted and res.interrupted == mem.interrupted
    assert read_records(tmp_path / "requests.jsonl") == list(mem.records)
    assert any("interrupted (Ctrl-C)" in (r["error"] or "") for r in mem.records)
    assert res.summary == mem.summary


def test_fleet_digest_holds_with_tiny_chunks(monkeypatch) -> None:
    import record_digests

    monkeypatch.setitem(record_digests.RUNS, "fleet", [*RUNS["fleet"], "--record-chunk", "7"])
    got = run_digests("fleet")
    assert {f: got.get(f) for f in STORED["fleet"]} == STORED["fleet"]


@pytest.mark.parametrize("refused", [False, True])
def test_the_spill_writes_the_bytes_it_is_given(tmp_path: Path, monkeypatch, refused) -> None:
    """The spill's writer (twin/outputs.py `BlockWriter`: whole blocks around the page cache where the file
    system takes O_DIRECT) leaves exactly the bytes written, in order, with `tell` at
    each write's end; a file system that refuses O_DIRECT at the first write (EINVAL)
    gets the same bytes through the page cache."""
    import errno

    import numpy as np

    import twin.outputs as out
    import twin.record_sink as rs

    monkeypatch.setattr(out, "_STAGE", 3 * out._BLOCK)  # many drains, tails carried over
    if refused:
        write = os.write

        def refusing(fd, data):
            import fcntl

            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return write(fd, data)

        monkeypatch.setattr(os, "write", refusing)
    spill = rs._unnamed_file(tmp_path)
    rng = np.random.default_rng(5)
    want = bytearray()
    for size in [0, 1, 4095, 4096, 4097, 12288, 30000, 7, 1 << 14, 5]:
        data = rng.integers(32, 127, size, dtype=np.uint8).tobytes()
        spill.write(data)
        want += data
        assert spill.tell() == len(want)
    spill.flush()
    assert not spill.direct  # (read as usual from here on)
    assert os.pread(spill.fileno(), len(want) + 10, 0) == bytes(want)
    spill.write(b"more")
    spill.flush()
    assert os.pread(spill.fileno(), len(want) + 10, 0) == bytes(want) + b"more"
    spill.close()
    assert os.listdir(tmp_path) == []
