"""The twin's adapter from `SimRequest` to the policy's frozen `RequestView` (the runtime
plugin has the same adapter for SGLang's `Req`). Views are built from the state at each
decision; nothing is written onto a request for the policy to read (a request keeps its
last view, reused while the state it was built from is unchanged)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from twin.policy import RequestView, reservation
from twin.policy.base import IN_BATCH_CHECK_THRESHOLD, ViewSequence

if TYPE_CHECKING:
    from twin.request_state import SimRequest


def head_key(segments: tuple[tuple[int, int], ...]) -> int | None:
    """An id of a prompt's first 32 tokens, from its segments (equal segments are equal
    tokens; the live replayer generates a segment's tokens from its hash)."""
    need, key = IN_BATCH_CHECK_THRESHOLD, []
    for h, n in segments:
        take = min(n, need)
        key.append((h, take))
        need -= take
        if need == 0:
            return hash(tuple(key))
    return None


def prefix_path(node) -> tuple[int, ...]:
    path = []
    while node is not None and node.parent is not None:
        path.append(node.nid)
        node = node.parent
    return tuple(reversed(path))


def view(r: SimRequest, ratio: float, running: bool) -> RequestView:
    """The frozen view of `r` now. A view is kept on the request with the state it was
    built from and reused while that state is the same (a waiting request's view rarely
    changes between passes; building one costs more than comparing the state)."""
    node = None if running else r.matched_node
    key = (running, r.queue_entry_s, r.prefix_len, r.max_new_tokens, r.generated_tokens,
           r.first_token_s, r.arrival_work, r.ignore_eos,
           ratio if running and not r.ignore_eos else None,
           r.round_start_s if running else None,
           node, node is not None and node.parent is None)  # an evicted node: no path
    hit = r.view_cache
    if hit is not None and hit[0] == key:
        return hit[1]
    v = _build(r, ratio, running)
    r.view_cache = (key, v)
    return v


def _build(r: SimRequest, ratio: float, running: bool) -> RequestView:
    return RequestView(
        rid=r.rid, priority=r.priority, arrival_s=r.arrival_s, queue_entry_s=r.queue_entry_s,
        prompt_tokens=r.prompt_tokens, prefix_len=r.prefix_len,
        max_new_tokens=r.max_new_tokens, generated_tokens=r.generated_tokens,
        ignore_eos=r.ignore_eos,
        reserved_tokens=reservation(r.max_new_tokens, r.generated_tokens, r.ignore_eos, ratio)
        if running else 0.0,
        first_token_s=r.first_token_s, round_start_s=r.round_start_s if running else None,
        arrival_work=r.arrival_work, head=r.head,  # None when the prompt is < 32 tokens
        prefix_path=prefix_path(r.matched_node) if not running else ())


class RunningViews(ViewSequence):
    """The running batch's views for one decision, built when the policy first reads one
    (an order question of SGLang's cache-aware policies reads only the queue): its length
    and truth need none. It reads the requests as they are, so it is valid only while the
    decision is made: `close()` after it; a view first read after that raises (the
    requests have moved on). Compares and hashes as the tuple of its views."""

    __slots__ = ("_ratio", "_views", "_open")

    def __init__(self, reqs: list[SimRequest], ratio: float) -> None:
        self._reqs, self._ratio = tuple(reqs), ratio
        self._views: tuple[RequestView, ...] | None = None
        self._open = True

    def views(self) -> tuple[RequestView, ...]:
        if self._views is None:
            if not self._open:
                raise RuntimeError("a snapshot's running views were first read after its "
                                   "decision: a policy must not keep a snapshot")
            self._views = self._build()
        return self._views

    def _build(self) -> tuple[RequestView, ...]:
        """The views of `_reqs` (SimRequests here; the typed core's request numbers in
        its `CoreRunning`)."""
        ratio = self._ratio
        return tuple([view(r, ratio, True) for r in self._reqs])

    def close(self) -> None:
        self._open = False

    def __repr__(self) -> str:
        return repr(self.views()) if self._views is not None or self._open else (
            f"<{len(self)} running views, never read>")
