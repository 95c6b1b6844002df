"""The plugin's chunk question (runtime/plugin/chunk.py, hooks.py) without a server.

A scheduling pass is driven as SGLang 0.5.23's `_get_new_batch_prefill_raw` drives it:
`calc_priority` (the plugin's hook), a fresh adder (the plugin's `PrefillAdder` subclass
over a stand-in base with SGLang's method names), `shortest_prefill_chunk_limit` (the
plugin's hook over SGLang's own answer) into `adder.chunked_req_limit`,
`add_chunked_req`, then the admission loop (`budget_state`, `add_one_req`; the batch is
never full here, so `preempt_to_schedule` is called only by the tests). The last test checks the names against SGLang's real classes in the CPU
harness's venv when it is installed.
"""

from __future__ import annotations

import enum
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.plugin import hooks
from twin.policy.base import ChunkPlan, Policy
from twin.policy.registry import PolicySpec, build_policy

pytestmark = pytest.mark.offline

PAGE, BUDGET = 1, 1024
CHUNKED = {"withhold": "none", "chunk_tokens": 512, "park_steps": 2}


class Result(enum.Enum):  # SGLang's AddReqResult names
    CONTINUE = 1
    NO_TOKEN = 2
    OTHER = 3


class Req:
    """The fields of SGLang's `Req` the plugin's views read; hashable by identity."""

    def __init__(self, rid: str, prompt: int, prefix_len: int = 0, out: int = 32) -> None:
        self.rid, self.priority = rid, 0
        self.origin_input_ids = list(range(prompt))
        self.output_ids: list[int] = []
        self.prefix_len = prefix_len
        self.arrival_processed_tokens = 0
        self.sampling_params = SimpleNamespace(max_new_tokens=out, ignore_eos=True)
        self.time_stats = SimpleNamespace(scheduler_recv_time=1.0, wait_queue_entry_time=1.0,
                                          prefill_finished_time=0.0,
                                          last_forward_entry_time=0.0)

    @property
    def full_untruncated_fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


class BaseAdder:
    """SGLang's `PrefillAdder` in miniature: a chunk takes what the limit allows of the
    pass's chunk budget, a request the rest."""

    page_size = 1

    def __init__(self, running_batch) -> None:
        self.running_batch, self.rem_chunk_tokens = running_batch, BUDGET
        self.can_run_list: list = []
        self.preempt_list: list = []
        self.chunked_req_limit = None
        self.chunk_tokens = 0  # what the chunk took this pass

    def add_chunked_req(self, req):
        n = min(len(req.origin_input_ids) - req.prefix_len, self.rem_chunk_tokens,
                self.chunked_req_limit or BUDGET)
        self.chunk_tokens, self.rem_chunk_tokens = n, self.rem_chunk_tokens - n
        self.can_run_list.append(req)
        return req if req.prefix_len + n < len(req.origin_input_ids) else None

    def budget_state(self):
        return Result.OTHER if self.rem_chunk_tokens <= 0 else Result.CONTINUE

    def add_one_req(self, req, has_chunked_req=False, truncation_align_size=None):
        self.can_run_list.append(req)
        self.rem_chunk_tokens -= len(req.origin_input_ids)
        return Result.CONTINUE

    def preempt_to_schedule(self, req) -> bool:
        return True


ADDER = hooks._make_adder_class(BaseAdder, Result)


def runtime(policy, monkeypatch):
    from runtime.plugin.hooks import PluginRuntime

    scheduler = SimpleNamespace(
        new_token_ratio_tracker=SimpleNamespace(current=0.7), max_running_requests=8,
        max_total_num_tokens=100_000, chunked_prefill_size=BUDGET,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 50_000),
        tree_cache=SimpleNamespace(evictable_size=lambda: 0,
                                   supports_fast_match_prefix=lambda: False))
    spec = PolicySpec(policy.name)
    rt = PluginRuntime(spec, policy, {}, "fcfs", False, 1000.0, None, scheduler)
    assert not rt.chunks  # offline the hooks are not in place: never asked by itself
    rt.chunks = True
    monkeypatch.setattr(hooks, "_RUNTIME", rt)
    monkeypatch.setattr(hooks, "COUNTERS", dict.fromkeys(hooks.COUNTERS, 0))
    rt.counters = hooks.COUNTERS
    return rt


