"""The chunk question (twin/policy/base.py `Policy.chunk` -> `ChunkPlan`), pinned by
hand-worked timelines in the twin, and the policies that answer it.

A document prefilled in chunks stalls every running short question for its whole prefill
(SGLang builds a prefill batch, if it can, before any decode). A policy that answers the
chunk question caps the document's next chunk and asks for decode-only passes before it.
"""

from __future__ import annotations

import json

import pytest
from helpers import bias_selector, req, run_replica
from stepmodels import FixedStepTime

from experiments.rl.config import preset
from experiments.rl.evaluate import heuristic_specs
from twin.errors import ServetwinError
from twin.policy.base import ChunkPlan, Policy, RequestView, Snapshot
from twin.policy.check import PolicyContractError, check_policy, validate_chunk_plan
from twin.policy.deadline import DeadlinePolicy
from twin.policy.menu import check_menu, menu_entry
from twin.policy.registry import register

pytestmark = pytest.mark.offline


def spec_file(tmp_path, name="deadline", **params) -> str:
    p = tmp_path / "policy.json"
    p.write_text(json.dumps({"name": name, "params": params}))
    return str(p)


def run(tmp_path, reqs, policy=None, **params):
    pol = spec_file(tmp_path, **params) if policy is None else policy
    return run_replica(reqs, FixedStepTime(2.0, 1.0), policy=pol, chunked_prefill_size=1000,
                       max_total_tokens=20_000)


# S: a short question (10 prompt tokens, 20 out); D: a 5,000-token document, 1,000-token
# chunks (doc_tokens 4096 tells them apart). Steps: prefill 2 s, decode 1 s.
SHORT_AND_DOC = [req("S", 0.0, 10, 20), req("D", 0.5, 5000, 2)]


def test_a_parked_chunk_lets_the_short_question_decode_between_capped_chunks(tmp_path):
    # S prefills 0-2 (its first token). D arrives at 0.5 and is admitted at 2 while S
    # runs: admission would cut it, so the question is asked of its first chunk too, and
    # the answer caps it at 400 tokens (2-4; a first chunk is never parked: D is not
    # running yet). At 4 its next chunk is due while S decodes: 400 tokens after 3
    # decode-only passes, so S decodes 4-7 and D's chunk runs 7-9; so on. S needs 19
    # decode steps: 3+3+3+3+3+3 by 32, then 1 at 34-35 (the last plan's park ends early:
    # S finished, nothing decodes, and the 400-token chunk runs at 35). Then D alone:
    # SGLang's full chunks, 1,000 at 37 and the last 800 at 39 (D's TTFT 41 - 0.5).
    rep, recs = run(tmp_path, SHORT_AND_DOC, withhold="none", chunk_tokens=400,
                    park_steps=3)
    log = rep.step_log
    assert log[:5] == [("prefill", 0, [("S", 10)], []),
                       ("prefill", 2.0, [("D", 400)], []),
                       ("decode", 4.0, ["S"], 3),
                       ("prefill", 7.0, [("D", 400)], []),
                       ("decode", 9.0, ["S"], 3)]
    assert log[14:] == [("decode", 34.0, ["S"], 1),
                        ("prefill", 35.0, [("D", 400)], []),
                        ("prefill", 37.0, [("D", 1000)], []),
                        ("prefill", 39.0, [("D", 800)], []),
                        ("decode", 41.0, ["D"], 1)]
    assert (recs["S"]["status"], recs["D"]["status"]) == ("ok", "ok")
    assert recs["S"]["e2e_s"] == 35.0
    assert recs["D"]["ttft_s"] == 40.5


