"""A request's state inside the simulated server (the twin's counterpart of SGLang's `Req`).

Policies never see it: `twin.views` builds a frozen `RequestView` from it for each decision.
"""

from __future__ import annotations

from twin.prefix import Node
from twin.views import head_key
from twin.workload import Request


class SimRequest:
    __slots__ = (
        "req", "rid", "priority", "arrival_s", "queue_entry_s", "prompt_tokens",
        "max_new_tokens", "generated_tokens", "prefix_len", "index", "ignore_eos", "arrival_work",
        "head",
        "cached_tokens", "retractions", "preemptions", "status", "error",
        "first_admit_s", "first_token_s", "finish_s", "tok_events", "dec_start",
        "node", "computed", "private", "matched_node", "round_start_s", "swapped_tokens",
        "left_batch_s", "lost_s", "moved_bytes", "entered_s", "view_cache", "queued_s",
    )

    def __init__(self, req: Request, sent_s: float, index: int) -> None:
        self.req = req
        self.rid = req.rid
        self.priority = req.priority
        self.arrival_s = sent_s
        self.queue_entry_s = sent_s
        self.entered_s = sent_s  # when the scheduler first took it in (its first pass)
        self.prompt_tokens = req.prompt_tokens
        self.max_new_tokens = req.output_tokens
        self.generated_tokens = 0
        self.prefix_len = 0
        # the twin's output lengths are fixed, as replays send them (the replica applies
        # the run's setting where the request has none)
        self.ignore_eos = req.ignore_eos is not False
        self.arrival_work = 0  # prefill tokens processed when it (re-)entered the queue
        self.head = head_key(req.segments)
        self.index = index
        self.cached_tokens = 0
        self.retractions = 0
        self.preemptions = 0
        self.status = ""
        self.error = ""
        self.first_admit_s: float | None = None
        self.queued_s = 0.0  # waits in the queue, every round (SGLang's queue_time)
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        # token emission times: a float (a prefill step's end) or (a, b), the decode steps
        # [a, b) of the replica's step-end timeline the request took part in
        self.tok_events: list = []
        self.dec_start = -1
        self.node: Node | None = None  # locked radix node of the current round
        self.matched_node: Node | None = None  # node found by the last prefix match
        self.computed = 0  # tokens of this round's fill whose KV exists
        self.private = 0  # KV tokens owned by the request, not by the radix cache
        self.round_start_s: float | None = None  # when it last entered the running batch
        self.swapped_tokens = 0  # KV tokens waiting in host memory (0: not swapped out)
        self.left_batch_s: float | None = None  # when it was last preempted or retracted
        self.lost_s = 0.0  # time spent out of the batch after preemptions and retractions
        self.moved_bytes = 0.0  # KV bytes copied for it (swap out and in)
        self.view_cache: tuple | None = None  # (state key, RequestView): twin/views.py

    @property
    def fill_len(self) -> int:
        """Tokens whose KV a (re-)admission must hold before the next token: the prompt
        plus everything generated so far (SGLang recomputes outputs after a retraction)."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.generated_tokens