def one_pass(chunked: Req, waiting: list, running: list, sglang_limit=None):
    """One pass as SGLang runs it; returns the adder (what it ran is `can_run_list`)."""
    batch = SimpleNamespace(reqs=list(running), is_prefill_only=False)
    hooks._calc_priority_hook(lambda *a, **k: None, None, waiting, batch, processed_tokens=0)
    adder = ADDER(batch)
    adder.chunked_req_limit = hooks._chunk_limit_hook(
        lambda *a: sglang_limit, None, chunked, waiting, adder.rem_chunk_tokens, PAGE)
    adder.add_chunked_req(chunked)
    for req in waiting:
        if adder.budget_state() == Result.OTHER:
            break
        if adder.add_one_req(req, has_chunked_req=True) != Result.CONTINUE:
            break
    return adder


def deadline(**params):
    return build_policy(PolicySpec("deadline", {**CHUNKED, **params}))


def test_parked_passes_admit_nothing_then_the_chunk_runs_capped(monkeypatch):
    rt = runtime(deadline(), monkeypatch)
    doc, short = Req("doc", 6000, prefix_len=1024), Req("q", 64)
    decoding = [Req("d", 64)]
    for _ in range(2):  # park_steps=2: two decode-only passes, nobody admitted
        adder = one_pass(doc, [short], decoding)
        assert adder.can_run_list == [] and adder.chunk_tokens == 0
        assert adder.budget_state() == Result.OTHER and not adder.preempt_to_schedule(short)
        assert adder.add_one_req(short) == Result.OTHER
    adder = one_pass(doc, [short], decoding)  # the chunk runs, capped, beside the question
    assert adder.chunked_req_limit == 512 and adder.chunk_tokens == 512
    assert adder.can_run_list == [doc, short]
    assert (rt.counters["chunk_plans"], rt.counters["parked_passes"]) == (1, 2)
    doc.prefix_len += 512  # the next chunk is a new question: parked again
    assert one_pass(doc, [], decoding).can_run_list == []
    assert (rt.counters["chunk_plans"], rt.counters["parked_passes"]) == (2, 3)


def test_sglang_s_own_smaller_limit_wins_and_an_idle_server_never_parks(monkeypatch):
    rt = runtime(deadline(), monkeypatch)
    doc = Req("doc", 6000, prefix_len=1024)
    adder = one_pass(doc, [Req("q", 64)], [], sglang_limit=256)  # nothing decodes
    assert adder.chunked_req_limit == 256 and adder.can_run_list[0] is doc
    assert rt.counters["parked_passes"] == 0
    # no short question around: SGLang's own chunk (ChunkPlan()), whole budget
    doc.prefix_len += 256
    adder = one_pass(doc, [], [Req("d2", 6000)])
    assert adder.chunked_req_limit is None and adder.chunk_tokens == BUDGET


class Raising(Policy):
    name, chunks = "chunk-raise", True

    def chunk(self, snap, chunked, budget, page_size):
        raise RuntimeError("injected")


class Invalid(Policy):
    name, chunks = "chunk-invalid", True

    def chunk(self, snap, chunked, budget, page_size):
        return ChunkPlan(limit=0, park=3)