def test_a_first_chunk_admitted_beside_a_short_question_is_capped(tmp_path):
    # R prefills 0-2; S and D arrive during it. The pass at 2 admits S whole (short
    # questions first) and then would cut D into its first chunk: the question is asked
    # and the cap spends the pass's budget (990 left -> 400, then nobody else).
    rep, _ = run(tmp_path, [req("R", 0.0, 10, 20), req("S", 1.0, 10, 20),
                            req("D", 1.5, 5000, 2)],
                 withhold="none", chunk_tokens=400, park_steps=3)
    assert rep.step_log[:2] == [("prefill", 0, [("R", 10)], []),
                                ("prefill", 2.0, [("S", 10), ("D", 400)], [])]
    # without an answer, the same pass gives D the rest of SGLang's budget
    rep, _ = run(tmp_path, [req("R", 0.0, 10, 20), req("S", 1.0, 10, 20),
                            req("D", 1.5, 5000, 2)], withhold="none")
    assert rep.step_log[1] == ("prefill", 2.0, [("S", 10), ("D", 990)], [])


def test_without_a_chunk_answer_the_document_stalls_the_short_question(tmp_path):
    # The same requests under plain deadline: D's five 1,000-token chunks run 2-12 back
    # to back; S decodes only after them (SGLang's prefill-first loop).
    rep, recs = run(tmp_path, SHORT_AND_DOC, withhold="none")
    assert [e[:3] for e in rep.step_log[:6]] == [
        ("prefill", 0, [("S", 10)]), ("prefill", 2.0, [("D", 1000)]),
        ("prefill", 4.0, [("D", 1000)]), ("prefill", 6.0, [("D", 1000)]),
        ("prefill", 8.0, [("D", 1000)]), ("prefill", 10.0, [("D", 1000)])]
    assert recs["S"]["e2e_s"] == 31.0  # its 19 decode steps from 12 on, beside D's
    assert recs["D"]["ttft_s"] == 11.5


def test_a_chunk_is_never_parked_on_an_idle_server(tmp_path):
    # D alone: nothing decodes, so the answer neither parks nor caps (no short question
    # waits or runs): SGLang's 1,000-token chunks back to back.
    rep, recs = run(tmp_path, [req("D", 0.0, 5000, 2)], withhold="none",
                    chunk_tokens=400, park_steps=3)
    assert [e[:3] for e in rep.step_log] == [
        ("prefill", 2.0 * i, [("D", 1000)]) for i in range(5)] + [("decode", 10.0, ["D"])]
    assert recs["D"]["ttft_s"] == 10.0


def test_the_records_are_the_same_twice_and_every_request_comes_out_once(tmp_path):
    reqs = [req(f"q{i}", 0.3 * i, 10 + 7 * i, 15) for i in range(12)] + [
        req("D1", 0.4, 6000, 3), req("D2", 1.1, 9000, 4)]
    a = run(tmp_path, reqs, withhold="hopeless", chunk_tokens=256, park_steps=4)[1]
    b = run(tmp_path, reqs, withhold="hopeless", chunk_tokens=256, park_steps=4)[1]
    assert a == b
    assert sorted(a) == sorted(r.rid for r in reqs)
    assert {r["status"] for r in a.values()} == {"ok"}


class _BadChunks(Policy):
    name = "test-bad-chunks"
    chunks = True

    def chunk(self, snap, chunked, budget, page_size):
        return ChunkPlan(limit=0)


@pytest.fixture
def bad_chunks_registered():
    """Registered for this test only: other tests walk every registered policy."""
    from twin.policy import registry

    register(_BadChunks)
    yield
    del registry._REGISTRY[_BadChunks.name]


def test_a_wrong_chunk_answer_is_a_contract_error_naming_the_field(tmp_path,
                                                                   bad_chunks_registered):
    with pytest.raises(ServetwinError, match=r"chunk question: chunk limit 0: must be None "
                                             r"or an integer >= the page size 1"):
        run(tmp_path, SHORT_AND_DOC, policy="test-bad-chunks")
    with pytest.raises(PolicyContractError, match="chunk limit 0"):
        check_policy(_BadChunks())


def test_validate_chunk_plan_names_what_is_wrong():
    assert validate_chunk_plan(ChunkPlan(), 1) is None
    assert validate_chunk_plan(ChunkPlan(limit=64, park=256), 16) is None
    assert "page size 16" in validate_chunk_plan(ChunkPlan(limit=8), 16)
    assert "0..256" in validate_chunk_plan(ChunkPlan(park=257), 1)
    assert "0..256" in validate_chunk_plan(ChunkPlan(park=True), 1)
    assert "ChunkPlan" in validate_chunk_plan((400, 3), 1)


