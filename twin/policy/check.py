"""`check_policy`: the policy contract, checked like gymnasium's `check_env`.

Over a seeded family of snapshots (empty queues, ties, long queues past the 128 fallback,
priority tiers, shared heads and prefix paths, preempt questions with and without enough
room), a policy must: answer an order question with a permutation of the waiting indices;
answer a preempt question with distinct valid running indices; answer a chunk question
(when it `chunks`) with a valid `ChunkPlan`; give the same answer twice
for the same snapshot (and for an equal copy of it); and leave its input unchanged.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace

from twin.policy.base import MAX_PARK, ChunkPlan, Plan, RequestView, Snapshot, reservation


class PolicyContractError(AssertionError):
    pass


def sample_snapshots(seed: int = 0, n: int = 60) -> list[Snapshot]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        n_wait = rng.choice([0, 1, 2, 5, 17, 130]) if k % 7 else 0
        n_run = rng.choice([0, 1, 3, 8])
        now = rng.uniform(0, 1000)
        ratio = rng.choice([0.1, 0.7, 1.0])

        def view(i: int, running: bool, k=k, now=now, ratio=ratio) -> RequestView:
            prompt = rng.choice([1, 20, 33, 512, 4000, 70000])
            gen = rng.randrange(0, 50) if running else rng.choice([0, 0, 3])
            max_new = gen + rng.randrange(1, 6000)
            ie = rng.random() < 0.8
            entry = now - rng.uniform(0, 60)
            depth, branch = rng.randrange(0, 4), rng.choice([10, 11])
            return RequestView(
                rid=f"{'r' if running else 'w'}{k}-{i}", priority=rng.choice([0, 0, 5, 20]),
                arrival_s=entry - rng.uniform(0, 5), queue_entry_s=entry,
                prompt_tokens=prompt, prefix_len=rng.randrange(0, prompt),
                max_new_tokens=max_new, generated_tokens=gen, ignore_eos=ie,
                reserved_tokens=reservation(max_new, gen, ie, ratio) if running else 0.0,
                first_token_s=(entry + 0.1) if gen else None,
                round_start_s=(now - rng.uniform(0, 2)) if running else None,
                arrival_work=rng.randrange(0, 10_000),
                head=rng.choice([None, 1, 2, 3]),
                prefix_path=tuple(branch * 10 + d for d in range(depth)))

        waiting = tuple(view(i, False) for i in range(n_wait))
        running = tuple(view(i, True) for i in range(n_run))
        cand = rng.randrange(n_wait) if (n_wait and k % 2) else None
        out.append(Snapshot(now=now, waiting=waiting, running=running,
                            kv_free=rng.randrange(0, 100_000), kv_evictable=rng.randrange(0, 5000),
                            kv_capacity=200_000, new_token_ratio=ratio,
                            max_running_requests=max(n_run, 1),
                            processed_tokens=rng.randrange(0, 20_000), candidate=cand,
                            tokens_needed=rng.choice([-50.0, 0.0, 10.0, 500.0, 1e6])))
    return out


def validate_plan(snap: Snapshot, plan: object) -> str | None:
    """Why `plan` is not a valid answer to `snap` (None when it is). The plugin calls this
    before applying an answer inside SGLang."""
    if not isinstance(plan, Plan):
        return f"answer is {type(plan).__name__}, not a Plan"
    if snap.candidate is None:
        order = plan.order
        if order is None:
            return "order question answered without an order"
        if sorted(order) != list(range(len(snap.waiting))) or not all(
                type(i) is int for i in order):
            return (f"order is not a permutation of range({len(snap.waiting)}): "
                    f"{list(order)[:10]}{'...' if len(order) > 10 else ''}")
        return _admit_problem(snap, plan.admit)
    if plan.admit is not None:
        return "admit answers an order question, not a preempt one"
    v = plan.victims
    if not all(type(i) is int and 0 <= i < len(snap.running) for i in v):
        return f"victims {list(v)} not all in range({len(snap.running)})"
    if len(set(v)) != len(v):
        return f"victims {list(v)} repeat an index"
    return None


def validate_chunk_plan(plan: object, page_size: int) -> str | None:
    """Why `plan` is not a valid answer to a chunk question, or None."""
    if not isinstance(plan, ChunkPlan):
        return f"a chunk answer must be a ChunkPlan, got {type(plan).__name__}"
    lim, park = plan.limit, plan.park
    if lim is not None and (isinstance(lim, bool) or not isinstance(lim, int)
                            or lim < max(page_size, 1)):
        return f"chunk limit {lim!r}: must be None or an integer >= the page size {page_size}"
    if isinstance(park, bool) or not isinstance(park, int) or not 0 <= park <= MAX_PARK:
        return f"park {park!r}: must be an integer in 0..{MAX_PARK}"
    return None


def _admit_problem(snap: Snapshot, admit: object) -> str | None:
    if admit is None:
        return None
    if type(admit) is not int or not 0 <= admit <= len(snap.waiting):
        return f"admit {admit!r} is not an integer in [0, {len(snap.waiting)}]"
    if admit == 0 and not snap.running:
        return "admit 0 with nothing running: an idle server must serve"
    return None


def check_policy(policy, snapshots: list[Snapshot] | None = None) -> int:
    """Raise `PolicyContractError` naming the first broken rule; return how many snapshots
    were checked."""
    snaps = sample_snapshots() if snapshots is None else snapshots
    for snap in snaps:
        before = copy.deepcopy(snap)
        plan = policy.decide(snap)
        why = validate_plan(snap, plan)
        if why:
            raise PolicyContractError(f"policy {policy.name!r}: {why} (snapshot at "
                                      f"t={snap.now}, {len(snap.waiting)} waiting, "
                                      f"{len(snap.running)} running)")
        if snap != before:
            raise PolicyContractError(f"policy {policy.name!r} changed its snapshot")
        if policy.decide(snap) != plan or policy.decide(copy.deepcopy(snap)) != plan:
            raise PolicyContractError(f"policy {policy.name!r}: a different answer for the "
                                      f"same snapshot (t={snap.now})")
        if getattr(policy, "chunks", False):
            _check_chunk(policy, snap)
    return len(snaps)


def _check_chunk(policy, snap: Snapshot) -> None:
    """The chunk question on the snapshot's first waiting request as the chunked one."""
    if not snap.waiting:
        return
    args = (replace(snap, waiting=snap.waiting[1:]), snap.waiting[0], 8192, 1)
    plan = policy.chunk(*args)
    why = validate_chunk_plan(plan, 1)
    if why:
        raise PolicyContractError(f"policy {policy.name!r}: {why} (chunk question at "
                                  f"t={snap.now})")
    if policy.chunk(*copy.deepcopy(args)) != plan:
        raise PolicyContractError(f"policy {policy.name!r}: a different chunk answer for the "
                                  f"same question (t={snap.now})")