@pytest.mark.parametrize("policy,kind", [(Raising(), "raised"), (Invalid(), "invalid")])
def test_a_failing_policy_falls_back_to_sglang_s_chunk_and_is_counted(policy, kind, caplog,
                                                                      monkeypatch):
    rt = runtime(policy, monkeypatch)
    doc, short = Req("doc", 6000, prefix_len=1024), Req("q", 64)
    for _ in range(3):  # asked once for this chunk; no parking, SGLang's own limit
        adder = one_pass(doc, [short], [Req("d", 64)], sglang_limit=700)
        assert adder.chunked_req_limit == 700 and adder.can_run_list == [doc, short]
    assert rt.counters[kind] == 1 and rt.counters["parked_passes"] == 0
    assert rt.counters["chunk_plans"] == 0
    doc.prefix_len += 700
    one_pass(doc, [short], [Req("d", 64)])
    assert rt.counters[kind] == 2  # counted again, logged once
    assert sum(f"{kind} at chunk" in m for m in caplog.messages) <= 1


def test_a_park_not_taken_in_its_pass_cannot_leak_into_a_later_one(monkeypatch):
    rt = runtime(deadline(park_steps=5), monkeypatch)
    doc = Req("doc", 6000, prefix_len=1024)
    batch = SimpleNamespace(reqs=[Req("d", 64)], is_prefill_only=False)
    hooks._calc_priority_hook(lambda *a, **k: None, None, [], batch, processed_tokens=0)
    hooks._chunk_limit_hook(lambda *a: None, None, doc, [], BUDGET, PAGE)
    assert rt.pass_park is not None  # this pass would park, but SGLang's own adder ran
    hooks._calc_priority_hook(lambda *a, **k: None, None, [], batch, processed_tokens=0)
    assert rt.pass_park is None and not rt.take_park()  # the next pass starts clean
    assert rt.counters["parked_passes"] == 0


class MailboxLink(hooks.RankLink):
    """A `RankLink` whose broadcast is a shared list: rank 0's values, read by rank 1."""

    def __init__(self, tp_rank: int, box: list) -> None:
        self.tp_rank, self.src, self.box = tp_rank, 0, box

    def _share(self, values, size):
        if self.leader:
            self.box.append(None if values is None else list(values))
        return self.box[-1]


@pytest.mark.parametrize("leader_policy", [deadline(), Raising()])
def test_at_tp_2_every_rank_parks_and_caps_as_rank_0_answers(leader_policy, monkeypatch):
    box: list = []
    ranks = []
    for rank, policy in ((0, leader_policy), (1, Raising())):  # rank 1's own never asked
        rt = runtime(policy, monkeypatch)
        rt.link = MailboxLink(rank, box)
        ranks.append(rt)
    seen = []
    for step in range(4):  # every rank runs each pass in turn, over its own Req objects
        got = []
        for rt in ranks:
            monkeypatch.setattr(hooks, "_RUNTIME", rt)
            doc = getattr(rt, "doc", None) or Req("doc", 6000, prefix_len=1024)
            rt.doc = doc
            adder = one_pass(doc, [Req("q", 64)], [Req("d", 64)])
            got.append((adder.chunked_req_limit, [r.rid for r in adder.can_run_list]))
        assert got[0] == got[1], step
        seen.append(got[0])
    if isinstance(leader_policy, Raising):  # rank 0 failed: SGLang's own chunk everywhere
        assert box == [None] and all(s == (None, ["doc"]) for s in seen)  # a whole chunk
    else:  # parked twice, then the capped chunk beside the question, on both ranks
        assert box == [[512, 2]]
        assert seen[:3] == [(None, []), (None, []), (512, ["doc", "q"])]
        assert [rt.counters["parked_passes"] for rt in ranks] == [2, 2]
        assert [rt.counters["chunk_plans"] for rt in ranks] == [1, 1]
    assert ranks[1].counters["raised"] == 0  # a follower never asks its own policy