def test_deadline_answers_the_chunk_question_within_the_contract():
    assert check_policy(DeadlinePolicy(chunk_tokens=300, park_steps=5)) > 0
    with pytest.raises(ValueError, match="park_steps"):
        DeadlinePolicy(park_steps=300)


def view(rid, prompt, gen=0):
    return RequestView(rid=rid, prompt_tokens=prompt, max_new_tokens=50, generated_tokens=gen)


def test_deadline_caps_only_around_short_questions_and_parks_only_while_they_decode():
    pol = DeadlinePolicy(chunk_tokens=300, park_steps=5)  # doc_tokens 4096
    doc, short, other_doc = view("D", 20_000), view("s", 100, 3), view("E", 9_000, 1)
    ask = lambda waiting, running, page=16: pol.chunk(  # noqa: E731
        Snapshot(now=1.0, waiting=waiting, running=running), doc, 8192, page)
    assert ask((), ()) == ChunkPlan()
    assert ask((), (other_doc,)) == ChunkPlan()  # only documents around
    assert ask((short,), ()) == ChunkPlan(limit=288, park=0)  # page-aligned, waits: no park
    assert ask((), (short,)) == ChunkPlan(limit=288, park=5)
    assert ask((), (short,), page=512) == ChunkPlan(limit=512, park=5)  # at least a page


def test_menu_entries_carry_a_chunk_answer():
    assert menu_entry("hold-hopeless") == ("hold-hopeless", None)
    assert menu_entry("deadline@256x4") == ("deadline", (256, 4))
    for bad in ("deadline@256", "deadline@x4", "deadline@256x999", "nope@1x1", "spf@-1x2"):
        with pytest.raises(ValueError, match="menu entry"):
            menu_entry(bad)
    with pytest.raises(ValueError, match="at least one"):
        check_menu(())
    specs = heuristic_specs(preset("finance-qa-chunks-v2"))
    s = specs["deadline:hopeless+chunks256x4"]
    assert (s.params["withhold"], s.params["chunk_tokens"], s.params["park_steps"]) == (
        "hopeless", 256, 4)


def test_a_learned_selector_answers_the_chunk_question_with_the_entry_it_picks(tmp_path):
    # one linear layer with zero weights: the bias alone picks the entry (the second)
    cfg = preset("finance-qa-chunks-v2")
    menu = list(cfg.menu)
    pol = bias_selector(tmp_path, cfg, 1)
    assert pol.chunks and menu[1] == "hold-hopeless@512x4"
    snap = Snapshot(now=1.0, waiting=(), running=(view("s", 100, 3),))
    assert pol.chunk(snap, view("D", 20_000), 8192, 1) == ChunkPlan(limit=512, park=4)
    assert check_policy(pol) > 0


def test_rescue_gives_full_chunks_to_a_document_that_can_just_make_its_deadline():
    pol = DeadlinePolicy(chunk_tokens=300, park_steps=5, rescue_s=1.0)
    doc = RequestView(rid="D", prompt_tokens=20_000, prefix_len=8_000, max_new_tokens=50,
                      arrival_s=0.0)
    running = (view("s", 100, 3),)
    at = lambda now: Snapshot(now=now, waiting=(), running=running)  # noqa: E731
    full = pol.slack(at(0.0), doc)  # its slack at t=0: deadline less the rest at full chunks
    assert full > 2
    assert pol.chunk(at(0.0), doc, 8192, 1) == ChunkPlan(limit=300, park=5)  # time to spare
    assert pol.chunk(at(full - 0.5), doc, 8192, 1) == ChunkPlan()  # 0.5 s left: full chunks
    assert pol.chunk(at(full + 0.5), doc, 8192, 1) == ChunkPlan(limit=300, park=5)  # lost
    with pytest.raises(ValueError, match="rescue_s"):
        DeadlinePolicy(rescue_s=-1.0)