class CuttingAdder(BaseAdder):
    """`BaseAdder` whose `add_one_req` cuts a request longer than the budget left, as
    SGLang's does (`trunc_len = rem_chunk_tokens`, `new_chunked_req`)."""

    new_chunked_req = None

    def add_one_req(self, req, has_chunked_req=False, truncation_align_size=None):
        n = len(req.full_untruncated_fill_ids) - req.prefix_len
        take = min(n, self.rem_chunk_tokens)
        if take < n:
            self.new_chunked_req = req
        self.can_run_list.append((req.rid, take))
        self.rem_chunk_tokens -= take
        return self.budget_state()


CUTTER = hooks._make_adder_class(CuttingAdder, Result)


def admission(waiting: list, running: list):
    """A pass with no chunked request: `calc_priority`, then the admission loop."""
    batch = SimpleNamespace(reqs=list(running), is_prefill_only=False)
    hooks._calc_priority_hook(lambda *a, **k: None, None, waiting, batch, processed_tokens=0)
    adder = CUTTER(batch)
    for req in waiting:
        if adder.budget_state() == Result.OTHER:
            break
        if adder.add_one_req(req) != Result.CONTINUE:
            break
    return adder


def test_a_first_chunk_is_capped_beside_a_short_question_and_the_pass_ends(monkeypatch):
    rt = runtime(deadline(), monkeypatch)
    short, doc, other_doc = Req("q", 64), Req("doc", 6000), Req("doc-b", 5000)
    adder = admission([doc, short, other_doc], [Req("d", 64)])
    # the question whole (deadline's order: short questions first), the document's first
    # chunk at the answer's 512 (SGLang would give it the 960 left), and the pass ends
    # there: the other document is not reached
    assert adder.can_run_list == [("q", 64), ("doc", 512)]
    assert adder.new_chunked_req is doc and adder.budget_state() == Result.OTHER
    assert (rt.counters["first_chunks_capped"], rt.counters["chunk_plans"]) == (1, 1)
    # documents only: the answer is SGLang's own chunk (nobody to shield), not asked to cap
    adder = admission([Req("doc2", 6000)], [Req("d3", 6000)])
    assert adder.can_run_list == [("doc2", BUDGET)]
    assert rt.counters["first_chunks_capped"] == 1
    # a request that fits whole is never asked
    admission([Req("q3", 900)], [Req("d", 64)])
    assert rt.counters["chunk_plans"] == 2


@pytest.mark.parametrize("policy,kind", [(Raising(), "raised"), (Invalid(), "invalid")])
def test_a_failing_first_chunk_answer_is_sglang_s_own_cut(policy, kind, monkeypatch):
    rt = runtime(policy, monkeypatch)
    adder = admission([Req("doc", 6000)], [Req("d", 64)])  # one waiting: no sort to skip
    assert adder.can_run_list == [("doc", BUDGET)]
    assert rt.counters[kind] == 1 and rt.counters["first_chunks_capped"] == 0


def test_chunk_answers_are_logged_and_replay_identically_in_the_twin(tmp_path, monkeypatch):
    from runtime.plugin.decisions import policy_from_header, read_lines, replay

    spec = PolicySpec("deadline", CHUNKED)
    rt = runtime(build_policy(spec), monkeypatch)
    log = tmp_path / "decisions.jsonl"
    logged = hooks.PluginRuntime(spec, rt.policy, {}, "fcfs", False, 1000.0, str(log),
                                 rt.scheduler)
    logged.chunks, logged.counters = True, rt.counters
    monkeypatch.setattr(hooks, "_RUNTIME", logged)
    admission([Req("q", 64), Req("doc", 6000)], [Req("d", 64)])  # a first chunk, capped
    doc = Req("doc", 6000, prefix_len=512)
    for _ in range(3):  # its next chunk: asked once, parked twice, then run
        one_pass(doc, [Req("q2", 32)], [Req("d", 64)])
    lines = list(read_lines(log))
    chunk = [d for d in lines if d.get("question") == "chunk"]
    assert [(d["first"], d["plan"], d["outcome"]) for d in chunk] == [
        (True, {"limit": 512, "park": 2}, "applied"),
        (False, {"limit": 512, "park": 2}, "applied")]
    assert chunk[0]["chunked"]["rid"] == "doc" and chunk[0]["budget"] == BUDGET
    result = replay(lines, policy_from_header(lines[0]))
    assert result.share == 1.0 and result.decisions >= 2, result
    # a twin policy that answers otherwise is caught
    other = build_policy(PolicySpec("deadline", {**CHUNKED, "chunk_tokens": 256}))
    assert replay(lines, other).disagreements[0][1] == "chunk"


@pytest.mark.parametrize("leader_policy", [deadline(), Raising()])
def test_at_tp_2_every_rank_caps_a_first_chunk_as_rank_0_answers(leader_policy, monkeypatch):
    box: list = []
    got = []
    for rank, policy in ((0, leader_policy), (1, Raising())):  # rank 1's own never asked
        rt = runtime(policy, monkeypatch)
        rt.link = MailboxLink(rank, box)
        adder = admission([Req("doc", 6000)], [Req("d", 64)])
        got.append(adder.can_run_list)
        assert rt.counters["raised"] == (1 if rank == 0 and isinstance(policy, Raising)
                                         else 0)
    assert got[0] == got[1]
    assert got[0] == [("doc", 512 if box == [[512, 2]] else BUDGET)]
    assert box in ([[512, 2]], [None])


HARNESS_PY = Path(os.environ.get("SERVETWIN_SGLANG_ENV",
                                 Path.home() / ".cache/servetwin/sglang-cpu")) / "bin/python"
REAL_CHECK = """
import inspect
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from runtime.plugin import hooks
sig = list(inspect.signature(SchedulePolicy.shortest_prefill_chunk_limit).parameters)[1:]
ours = list(inspect.signature(hooks._chunk_limit_hook).parameters)[2:]  # original, self
assert sig == ours, (sig, ours)
cls = hooks._make_adder_class(PrefillAdder)
for name in ("add_chunked_req", "budget_state", "add_one_req", "preempt_to_schedule"):
    assert name in vars(PrefillAdder), name
# a first chunk's cut is the pass's rem_chunk_tokens (what the plugin lowers to cap it)
src = inspect.getsource(PrefillAdder._select_prefill_admission)
assert "chunk_limit = self.rem_chunk_tokens" in src, src[:200]
adder = object.__new__(cls)  # a parked adder answers before SGLang's own code runs
adder._servetwin_parked = True
assert adder.budget_state() is AddReqResult.OTHER and adder.preempt_to_schedule(None) is False
print("ok")
"""


def test_the_hooks_fit_sglang_s_real_classes():
    if not HARNESS_PY.is_file():
        pytest.skip("the CPU SGLang harness is not installed (servetwin live install-cpu)")
    env = {**os.environ, "SERVETWIN_CPU_HARNESS": "1", "SGLANG_USE_CPU_ENGINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([str(HARNESS_PY), "-c", REAL_CHECK], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_no_second_request_is_cut_while_a_capped_chunk_continues(monkeypatch):
    # SGLang tracks one unfinished chunked request (get_new_batch_prefill asserts it):
    # after the doc's capped 512-token chunk, 512 tokens of budget are left; a second
    # document that would be cut there gets OTHER, a question that fits whole goes in
    runtime(deadline(park_steps=0), monkeypatch)
    doc, doc2, short = Req("doc", 6000, prefix_len=1024), Req("doc2", 5000), Req("q", 64)
    adder = one_pass(doc, [short, doc2], [Req("d", 64)])
    assert adder.chunk_tokens == 512 and adder.can_run_list == [doc, short]
    assert adder.add_one_req(doc2) == Result.OTHER
    assert adder.add_one_req(Req("q2", 400)) == Result.CONTINUE  # 448 left: fits whole
