# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=False
"""The typed core (issue 14, docs/perf.md "A typed core"): one SGLang replica's whole
scheduler loop over state it owns in C arrays, for the plan's coverage so far: `servetwin
simulate` of one replica fed alone, open loop or by closed-loop clients (twin/source.py's
`Source`, taken over; bench_serving's warm-up too), SGLang's token pool (page 1), the radix
cache on or off (`CTree`, twin/prefix.py's tree typed), chunked prefill, mixed chunks and
the overlap loop on or off, SGLang's scheduling policies (fcfs, lpm, dfs-weight, hrrn,
lof, random, shortest-prefill-first; fcfs with priority scheduling and its preemption),
any other policy asked pass by pass from a snapshot built here (ORDER_ASK: the twin's
own, a learned one, the gymnasium environment's agent, whose questions a run stops at:
`Core.answer`), the step-time memo. `twin/core.py` decides
whether a run is covered; everything else runs the Python replica (twin/replica.py),
which is this module's specification, pass by pass and float by float: each function
below names the method it reproduces. docs/typed-core-inventory.md lists what that is.

Requests are numbered in the order the scheduler takes them in, which for one replica
fed alone is the order of their arrivals at the scheduler (`Source`'s heap order):
request i is `SimRequest.index` i. A request's numbers live in the arrays below; its
`SimRequest` is built when it leaves, with the fields the Python replica would hold then,
and handed to the replica's `finished` (a `RecordSink` or a list)."""

from cpython.exc cimport PyErr_CheckSignals
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF, PyObject
from libc.math cimport INFINITY, NAN, floor, isnan
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy

from twin._recordsc cimport round_to

from twin._search cimport search_left

import dataclasses
import random
from types import SimpleNamespace
from heapq import heappop, heappush

import numpy as np

from twin.config import CLIP_MAX_NEW_TOKENS, RETRACT_DECODE_STEPS
from twin.policy.base import (
    IN_BATCH_CHECK_THRESHOLD,
    PREFIX_MATCH_MAX_QUEUE,
    Plan,
    RequestView,
    Snapshot,
)
from twin.perf.step_cache import BLOCK as _BLOCK
from twin.errors import ServetwinError
from twin.policy.check import validate_chunk_plan
from twin.record_sink import RecordSink
from twin.request_state import SimRequest
from twin.views import RunningViews, head_key, prefix_path
from twin.workload import BENCH_WARMUP_GAP_S

_new = object.__new__
_UNSET = object()  # a request's head not yet computed (`Core.head_of`)



class CoreRunning(RunningViews):
    """twin/views.py `RunningViews` over the core's columns (`_reqs`: request numbers):
    the running batch's views for one question, built when first read, valid until its
    answer (`close`)."""

    __slots__ = ("_core",)

    def __init__(self, core, tuple idx, double ratio):
        RunningViews.__init__(self, idx, ratio)
        self._core = core

    def _build(self):
        return self._core.running_views(self._reqs, self._ratio)

    def close(self):
        RunningViews.close(self)
        self._core = None


cdef long long BLOCK = _BLOCK
cdef long long CLIP = CLIP_MAX_NEW_TOKENS
cdef long long RETRACT_STEPS = RETRACT_DECODE_STEPS
cdef long long IN_BATCH = IN_BATCH_CHECK_THRESHOLD
cdef Py_ssize_t MATCH_MAX_QUEUE = PREFIX_MATCH_MAX_QUEUE
# the queue's order (twin/core.py `order_kind`): as it is (fcfs), or SGLang's lpm
cpdef enum:
    ORDER_FCFS = 0
    ORDER_LPM = 1
    ORDER_PRIORITY = 2  # fcfs under --enable-priority-scheduling: by priority, preempting
    ORDER_LOF = 3  # SGLang's lof: most max_new_tokens first
    ORDER_SPF = 4  # SGLang's shortest-prefill-first, with its cap on the active chunk
    ORDER_HRRN = 5  # SGLang's hrrn: highest response ratio next (token-based aging)
    ORDER_RANDOM = 6  # SGLang's random: a seeded shuffle per decision
    ORDER_DFS = 7  # SGLang's dfs-weight: depth first over the radix tree, heavier first
    ORDER_ASK = 8  # asked of Python: a policy's `decide`, or an outside agent (`Core.answer`)
# what a fleet's pass answers (`Core.fleet_pass`)
cpdef enum:
    F_AGAIN = 0
    F_PREFILL = 1
    F_RUN = 2
    F_CUT = 3
    F_IDLE = 4
    F_END = 5
# what a pass's prefill scheduling answers up to its order question (`schedule_head`)
cdef enum:
    S_NONE = 0  # no prefill batch this pass
    S_GO = 1  # the queue is in order: admission next (`schedule_tail`)
    S_ASKED = 2  # an outside decider's question is pending (`Core.answer`, then `run`)
# what a decode run's planning part answers (`decode_pre`)
cdef enum:
    RETRACTED = 0
    RAN = 1
    RAN_CUT = 2
# the step timeline is written into arrays of this many steps (8 MB), the replica's
# `_end_blocks` once full, its `_end_chunks` the one being filled
cdef Py_ssize_t TL_BLOCK = 1 << 20

# ---- the radix cache (twin/prefix.py, typed) -------------------------------------------
cdef struct Lru:
    # an eviction candidate, RadixCache's heap entry `(last_access, nid, node)`; the node
    # a reference the heap owns
    double t
    long long nid
    PyObject* node


cdef inline bint lru_less(Lru* a, Lru* b) noexcept nogil:
    return a.t < b.t or (a.t == b.t and a.nid < b.nid)


cdef class CNode:
    """twin/prefix.py `Node`, typed: one segment `(hash, n_tokens)` of a cached path."""
    cdef readonly object key
    cdef readonly long long tokens, lock, nid
    cdef readonly CNode parent
    cdef readonly dict children
    cdef readonly double last_access

    def __init__(self, key, CNode parent, long long nid, double now):
        self.key = key
        self.tokens = key[1] if key is not None else 0
        self.parent = parent
        self.children = {}
        self.lock = 0
        self.last_access = now
        self.nid = nid


cdef class CTree:
    """twin/prefix.py `RadixCache`, typed, step for step: the same matches, locks,
    inserts and least-recently-used evictions (ties by creation order, stale heap
    entries skipped), so the same tokens are cached and evicted when. It counts tokens;
    the core frees an evicted node's KV from what `evict` returns. The methods without a
    trailing underscore are RadixCache's, for a caller after the run
    (`Replica.tree`)."""
    cdef readonly CNode root
    cdef long long next_id
    cdef readonly long long n_nodes, total_tokens, evictable_tokens
    # RadixCache's `_lru` heap, in C: ordered by (t, nid) as its tuples are (two entries
    # equal in both are the same node, so their order cannot matter)
    cdef Lru* lru
    cdef Py_ssize_t lru_n, lru_cap
    cdef readonly object on_evict, on_insert  # None: the core frees evicted nodes itself

    def __init__(self):
        self.root = CNode(None, None, 0, 0.0)
        self.root.lock = 1  # never evicted
        self.next_id = 1

    def __dealloc__(self):
        cdef Py_ssize_t j
        for j in range(self.lru_n):
            Py_DECREF(<object>self.lru[j].node)
        free(self.lru)

    cdef int push(self, CNode node, double t) except -1:
        """heapq.heappush(_lru, (t, node.nid, node))."""
        cdef Py_ssize_t j, up
        cdef Lru e
        cdef Lru* grown
        if self.lru_n == self.lru_cap:
            grown = <Lru*>realloc(self.lru, (2 * self.lru_cap + 64) * sizeof(Lru))
            if grown == NULL:
                raise MemoryError()
            self.lru = grown
            self.lru_cap = 2 * self.lru_cap + 64
        e.t, e.nid, e.node = t, node.nid, <PyObject*>node
        Py_INCREF(node)
        j = self.lru_n
        self.lru_n += 1
        while j > 0:
            up = (j - 1) >> 1
            if not lru_less(&e, &self.lru[up]):
                break
            self.lru[j] = self.lru[up]
            j = up
        self.lru[j] = e
        return 0

    cdef Lru pop(self) noexcept:
        """heapq.heappop(_lru): the least entry (its node reference is the caller's)."""
        cdef Lru top = self.lru[0], last
        cdef Py_ssize_t j = 0, c, n
        self.lru_n -= 1
        n = self.lru_n
        if n == 0:
            return top
        last = self.lru[n]
        while True:
            c = 2 * j + 1
            if c >= n:
                break
            if c + 1 < n and lru_less(&self.lru[c + 1], &self.lru[c]):
                c += 1
            if not lru_less(&self.lru[c], &last):
                break
            self.lru[j] = self.lru[c]
            j = c
        self.lru[j] = last
        return top

    cdef CNode match_(self, tuple segments, double now, long long* matched):
        cdef CNode node = self.root, child
        cdef long long got = 0
        for seg in segments:
            child = node.children.get(seg)
            if child is None:
                break
            node = child
            got += child.tokens
            node.last_access = now
        if node is not self.root and not node.children and node.lock == 0:
            self.push(node, now)
        matched[0] = got
        return node

    cdef CNode insert_(self, tuple segments, double now, long long* added):
        """The deepest node of `segments`' path; `added`: the tokens of the nodes made."""
        cdef CNode node = self.root, child
        cdef long long got = 0
        for seg in segments:
            child = node.children.get(seg)
            if child is None:
                child = CNode(seg, node, self.next_id, now)
                self.next_id += 1
                self.n_nodes += 1
                node.children[seg] = child
                got += child.tokens
                self.evictable_tokens += child.tokens  # new nodes start unlocked
            child.last_access = now
            node = child
        self.total_tokens += got
        if node is not self.root and not node.children and node.lock == 0:
            self.push(node, now)
        added[0] = got
        return node

    cdef void lock_(self, CNode node):
        while node is not self.root:
            if node.lock == 0:
                self.evictable_tokens -= node.tokens
            node.lock += 1
            node = node.parent

    cdef void unlock_(self, CNode node):
        if not node.children and node is not self.root and node.lock == 1:
            self.push(node, node.last_access)
        while node is not self.root:
            node.lock -= 1
            if node.lock == 0:
                self.evictable_tokens += node.tokens
            node = node.parent

    cdef long long evict_(self, long long n_tokens) except -1:
        cdef long long freed = 0
        cdef CNode node, parent, c
        cdef Py_ssize_t j
        cdef Lru e
        cdef list stack
        if self.lru_n > 4 * self.n_nodes + 64:  # rare: drop stale entries
            for j in range(self.lru_n):
                Py_DECREF(<object>self.lru[j].node)
            self.lru_n = 0
            stack = [self.root]
            while stack:
                c = stack.pop()
                if c.children:
                    stack.extend(c.children.values())
                elif c is not self.root and c.lock == 0:
                    self.push(c, c.last_access)
        while freed < n_tokens and self.lru_n:
            e = self.pop()
            node = <CNode>e.node
            Py_DECREF(node)  # the heap's reference (`node` holds its own)
            parent = node.parent
            if (parent is None or node.lock or node.children or e.t != node.last_access
                    or parent.children.get(node.key) is not node):
                continue  # stale entry
            del parent.children[node.key]
            self.n_nodes -= 1
            freed += node.tokens
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock == 0:
                self.push(parent, parent.last_access)
        self.total_tokens -= freed
        self.evictable_tokens -= freed
        return freed

    # RadixCache's interface (the tree after the run; tests against twin/prefix.py)
    def match(self, segments, now):
        cdef long long got
        node = self.match_(tuple(segments), now, &got)
        return got, node

    def insert(self, segments, now):
        cdef long long added
        before = self.next_id
        node = self.insert_(tuple(segments), now, &added)
        return node, [c for c in self._path(node) if c.nid >= before]

    def _path(self, CNode node):
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent
        return out[::-1]

    def lock(self, CNode node):
        self.lock_(node)

    def unlock(self, CNode node):
        self.unlock_(node)

    def evict(self, long long n_tokens):
        return self.evict_(n_tokens)

    def peek(self, segments):
        cdef CNode node = self.root
        cdef long long matched = 0
        for seg in segments:
            node = node.children.get(seg)
            if node is None:
                break
            matched += node.tokens
        return matched

    def check_integrity(self):
        cdef long long total = 0, evictable = 0
        cdef CNode node
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is self.root:
                continue
            assert node.lock >= 0, f"negative lock on node {node.nid}"
            assert node.lock >= max([c.lock for c in node.children.values()], default=0), \
                f"node {node.nid} locked less than a child"
            total += node.tokens
            evictable += node.tokens if node.lock == 0 else 0
        assert total == self.total_tokens, (total, self.total_tokens)
        assert evictable == self.evictable_tokens, (evictable, self.evictable_tokens)


# add_one's / state()'s answers
cdef enum:
    CONTINUE = 0
    NO_TOKEN = 1
    OTHER = 2


cdef struct Slot:  # a memo block of decode step times (Core.block_at)
    long long b, r, q
    const double* data
    Py_ssize_t lo, hi  # the steps there


cdef struct PrefillSlot:  # a one-chunk prefill step's time (Core.prefill_time)
    long long ext1, done  # ext + 1 (0: an empty slot)
    double t


cdef long long H1 = 40503, H2 = 2654435761  # (C constants: the tables' hashes)


cdef enum:
    N_SLOTS = 4096  # memo blocks read from C (a power of two)
    N_PF = 1 << 16  # one-chunk prefill steps (a power of two)


# ---- a leaving request's SimRequest ------------------------------------------------------
# `Core.simreq` writes these slots, in this order; where SimRequest's slots are plain
# object slots (member descriptors of type T_OBJECT_EX, settable, no __setattr__ of its
# own), straight into the object, as the descriptor's own setter does; else by setattr
_SLOTS = ("req", "rid", "priority", "arrival_s", "queue_entry_s", "entered_s",
          "prompt_tokens", "max_new_tokens", "generated_tokens", "prefix_len", "index",
          "ignore_eos", "arrival_work", "head", "cached_tokens", "retractions",
          "preemptions", "status", "error", "first_admit_s", "queued_s", "first_token_s",
          "finish_s", "tok_events", "dec_start", "node", "computed", "private",
          "matched_node", "round_start_s", "swapped_tokens", "left_batch_s", "lost_s",
          "moved_bytes", "view_cache")
cdef Py_ssize_t _slot_at[64]
cdef bint _slots_direct = False


cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member


cdef bint slot_offsets(cls, tuple names, Py_ssize_t* out) except -1:
    """Each of `cls`'s slots `names` as its offset in an instance, into `out`; False when
    one is not a plain, writable object slot (then nothing may be written directly)."""
    cdef PyMemberDef* m
    cdef Py_ssize_t k
    for k, name in enumerate(names):
        d = cls.__dict__.get(name)
        if type(d) is not _MemberDescriptor:
            return False
        m = (<PyMemberDescrObject*><PyObject*>d).d_member
        if m.type != 16 or m.flags & 1:  # T_OBJECT_EX, not READONLY
            return False
        out[k] = m.offset
    return True


cdef inline void put_slot(object obj, Py_ssize_t offset, object v):
    """The object slot at `offset` of `obj` = v (its old value released)."""
    cdef PyObject** p = <PyObject**>((<char*><PyObject*>obj) + offset)
    cdef PyObject* old = p[0]
    Py_INCREF(v)
    p[0] = <PyObject*>v
    Py_XDECREF(old)


def _find_slots() -> bool:
    """Whether `set_slot` may write SimRequest's slots itself (and their offsets)."""
    global _slots_direct
    _slots_direct = (SimRequest.__setattr__ is object.__setattr__ and len(_SLOTS) <= 64
                     and set(_SLOTS) == set(SimRequest.__slots__)
                     and slot_offsets(SimRequest, _SLOTS, _slot_at))
    return _slots_direct


_MemberDescriptor = type(SimRequest.rid)
_find_slots()


cdef inline int set_slot(object obj, Py_ssize_t k, object v) except -1:
    """obj.<_SLOTS[k]> = v."""
    if not _slots_direct:
        setattr(obj, _SLOTS[k], v)
        return 0
    put_slot(obj, _slot_at[k], v)
    return 0


# a policy's view of a request (twin/policy/base.py `RequestView`, a frozen dataclass
# with slots) built as SimRequest is: its slots written directly (`new_view`), the
# frozen __setattr__ bypassed as dataclasses' own __init__ bypasses it
_VIEW_FIELDS = ("rid", "priority", "arrival_s", "queue_entry_s", "prompt_tokens",
                "prefix_len", "max_new_tokens", "generated_tokens", "ignore_eos",
                "reserved_tokens", "first_token_s", "round_start_s", "arrival_work", "head",
                "prefix_path")
cdef Py_ssize_t _vslot_at[16]
cdef bint _vslots_direct = False


def _find_view_slots() -> bool:
    """Whether `new_view` may write RequestView's slots itself (and their offsets): the
    dataclass's fields are `_VIEW_FIELDS`, in order, each a plain object slot, with no
    `__post_init__` to run."""
    global _vslots_direct
    _vslots_direct = (
        tuple(f.name for f in dataclasses.fields(RequestView)) == _VIEW_FIELDS
        and set(RequestView.__slots__) == set(_VIEW_FIELDS)
        and not hasattr(RequestView, "__post_init__")
        and slot_offsets(RequestView, _VIEW_FIELDS, _vslot_at))
    return _vslots_direct


_find_view_slots()


cdef object new_view(rid, priority, arrival_s, queue_entry_s, prompt_tokens, prefix_len,
                     max_new_tokens, generated_tokens, ignore_eos, reserved_tokens,
                     first_token_s, round_start_s, arrival_work, head, prefix_path):
    """RequestView(...) of these fields (in `_VIEW_FIELDS`' order)."""
    cdef Py_ssize_t k
    vals = (rid, priority, arrival_s, queue_entry_s, prompt_tokens, prefix_len,
            max_new_tokens, generated_tokens, ignore_eos, reserved_tokens, first_token_s,
            round_start_s, arrival_work, head, prefix_path)
    if not _vslots_direct:
        return RequestView(*vals)
    v = _new(RequestView)
    for k in range(15):
        put_slot(v, _vslot_at[k], vals[k])
    return v


cdef class Kernel:
    """A decode batch size's step times as numbers (a backend's `decode_kernel`: opdb's,
    under the overlap loop's wrapper or not): t(kv) = c + interp(kv / b, xp, fp), then
    max(t - oh, oh) with an overhead; np.interp and np.maximum replayed exactly."""

    cdef double c, oh
    cdef bint has_oh
    cdef const double[::1] xp
    cdef const double[::1] fp
    cdef Py_ssize_t n

    def __init__(self, tuple got):
        xp = np.ascontiguousarray(got[1], dtype=np.float64)
        fp = np.ascontiguousarray(got[2], dtype=np.float64)
        if xp.ndim != 1 or xp.shape != fp.shape or len(xp) < 2 \
                or not bool(np.all(np.diff(xp) > 0)):
            raise ValueError("a decode kernel needs two or more increasing points")
        self.c = got[0]
        self.xp, self.fp, self.n = xp, fp, len(xp)
        self.has_oh = len(got) == 4
        self.oh = got[3] if self.has_oh else 0.0

    cdef double at(self, double x) noexcept:
        """c + np.interp(x, xp, fp) (numpy's arr_interp, left and right the end values),
        then the overhead's np.maximum."""
        cdef const double* dx = &self.xp[0]
        cdef const double* dy = &self.fp[0]
        cdef Py_ssize_t lo = 0, hi = self.n - 1, mid
        cdef double r, slope
        if isnan(x):
            r = x
        elif x < dx[0]:
            r = dy[0]
        elif x >= dx[hi]:
            r = dy[hi]
        else:
            while hi - lo > 1:  # dx[lo] <= x < dx[hi]
                mid = (lo + hi) >> 1
                if x < dx[mid]:
                    hi = mid
                else:
                    lo = mid
            if dx[lo] == x:
                r = dy[lo]
            else:
                slope = (dy[lo + 1] - dy[lo]) / (dx[lo + 1] - dx[lo])
                r = slope * (x - dx[lo]) + dy[lo]
                if isnan(r):
                    r = slope * (x - dx[lo + 1]) + dy[lo + 1]
                    if isnan(r) and dy[lo] == dy[lo + 1]:
                        r = dy[lo]
        r = self.c + r
        if self.has_oh:
            r = r - self.oh
            if not (r >= self.oh or isnan(r)):
                r = self.oh
        return r

    cdef void fill(self, double* out, long long start, long long b, Py_ssize_t lo,
                   Py_ssize_t hi) noexcept:
        """out[j] for j in [lo, hi): the step of b requests at KV sum start + b * j
        (`StepTimeCache._block`'s arange, divided by b as decode_times divides it)."""
        cdef Py_ssize_t j
        for j in range(lo, hi):
            out[j] = self.at(<double>(start + b * j) / <double>b)

    def times(self, long long b, kv_sums):
        """decode_times(b, kv_sums) by this kernel (tests compare it with the backend)."""
        kv = np.ascontiguousarray(kv_sums, dtype=np.float64)
        out = np.empty(len(kv))
        cdef const double[::1] kvv = kv
        cdef double[::1] ov = out
        cdef Py_ssize_t j
        for j in range(kvv.shape[0]):
            ov[j] = self.at(kvv[j] / <double>b)
        return out


cdef class PrefillKernel:
    """A prefill-only step's time as numbers (a backend's `prefill_kernel`: opdb's,
    under the overlap wrapper or not): opdb's `step_time(chunks, [])` replayed operation
    by operation (the context-attention grid's bilinear interpolation, the step-token and
    LM-head tables), then max(t - oh, oh) under the wrapper; `at` declines (False) where
    opdb would warn (beyond the measured context or a table's end)."""

    cdef double eager, per_req
    cdef const double[::1] cn
    cdef const double[::1] cp
    cdef const double[:, ::1] ctx
    cdef const double[::1] tok
    cdef const double[::1] head
    cdef long long ctx_max
    cdef bint overlap
    cdef set warned  # the backend's warnings given (`OpdbStepTime._warned`)

    def __init__(self, tuple got):
        self.eager, self.per_req = got[0], got[1]
        self.cn = np.ascontiguousarray(got[2], dtype=np.float64)
        self.cp = np.ascontiguousarray(got[3], dtype=np.float64)
        self.ctx = np.ascontiguousarray(got[4], dtype=np.float64)
        self.ctx_max = got[5]
        self.tok = np.ascontiguousarray(got[6], dtype=np.float64)
        self.head = np.ascontiguousarray(got[7], dtype=np.float64)
        self.warned = got[8]
        self.overlap = len(got) == 10 and bool(got[9])
        if (self.cn.shape[0] < 2 or self.cp.shape[0] < 2
                or self.ctx.shape[0] != self.cn.shape[0] or self.ctx.shape[1] != self.cp.shape[0]
                or not bool(np.all(np.diff(got[2]) > 0)) or not bool(np.all(np.diff(got[3]) > 0))):
            raise ValueError("a prefill kernel needs an increasing grid and its table")

    cdef Py_ssize_t below(self, const double[::1] axis, double x) noexcept:
        """min(max(bisect_right(axis, x) - 1, 0), len(axis) - 2)."""
        cdef Py_ssize_t lo = 0, hi = axis.shape[0], mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if x < axis[mid]:
                hi = mid
            else:
                lo = mid + 1
        lo -= 1
        if lo < 0:
            lo = 0
        if lo > axis.shape[0] - 2:
            lo = axis.shape[0] - 2
        return lo

    cdef double table(self, const double[::1] tab, long long m) noexcept:
        """opdb's `_tokens`: tab[m], or beyond its end the linear extrapolation."""
        cdef Py_ssize_t last = tab.shape[0] - 1
        if m < tab.shape[0]:
            return tab[m]
        return tab[last] + (tab[last] - tab[last - 1]) * <double>(m - last)

    cdef int at(self, const long long* ext, const long long* done, Py_ssize_t m,
                double* out) except -1:
        """The step of chunks (ext[k], done[k]) for k < m into `out`: 1; 0 where opdb
        would warn now (beyond the measured context or a table's end, not yet warned
        there: the backend then answers and warns), and nothing is written."""
        cdef Py_ssize_t k, i, j
        cdef long long tokens = 0
        cdef double t, n, pre, fx, fy, lo, hi, oh
        for k in range(m):
            if ext[k] + done[k] > self.ctx_max and "ctx" not in self.warned:
                return 0
            tokens += ext[k]
        if (tokens >= self.tok.shape[0] and "step tokens" not in self.warned) or (
                m >= self.head.shape[0] and "lm head" not in self.warned):
            return 0
        oh = self.eager + self.per_req * <double>m
        t = oh
        for k in range(m):
            n, pre = <double>ext[k], <double>done[k]
            i = self.below(self.cn, n)
            j = self.below(self.cp, pre)
            fx = (n - self.cn[i]) / (self.cn[i + 1] - self.cn[i])
            fy = (pre - self.cp[j]) / (self.cp[j + 1] - self.cp[j])
            lo = self.ctx[i, j] + (self.ctx[i + 1, j] - self.ctx[i, j]) * fx
            hi = self.ctx[i, j + 1] + (self.ctx[i + 1, j + 1] - self.ctx[i, j + 1]) * fx
            t = t + (lo + (hi - lo) * fy)
        t = t + self.table(self.tok, tokens)
        t = t + self.table(self.head, m)
        if self.overlap:
            t = t - oh
            if oh > t:
                t = oh
        out[0] = t
        return 1

    def step(self, list chunks):
        """The step of `chunks` [(ext, done), ...], or None where `at` declines (tests
        compare it with the backend's `step_time(chunks, [])`)."""
        cdef Py_ssize_t m = len(chunks)
        cdef double t
        e = np.array([c[0] for c in chunks], dtype=np.int64)
        d = np.array([c[1] for c in chunks], dtype=np.int64)
        cdef const long long[::1] ev = e
        cdef const long long[::1] dv = d
        if m == 0:
            return None
        return t if self.at(&ev[0], &dv[0], m, &t) else None


def prefill_kernel(st):
    """`st`'s prefill kernel as the typed core uses it (a `PrefillKernel`), or None (none
    given, or numbers that are not float64: numpy would compute those in other widths)."""
    get = getattr(st, "prefill_kernel", None)
    got = get() if get is not None else None
    if got is None:
        return None
    f64 = (float, np.float64)
    if (type(got[0]) not in f64 or type(got[1]) not in f64
            or any(getattr(got[k], "dtype", None) != np.float64 for k in (4, 6, 7))):
        return None
    return PrefillKernel(tuple(got))


_NO_KERNEL = object()  # (not yet asked)


def decode_kernel(st, long long b):
    """`st`'s decode kernel for batch b as the typed core uses it (a `Kernel`), or None."""
    get = getattr(st, "decode_kernel", None)
    got = get(b) if get is not None else None
    return None if got is None else Kernel(tuple(got))


cdef class Core:
    # the server
    cdef long long capacity, used, oom, max_running, max_prefill, chunk, max_req_input
    cdef long long max_req_len
    cdef bint has_chunk, overlap, has_horizon, run_eos, mixed
    cdef double horizon, every, next_sample
    cdef double init_ratio, min_ratio, decay, ratio
    # the feed: requests in the scheduler's arrival order
    cdef Py_ssize_t n, in_lo, in_hi, known, n_left
    cdef double fw  # the feeder's next wake-up (INFINITY: none)
    # closed-loop clients (twin/source.py `Source`, taken over): the released requests'
    # heap of (arrival at the scheduler, seq, request), their send times by seq, the
    # requests not yet released from p_next on, the clients' slots, the tokenizer's queue
    cdef bint closed
    cdef list heap, pending
    cdef dict sent_of
    cdef Py_ssize_t p_next
    cdef long long limit, in_flight, seq
    cdef long long warm_left  # bench_serving's warm-ups still out (none are unreleased)
    cdef double offset  # added to the measured requests' arrival times once they are back
    cdef bint has_tok
    cdef double free_at, per_req, per_tok, latency, egress
    # the feeder (Deployment.run) waits on `_more` (WAIT), sleeps until fw, or has
    # ended; `resume`: a leave released `_more` at resume_t, the feeder runs next at
    # the replica's next yield
    cdef bint waiting_more, resume
    cdef double resume_t
    cdef double[::1] at, sent
    cdef list reqs
    # per request
    cdef long long[::1] prompt, max_new, gen, computed, private_, dec_start, retractions
    cdef signed char[::1] eos
    cdef long long[::1] arrival_work
    cdef double[::1] entered, queue_entry, queued, first_admit, first_token, finish, lost
    cdef double[::1] left_batch, round_start
    cdef list errors, tok
    # queues (request numbers): waiting is a ring, running a list in order
    cdef long long[::1] wq, run_, tmp
    cdef Py_ssize_t w_head, w_len, n_run
    cdef long long chunked
    # pass state
    cdef bint batch_full, shrunk, placed_any
    cdef double scheduled_at, pass_at  # NAN: None
    cdef long long fl_slots, fl_tokens, fl_next_slots, fl_next_tokens
    # counters (twin.replica_memory.Counters)
    cdef long long prefill_steps, decode_steps, prefill_tokens, n_retractions, mixed_steps
    cdef double busy_s
    cdef long long n_dec_steps
    # the Python side
    cdef object rep, cache, st, finished, progress, series, end_blocks
    # the timeline: the block being filled (tl_fill steps of it), a decode run's ends
    # (scratch), and when a RecordSink reads the timeline (every sink_chunk-th leave)
    cdef object tl_cur
    cdef double[::1] tl_view
    cdef Py_ssize_t tl_fill, scratch_cap
    cdef double* scratch
    cdef long long sink_chunk
    cdef object horizon_obj, stopped
    cdef dict prefill_memo, blocks  # the step-time memo's (twin/perf/step_cache.py)
    cdef double quiet
    # the memo's blocks a decode run reads, by (b, r, q), in a direct-mapped table of
    # N_SLOTS (the arrays kept alive by `slot_ref`); a run across two blocks is joined
    # into `joined`
    cdef Slot* slots
    cdef list slot_ref
    # blocks computed here from the backend's decode kernels (by batch size; None: the
    # backend has none, the memo's Python blocks are read), each in its slot's storage
    cdef dict kernels
    cdef bint kernel_ok
    cdef double* kstore
    cdef PrefillKernel pk  # a prefill-only step computed here (None: asked of the memo)
    cdef double* joined
    # prefill steps of one chunk (ext, computed): their memo in an open-addressed table
    cdef PrefillSlot* pf
    cdef Py_ssize_t pf_n
    cdef object cap
    cdef double now
    # a step or run planned and not yet slept through (`prefill_post`, `decode_post`)
    cdef double dur
    cdef bint post_decoders, post_done
    cdef bint in_prefill  # between prefill_pre and prefill_post (a crash loses its batch)
    # a replica in a fleet (`fed`): SimPy runs it, pass by pass (twin/core.py `life`); its
    # feed is the deployment's (pump, next_arrival, done, left), whose submits fill the
    # replica's inbox; `cuts`: its decode runs ignore arrivals and a submit cuts them
    # (twin/decode_cut.py), the run's planning state kept for `give_back`
    cdef bint fed, cuts
    cdef object feed, now_obj
    cdef double same_t, run_t0, busy0, ratio0
    cdef long long spins, run_k
    cdef bint now_int  # the clock is still SimPy's initial int 0
    # admission (one pass's PrefillAdder)
    cdef double a_total_offset
    cdef long long a_cur_offset, a_rem_input, a_rem_chunk, a_n
    cdef bint a_continuing
    cdef long long a_new_chunked
    cdef long long[::1] a_req, a_ext, a_done  # (a_done: the prefill kernel's scratch)
    # the radix cache (None: off; the replica's RadixCache is replaced by it at the
    # end): each request's matched prefix, cached tokens, locked node, last matched node
    cdef CTree tree
    cdef bint has_tree
    cdef long long[::1] prefix, cached
    cdef list node, matched
    # lpm: the order question each pass, and each request's `head` (its first 32
    # tokens' key, twin/views.py `head_key`; head_ok 0: None)
    cdef int order_kind
    cdef bint heads  # the order reads each request's head (lpm, spf, hrrn)
    cdef long long[::1] head_h, wtmp
    cdef signed char[::1] head_ok, wdef
    cdef dict rid_rank  # hrrn's tie-break: each rid's place in sorted order
    cdef object seed  # random's
    cdef object policy
    cdef long long[::1] rank
    cdef double[::1] hkey
    # priority scheduling: each request's priority and preemptions, the policy's sign
    # (1: low values first) and preemption threshold, the victims' search buffers
    cdef bint preempt
    cdef long long sign
    cdef double threshold
    cdef long long[::1] prio, preemptions_, vict
    cdef long long n_preemptions
    # an order asked of Python (ORDER_ASK, twin/core.py `run_order`): `asker(snapshot)`
    # answers a Plan, or anything else for a question left pending (an outside agent's:
    # `run` returns with `asking` set, `answer` applies its plan, `run` goes on);
    # `ask_all`: asked even with fewer than two waiting (an outside decider); `ask_skip`:
    # never asked (a policy that keeps the queue's order); `admit_n`: the plan's admission
    # limit for this pass (-1: none); `cap_chunk`: shortest-prefill-first's cap on the
    # active chunk (its own order, or the asked policy's `chunk_limit`)
    cdef object asker, ask_snap
    cdef bint ask_all, ask_skip, ask_matched, resuming
    cdef readonly bint asking, ended
    cdef bint cap_chunk
    cdef long long admit_n
    cdef long long passes
    cdef list vcache, vhead  # each request's last waiting view (key, view) and its head
    # chunk questions (an asked policy with `chunks`, twin/replica.py `_chunk_parked`,
    # `_chunk_limit`, `first_chunk_limit`): the answer due for the chunked request
    # `due_i` at `due_computed` tokens (its limit, -1: none; the decode step count its
    # parked passes end at), and the park the next decode run ends at (0: none)
    cdef bint asks_chunks
    cdef long long due_i, due_computed, due_limit, due_park_at, park_until

    def __init__(self, rep, tuple columns, object src, object stopped, int order_kind,
                 bint fed=False, dict rid_ranks=None, object asker=None, bint ask_all=False,
                 bint ask_skip=False):
        """`columns`: (arrival times, send times, requests) of an open loop in the
        scheduler's order (twin/core.py `_columns`); None: `src`'s closed-loop clients,
        or with `fed` a fleet's replica, its requests submitted as the run goes (the
        columns grow; `rid_ranks`: hrrn's rank of every rid of the run).
        `order_kind`: how the queue is ordered (twin/core.py `order_kind`); ORDER_ASK:
        by `asker` (see the fields' comment)."""
        cdef Py_ssize_t i, n, j
        cdef list at, sent, reqs
        self.fed = fed
        self.same_t = -1.0
        self.closed = columns is None and not fed
        if fed:
            n = 64
            at, sent, reqs = [0.0] * n, [0.0] * n, [None] * n
            self.feed = rep.feed
            self.cuts = bool(rep.feed.cuts_runs)
            self.same_t = -1.0
        elif self.closed:
            self.heap, self.sent_of = src._ready, src._sent
            self.pending = list(src._pending)
            n = len(self.heap) + len(self.pending)
            at, sent, reqs = [0.0] * n, [0.0] * n, [None] * n
            self.limit, self.in_flight, self.seq = src._limit, src._in_flight, src._seq
            self.warm_left, self.offset = src._warm_left, src._offset
            path = src._path
            self.has_tok = src._tokenizer is not None
            self.free_at = src._tokenizer.free_at if self.has_tok else 0.0
            self.per_req, self.per_tok = path.per_request_s, path.per_token_s
            self.latency, self.egress = path.latency_s, path.egress_s
            src._ready, src._sent, src._pending = [], {}, None  # the core's now
        else:
            at, sent, reqs = columns
            n = len(reqs)
        cap = rep.cap
        self.rep, self.cap = rep, cap
        self.cache, self.st = rep._cache, rep.st
        self.finished, self.progress, self.series = rep.finished, rep.progress, rep.series
        self.end_blocks = rep._end_blocks
        if rep._end_chunks or rep._end_blocks:
            raise RuntimeError("the typed core starts a replica whose timeline is empty")
        self.tl_new()
        self.sink_chunk = 0  # a list: read at the end only
        if type(rep.finished) is RecordSink:  # it flushes when its `_buf` fills
            self.sink_chunk = rep.finished.chunk
        self.prefill_memo = rep._cache._prefill
        self.blocks = rep._cache._blocks
        self.quiet = rep._cache.quiet
        self.slots = <Slot*>calloc(N_SLOTS, sizeof(Slot))
        self.pf = <PrefillSlot*>calloc(N_PF, sizeof(PrefillSlot))
        self.joined = <double*>malloc(BLOCK * sizeof(double))
        if self.slots == NULL or self.pf == NULL or self.joined == NULL:
            raise MemoryError()
        # (calloc'd: an empty slot is all zeros, its pages untouched until used)
        self.slot_ref = [None] * N_SLOTS
        self.kernels = {}
        self.pk = prefill_kernel(self.cache.st)
        self.kernel_ok = getattr(self.cache.st, "decode_kernel", None) is not None
        self.kstore = <double*>malloc(N_SLOTS * BLOCK * sizeof(double)) if self.kernel_ok \
            else NULL
        if self.kernel_ok and self.kstore == NULL:
            raise MemoryError()
        self.pf_n = 0
        self.stopped = stopped
        alloc = rep.alloc
        self.capacity, self.used, self.oom = alloc.capacity, alloc.used, alloc._oom
        self.max_running = cap.max_running_requests
        self.max_prefill = cap.max_prefill_tokens
        self.has_chunk = cap.chunked_prefill_size is not None
        self.chunk = cap.chunked_prefill_size if self.has_chunk else 0
        self.max_req_input = cap.max_req_input_len
        self.max_req_len = min(cap.context_len, cap.max_total_num_tokens)
        self.overlap = rep.freed_later is not None
        self.mixed = bool(rep.args.enable_mixed_chunk)
        self.horizon_obj = rep.horizon
        self.has_horizon = rep.horizon is not None
        self.horizon = rep.horizon if self.has_horizon else INFINITY
        self.every, self.next_sample = rep._sample_every, rep._next_sample
        self.init_ratio, self.min_ratio = rep.init_ratio, rep.min_ratio
        self.decay, self.ratio = rep.ratio_decay, rep.new_token_ratio
        self.run_eos = rep.ignore_eos
        self.n = n
        self.at = np.array(at, dtype=np.float64)
        self.sent = np.array(sent, dtype=np.float64)
        self.reqs = reqs
        self.prompt = np.array([r.prompt_tokens if r is not None else 0 for r in reqs],
                               dtype=np.int64)
        self.max_new = np.array([r.output_tokens if r is not None else 0 for r in reqs],
                                dtype=np.int64)
        self.gen = np.zeros(n, dtype=np.int64)
        self.computed = np.zeros(n, dtype=np.int64)
        self.private_ = np.zeros(n, dtype=np.int64)
        self.retractions = np.zeros(n, dtype=np.int64)
        self.dec_start = np.full(n, -1, dtype=np.int64)
        self.eos = np.zeros(n, dtype=np.int8)
        self.queue_entry = np.zeros(n)
        self.entered = np.zeros(n)
        self.arrival_work = np.zeros(n, dtype=np.int64)
        self.queued = np.zeros(n)
        self.lost = np.zeros(n)
        self.first_admit = np.full(n, NAN)
        self.first_token = np.full(n, NAN)
        self.finish = np.full(n, NAN)
        self.left_batch = np.full(n, NAN)
        self.round_start = np.full(n, NAN)
        self.errors = [""] * n
        self.tok = [None] * n
        self.wq = np.zeros(max(n, 1), dtype=np.int64)
        # the batch never holds more than max_running_requests (nor a prefill batch more
        # than that plus the chunked request)
        m = (self.max_running if fed else min(n, self.max_running)) + 2
        self.run_ = np.zeros(m, dtype=np.int64)
        self.tmp = np.zeros(m, dtype=np.int64)
        self.a_req = np.zeros(m, dtype=np.int64)
        self.a_ext = np.zeros(m, dtype=np.int64)
        self.a_done = np.zeros(m, dtype=np.int64)
        self.chunked = -1
        self.has_tree = rep.tree is not None  # (empty: twin/core.py checks)
        self.tree = CTree() if self.has_tree else None
        self.prefix = np.zeros(n, dtype=np.int64)
        self.cached = np.zeros(n, dtype=np.int64)
        self.node = [None] * n
        self.matched = [None] * n
        self.order_kind = order_kind
        self.seed = getattr(rep.policy, "seed", None)
        self.policy = rep.policy
        self.asker, self.ask_all, self.ask_skip = asker, ask_all, ask_skip
        self.asking = self.resuming = False
        self.admit_n = -1
        self.passes = 0
        self.cap_chunk = order_kind == ORDER_SPF or (
            order_kind == ORDER_ASK and getattr(rep.policy, "chunk_limit", None) is not None)
        if order_kind == ORDER_ASK:
            self.vcache, self.vhead = [None] * n, [_UNSET] * n
        self.asks_chunks = order_kind == ORDER_ASK and bool(rep.policy.chunks)
        self.due_i = -1
        self.park_until = rep._park_until
        # per-request columns only the orders that read them get at full length (a day
        # of a million requests would otherwise carry tens of MB of them for nothing)
        cdef Py_ssize_t n_hrrn = n if order_kind == ORDER_HRRN else 1
        self.heads = order_kind in (ORDER_LPM, ORDER_SPF, ORDER_HRRN)
        cdef Py_ssize_t n_head = n if self.heads else 1
        self.rank = np.zeros(n_hrrn, dtype=np.int64)
        self.hkey = np.zeros(n_hrrn)
        if order_kind == ORDER_HRRN and fed:
            self.rid_rank = rid_ranks
        elif order_kind == ORDER_HRRN:  # rids compared as Python compares them, once
            every = ([r.rid for r in reqs] if not self.closed else
                     [r.rid for r in self.pending] + [e[2].rid for e in self.heap])
            self.rid_rank = {rid: j for j, rid in enumerate(sorted(every))}
        self.preempt = order_kind == ORDER_PRIORITY or (order_kind == ORDER_ASK
                                                         and bool(rep.preempt))
        pol = rep.policy
        self.sign, self.threshold = pol.sign, pol.threshold
        self.prio = np.array([r.priority if r is not None else 0 for r in reqs],
                             dtype=np.int64)
        self.preemptions_ = np.zeros(n, dtype=np.int64)
        self.vict = np.zeros(m, dtype=np.int64)
        self.n_preemptions = rep.counters.preemptions
        self.head_h = np.zeros(n_head, dtype=np.int64)
        self.head_ok = np.zeros(n_head, dtype=np.int8)
        self.wtmp = np.zeros(max(n, 1), dtype=np.int64)
        self.wdef = np.zeros(max(n, 1), dtype=np.int8)
        self.scheduled_at = NAN
        self.pass_at = 0.0
        self.n_dec_steps = rep.n_dec_steps
        c = rep.counters
        self.prefill_steps, self.decode_steps = c.prefill_steps, c.decode_steps
        self.prefill_tokens, self.n_retractions = c.prefill_tokens, c.retractions
        self.mixed_steps = c.mixed_steps
        self.busy_s = c.busy_s  # (stall_s: nothing in the coverage stalls)
        self.now = rep.env.now
        self.now_int = type(rep.env.now) is int
        # the feeder (Deployment.run), started at time 0 before the replica
        self.fw = INFINITY
        if not fed:
            self.feeder_next(self.now)

    cdef int grow_cols(self, Py_ssize_t need) except -1:
        """A fleet's replica: room for request numbers up to `need` - 1 in every
        per-request column (doubled; the waiting ring unrolled from its head)."""
        cdef Py_ssize_t n = self.n, m = n * 2, j
        if m < need:
            m = need
        def more(arr, fill):
            out = np.full(m, fill, dtype=np.asarray(arr).dtype)
            out[:n] = arr
            return out
        self.at, self.sent = more(self.at, 0.0), more(self.sent, 0.0)
        self.prompt, self.max_new = more(self.prompt, 0), more(self.max_new, 0)
        self.gen, self.computed = more(self.gen, 0), more(self.computed, 0)
        self.private_, self.retractions = more(self.private_, 0), more(self.retractions, 0)
        self.dec_start, self.eos = more(self.dec_start, -1), more(self.eos, 0)
        self.queue_entry, self.entered = more(self.queue_entry, 0.0), more(self.entered, 0.0)
        self.arrival_work, self.queued = more(self.arrival_work, 0), more(self.queued, 0.0)
        self.lost = more(self.lost, 0.0)
        self.first_admit, self.first_token = more(self.first_admit, NAN), more(self.first_token, NAN)
        self.finish, self.left_batch = more(self.finish, NAN), more(self.left_batch, NAN)
        self.round_start = more(self.round_start, NAN)
        self.prefix, self.cached = more(self.prefix, 0), more(self.cached, 0)
        self.prio, self.preemptions_ = more(self.prio, 0), more(self.preemptions_, 0)
        if self.heads:
            self.head_h, self.head_ok = more(self.head_h, 0), more(self.head_ok, 0)
        if self.order_kind == ORDER_HRRN:
            self.rank, self.hkey = more(self.rank, 0), more(self.hkey, 0.0)
        self.wtmp, self.wdef = more(self.wtmp, 0), more(self.wdef, 0)
        ring = np.zeros(m, dtype=np.int64)
        for j in range(self.w_len):
            ring[j] = self.w_at(j)
        self.wq, self.w_head = ring, 0
        grow = m - n
        self.reqs += [None] * grow
        self.errors += [""] * grow
        self.tok += [None] * grow
        self.node += [None] * grow
        self.matched += [None] * grow
        if self.order_kind == ORDER_ASK:
            self.vcache += [None] * grow
            self.vhead += [_UNSET] * grow
        self.n = m
        return 0

    cdef int take_in(self, double sent, req) except -1:
        """A fleet's replica: a submitted request becomes request number in_hi."""
        cdef Py_ssize_t i = self.in_hi
        if i >= self.n:
            self.grow_cols(i + 1)
        self.set_request(i, sent, sent, req)
        self.in_hi = i + 1
        return 0

    cdef inline int set_request(self, Py_ssize_t i, double at, double sent, req) except -1:
        """Request number i's columns from the scheduler's arrival, the send and the
        request."""
        self.at[i] = at
        self.sent[i] = sent
        self.reqs[i] = req
        self.prompt[i] = req.prompt_tokens
        self.max_new[i] = req.output_tokens
        self.prio[i] = req.priority
        return 0

    def __dealloc__(self):
        free(self.scratch)
        free(self.slots)
        free(self.pf)
        free(self.joined)
        free(self.kstore)

    # ---- the step-time memo, read from C ---------------------------------------------
    cdef const double* block_at(self, long long b, long long r, long long q,
                                Py_ssize_t lo, Py_ssize_t hi) except? NULL:
        """The memo's block (b, r, q) (twin/perf/step_cache.py `StepTimeCache._block`),
        BLOCK step times of which at least [lo, hi) are there (a block computed here
        from a decode kernel is filled as runs read it: one range grown at either end);
        NULL where the memo has none (beyond `quiet`)."""
        cdef Py_ssize_t h = <Py_ssize_t>(((b * H1) ^ (r * H2) ^ (q * 97)) & (N_SLOTS - 1))
        cdef Slot* sl = &self.slots[h]
        cdef const double[::1] mv
        cdef Kernel kn
        cdef long long start = r + b * q * BLOCK
        cdef double* out
        if sl.data != NULL and sl.b == b and sl.r == r and sl.q == q:
            if sl.lo <= lo and hi <= sl.hi:
                return sl.data
            kn = <Kernel>self.kernels[b]  # (a Python block is whole: only these grow)
            out = self.kstore + h * BLOCK
            kn.fill(out, start, b, lo, sl.lo)
            kn.fill(out, start, b, sl.hi, hi)
            if lo < sl.lo:
                sl.lo = lo
            if hi > sl.hi:
                sl.hi = hi
            return sl.data
        if self.kernel_ok:  # computed here, as StepTimeCache._block would ask the backend
            got = self.kernels.get(b, _NO_KERNEL)
            if got is _NO_KERNEL:
                got = self.kernels[b] = decode_kernel(self.cache.st, b)
            if got is not None:
                kn = <Kernel>got
                if <double>(start + b * (BLOCK - 1)) / <double>b > self.quiet:
                    return NULL
                out = self.kstore + h * BLOCK
                kn.fill(out, start, b, lo, hi)
                self.slot_ref[h] = None
                sl.b, sl.r, sl.q, sl.data, sl.lo, sl.hi = b, r, q, out, lo, hi
                return out
        blk = self.blocks.get((b, r, q))
        if blk is None:
            blk = self.cache._block(b, r, q)
            if blk is None:
                return NULL
        if blk.dtype != np.float64 or blk.shape[0] != BLOCK:
            raise RuntimeError(f"the typed core: a memo block of {blk.shape[0]} "
                               f"{blk.dtype} step times, {BLOCK} float64 expected")
        mv = blk
        self.slot_ref[h] = blk  # (kept alive here: the memo may clear itself)
        sl.b, sl.r, sl.q, sl.data, sl.lo, sl.hi = b, r, q, &mv[0], 0, BLOCK
        return sl.data

    cdef list chunks(self):
        """The placed prefill chunks, as the step-time model takes them: (ext, computed)."""
        cdef Py_ssize_t j
        return [(self.a_ext[j], self.computed[self.a_req[j]]) for j in range(self.a_n)]

    cdef double prefill_time(self) except? -1.0:
        """`StepTimeCache.prefill(chunks)` of the placed chunks: a step of one chunk from
        the table here, else from the memo (and then kept here while the table is under
        three quarters full)."""
        cdef long long ext = 0, done = 0
        cdef Py_ssize_t h = 0, j
        cdef bint one = self.a_n == 1, got
        cdef double x = 0.0
        if one:
            ext, done = self.a_ext[0], self.computed[self.a_req[0]]
            h = <Py_ssize_t>(((ext * H2) ^ (done * H1)) & (N_PF - 1))
            while self.pf[h].ext1 != 0:
                if self.pf[h].ext1 == ext + 1 and self.pf[h].done == done:
                    return self.pf[h].t
                h = (h + 1) & (N_PF - 1)
        got = False
        if self.pk is not None:  # computed here, as the backend's step_time would
            for j in range(self.a_n):
                self.a_done[j] = self.computed[self.a_req[j]]
            got = self.pk.at(&self.a_ext[0], &self.a_done[0], self.a_n, &x)
        if got:
            t = x
        else:
            chunks = self.chunks()
            t = self.prefill_memo.get(tuple(chunks))
            if t is None:
                t = self.cache.prefill(chunks)
        if one and self.pf_n < N_PF * 3 // 4:
            self.pf[h].ext1, self.pf[h].done, self.pf[h].t = ext + 1, done, t
            self.pf_n += 1
        return t

    # ---- the timeline (Replica._add_ends) ---------------------------------------------
    cdef int tl_new(self) except -1:
        self.tl_cur = np.empty(TL_BLOCK)
        self.tl_view = self.tl_cur
        self.tl_fill = 0
        return 0

    cdef int tl_add(self, const double* ends, Py_ssize_t k) except -1:
        """Append k step ends to the timeline."""
        cdef Py_ssize_t m
        while k > 0:
            if self.tl_fill == TL_BLOCK:  # (a full block is set aside at the next add: the
                self.end_blocks.append(self.tl_cur)  # last run's steps stay in tl_cur)
                self.rep._end_chunks = []  # (a reader's view of the full block goes)
                self.tl_new()
            m = TL_BLOCK - self.tl_fill
            if m > k:
                m = k
            memcpy(&self.tl_view[self.tl_fill], ends, m * sizeof(double))
            self.tl_fill += m
            ends += m
            k -= m
        return 0

    cdef int tl_close(self) except -1:
        """A fleet's replica: the block being filled ends here, so that the next run's
        steps lie in one block (a cut gives its last steps back)."""
        self.end_blocks.append(self.tl_cur[:self.tl_fill])
        self.rep._end_chunks = []
        self.tl_new()
        return 0

    cdef int tl_sync(self) except -1:
        """The replica's timeline lists as a reader expects them (`_parts`)."""
        self.rep._end_chunks = [self.tl_cur[:self.tl_fill]]
        return 0

    cdef double* scratch_for(self, Py_ssize_t n) except NULL:
        if n > self.scratch_cap:
            free(self.scratch)
            self.scratch = NULL
            self.scratch_cap = 0
            self.scratch = <double*>malloc(n * sizeof(double))
            if self.scratch == NULL:
                raise MemoryError()
            self.scratch_cap = n
        return self.scratch

    cdef int emit(self, r) except -1:
        """A leaving request to the replica's `finished`, whose RecordSink reads the
        timeline when this append fills its chunk."""
        if self.sink_chunk and len(self.finished._buf) + 1 >= self.sink_chunk:
            self.tl_sync()  # (a chunk holds back requests: twin/record_sink.py)
        self.finished.append(r)
        self.n_left += 1
        return 0

    # ---- the feed (Deployment.run / pump, Source) -------------------------------------
    cdef inline double next_at(self):
        """`Source.next_time`: the next release's arrival at the scheduler (INFINITY:
        none, for now or for good)."""
        if self.closed:
            return self.heap[0][0] if self.heap else INFINITY
        return self.at[self.in_hi] if self.in_hi < self.n else INFINITY

    cdef int pop_one(self) except -1:
        """`pop_ready`'s next request becomes request number in_hi."""
        cdef Py_ssize_t i = self.in_hi
        if self.closed:
            t, seq, req = heappop(self.heap)
            self.set_request(i, t, self.sent_of.pop(seq, t), req)
        self.in_hi = i + 1
        return 0

    cdef inline bint exhausted(self):
        if self.closed:
            return not self.heap and self.p_next >= len(self.pending)
        return self.in_hi >= self.n

    cdef int fill(self, double now) except -1:
        """`Source._fill`: free clients send their next requests (through the tokenizer's
        queue, one at a time, when the path is on)."""
        cdef double sent, at, start
        while (self.in_flight < self.limit and not self.warm_left
               and self.p_next < len(self.pending)):
            req = self.pending[self.p_next]
            self.pending[self.p_next] = None
            self.p_next += 1
            sent = req.arrival_s + self.offset
            if not sent >= now:  # max(arrival + offset, now)
                sent = now
            self.in_flight += 1
            at = sent
            if self.has_tok:  # Tokenizer.arrival
                start = sent if sent >= self.free_at else self.free_at
                self.free_at = start + (self.per_req + self.per_tok * <double>req.prompt_tokens)
                at = self.free_at + self.latency
                self.sent_of[self.seq] = sent
            heappush(self.heap, (at, self.seq, req))
            self.seq += 1
        return 0

    cdef int released(self, double now) except -1:
        """A request left (Deployment.left -> _finish): its client sends the next one
        when the final chunk is back (`Source.finished`); the waiting feeder is woken
        (`_release_more`)."""
        self.src_finished(now)
        if self.waiting_more and self.heap and not self.resume:
            self.resume = True
            self.resume_t = now
        return 0

    cdef int src_finished(self, double now) except -1:
        """`Source.finished`: a client's slot frees when the final chunk is back; the
        last warm-up back sets the measured requests' offset."""
        cdef double back = now + self.egress
        self.in_flight -= 1
        if self.warm_left:
            self.warm_left -= 1
            if not self.warm_left:
                self.offset = back + BENCH_WARMUP_GAP_S
        self.fill(back)
        return 0

    cdef void feeder_next(self, double f):
        """The feeder at time f decides what it waits for: `timeout(max(nxt - now, 0))`,
        the `_more` event when nothing is released yet (closed loop), or nothing more
        when the source is exhausted or the next send is at or past the horizon."""
        cdef double nxt = self.next_at()
        self.fw = INFINITY
        self.waiting_more = False
        if nxt == INFINITY:
            self.waiting_more = not self.exhausted()
            return
        if self.has_horizon and nxt >= self.horizon:
            return
        self.fw = f + (nxt - f if nxt - f > 0.0 else 0.0)

    cdef inline void feeder_yield(self):
        """The replica yields (a step's sleep, idling): a feeder woken by a leave runs
        now, at the leave's time, on the releases so far."""
        if self.resume:
            self.resume = False
            self.feeder_next(self.resume_t)

    cdef bint feeder_fire(self) except -1:
        """The feeder's wake-up at `fw`: pump what is due; True when it sent anything."""
        cdef double f = self.fw
        cdef Py_ssize_t before = self.in_hi
        while self.next_at() <= f:
            self.pop_one()
        self.feeder_next(f)
        return self.in_hi > before

    cdef int catch_up(self, double now) except -1:
        """Every feeder wake-up at or before `now` happens first (same-time order does
        not change what a pass sees), then the replica's own pump."""
        while self.fw <= now:
            self.feeder_fire()
        while self.next_at() <= now:
            self.pop_one()
        return 0

    # ---- leaving (Replica._leave, _close_tokens, _finish) ------------------------------
    cdef object simreq(self, long long i):
        """The request's SimRequest as the Python replica holds it when it leaves, every
        slot set (built without `__init__`: `head`, the key a policy's view reads, is None,
        as `view_cache` is at a leave: no decision sees the request again). The slots are
        written in `_SLOTS`' order (`set_slot`)."""
        cdef double x
        req = self.reqs[i]
        r = _new(SimRequest)
        set_slot(r, 0, req)
        set_slot(r, 1, req.rid)
        set_slot(r, 2, req.priority)
        set_slot(r, 3, self.sent[i])
        set_slot(r, 4, self.queue_entry[i])
        set_slot(r, 5, self.entered[i])
        set_slot(r, 6, req.prompt_tokens)
        set_slot(r, 7, self.max_new[i])
        set_slot(r, 8, self.gen[i])
        set_slot(r, 9, self.prefix[i])
        set_slot(r, 10, i)
        set_slot(r, 11, self.eos[i] != 0)
        set_slot(r, 12, self.arrival_work[i])
        set_slot(r, 13, None)
        set_slot(r, 14, self.cached[i])
        set_slot(r, 15, self.retractions[i])
        set_slot(r, 16, self.preemptions_[i])
        set_slot(r, 17, "")
        set_slot(r, 18, self.errors[i])
        x = self.first_admit[i]
        set_slot(r, 19, None if isnan(x) else x)
        set_slot(r, 20, self.queued[i])
        x = self.first_token[i]
        set_slot(r, 21, None if isnan(x) else x)
        set_slot(r, 22, None)
        t = self.tok[i]
        set_slot(r, 23, [] if t is None else t)
        set_slot(r, 24, self.dec_start[i])
        set_slot(r, 25, self.node[i])
        set_slot(r, 26, self.computed[i])
        set_slot(r, 27, self.private_[i])
        set_slot(r, 28, self.matched[i])
        x = self.round_start[i]
        set_slot(r, 29, None if isnan(x) else x)
        set_slot(r, 30, 0)
        x = self.left_batch[i]
        set_slot(r, 31, None if isnan(x) else x)
        set_slot(r, 32, self.lost[i])
        set_slot(r, 33, 0.0)
        set_slot(r, 34, None)
        return r

    cdef void close_tokens(self, long long i):
        if self.dec_start[i] >= 0:
            t = self.tok[i]
            if t is None:
                t = self.tok[i] = []
            t.append((self.dec_start[i], self.n_dec_steps))
            self.dec_start[i] = -1

    cdef int leave(self, long long i, str status, str error) except -1:
        r = self.simreq(i)
        if self.vcache is not None:
            self.vcache[i] = None
        self.tok[i] = None  # the request's now (the sink drops it once written)
        r.status, r.error = status, error
        r.finish_s = self.finish[i] if not isnan(self.finish[i]) else self.now
        self.out(r)
        if self.closed:
            self.released(self.now)
        return 0

    cdef int out(self, r) except -1:
        """`_leave`'s hand-over: to `finished`, and in a fleet to the deployment (whose
        record sink may read this replica's timeline now)."""
        self.emit(r)
        if self.fed:
            self.tl_sync()
            self.feed.left(self.rep, r)
        return 0

    cdef int finish_one(self, long long i, double now) except -1:
        """`_finish`: the finished sequence enters the radix cache (its outputs as a
        segment of their own), the rest of its KV is freed."""
        cdef long long out_kv, moved = 0
        self.close_tokens(i)
        if self.has_tree and self.private_[i] > 0:
            out_kv = self.gen[i] - 1  # the last token never enters the KV cache
            segs = self.reqs[i].segments
            if out_kv > 0:
                segs = segs + ((-(i + 1), out_kv),)
            self.tree.insert_(segs, now, &moved)  # the cache takes over the slots made
            self.private_[i] -= moved
        self.release_kv(i)
        self.finish[i] = now
        self.leave(i, "ok", self.errors[i])
        return 0

    # ---- arrivals (Replica._pull_arrivals, _seen_by, _validate) ------------------------
    cdef int pull(self, double now) except -1:
        cdef Py_ssize_t lo, hi, take, i
        cdef double cutoff = self.scheduled_at, recv
        cdef long long room
        if self.fed:  # Replica._pull_arrivals: the deployment pumps, submits fill the inbox
            self.feed.pump(self.now_obj)
            inbox = self.rep._inbox
            if inbox:
                self.rep._inbox = []
                for sent, req in inbox:
                    self.take_in(sent, req)
        else:
            self.catch_up(now)
        self.scheduled_at = NAN
        self.pass_at = now
        lo, hi = self.in_lo, self.in_hi
        if lo == hi:
            self.known = 0
            return 0
        take = hi - lo
        if self.overlap and not isnan(cutoff):
            if self.known < take:
                take = self.known
        if self.overlap:
            self.known = (hi - lo) - take
        recv = now if isnan(cutoff) else cutoff
        self.in_lo = lo + take
        for i in range(lo, lo + take):
            self.queue_entry[i] = recv
            self.entered[i] = recv
            self.arrival_work[i] = self.prefill_tokens
            req = self.reqs[i]
            e = req.ignore_eos
            self.eos[i] = (self.run_eos if e is None else bool(e))
            if self.prompt[i] >= self.max_req_input:
                cap = self.cap
                self.leave(i, "rejected", f"prompt of {self.prompt[i]} tokens exceeds SGLang's "
                           f"max_req_input_len {cap.max_req_input_len} (context_len "
                           f"{cap.context_len}, max_total_num_tokens "
                           f"{cap.max_total_num_tokens})")
                continue
            room = self.max_req_len - self.prompt[i] - 1
            if self.max_new[i] > room:
                self.errors[i] = (f"max_new_tokens clipped by SGLang from {self.max_new[i]} to "
                                  f"{room} (max_req_len {self.max_req_len})")
                self.max_new[i] = room
            if self.order_kind == ORDER_HRRN:
                self.rank[i] = self.rid_rank[req.rid]
            if self.heads:
                h = head_key(req.segments)
                if h is not None:
                    self.head_h[i] = h
                    self.head_ok[i] = 1
            self.w_append(i)
        return 0

    cdef inline void w_append(self, long long i):
        cdef Py_ssize_t cap = self.wq.shape[0]
        self.wq[(self.w_head + self.w_len) % cap] = i
        self.w_len += 1

    cdef inline long long w_at(self, Py_ssize_t j):
        return self.wq[(self.w_head + j) % self.wq.shape[0]]

    # ---- memory -----------------------------------------------------------------------
    cdef inline long long evictable(self):
        if self.has_tree:
            return self.tree.evictable_tokens
        return 0

    cdef inline long long room(self):
        """`Replica.room`: free, evictable cached tokens, less what the overlap holds."""
        if self.has_tree:
            return self.capacity - self.used + self.tree.evictable_tokens - self.fl_tokens
        return self.capacity - self.used - self.fl_tokens

    cdef inline int evict(self, long long n) except -1:
        """`RadixCache.evict`, its nodes' tokens freed (the replica's `on_evict`)."""
        self.used -= self.tree.evict_(n)
        return 0

    cdef int release_kv(self, long long i) except -1:
        """`_release_kv`: the request's own KV freed, its radix lock released."""
        self.used -= self.private_[i]
        self.private_[i] = 0
        self.unlock(i)
        return 0

    cdef inline int unlock(self, long long i) except -1:
        nd = self.node[i]
        if nd is not None:
            self.tree.unlock_(<CNode>nd)
            self.node[i] = None
        return 0

    cdef int match(self, long long i) except -1:
        """`_match`: the longest cached prefix of the prompt, at least one token left to
        compute."""
        cdef long long n, fill
        nd = self.tree.match_(self.reqs[i].segments, self.now, &n)
        fill = self.prompt[i] + self.gen[i] - 1
        self.prefix[i] = n if n < fill else fill
        self.matched[i] = nd
        return 0

    cdef int cache_in(self, long long i, tuple segs, long long own, double now) except -1:
        """The request's `own` tokens of `segs` pass to the radix cache (what another
        request cached meanwhile is freed as a duplicate); it locks the deeper path."""
        cdef long long moved
        cdef CNode nd = self.tree.insert_(segs, now, &moved)
        self.used -= own - moved  # alloc.free_tokens of the duplicate
        self.private_[i] -= own
        old = self.node[i]
        self.tree.lock_(nd)
        self.node[i] = nd
        if old is not None:
            self.tree.unlock_(<CNode>old)
        return 0

    cdef int cache_chunk(self, long long i, double now) except -1:
        """twin/chunk_cache.py `cache_chunk`: the whole segments computed so far."""
        cdef long long end = 0, t, done = self.computed[i]
        segs = []
        for seg in self.reqs[i].segments:
            t = seg[1]
            if end + t > done:
                break
            segs.append(seg)
            end += t
        if end <= self.prefix[i]:
            return 0
        self.cache_in(i, tuple(segs), end - self.prefix[i], now)
        self.prefix[i] = end
        return 0

    cdef inline bint take_kv(self, long long n) except -1:
        """`_take_kv` on a token pool: cached prefixes evicted (LRU) when short."""
        if n <= 0:
            return True
        if self.has_tree and n > self.capacity - self.used:
            self.evict(n - (self.capacity - self.used))
        if n > self.capacity - self.used:
            self.oom += 1
            return False
        self.used += n
        return True

    cdef int release_to_queue(self, long long i, bint preempted=False) except -1:
        """`_release_to_queue`: a retraction, or a priority preemption."""
        self.close_tokens(i)
        self.release_kv(i)
        self.computed[i] = 0
        self.round_start[i] = NAN
        self.left_batch[i] = self.now
        self.queue_entry[i] = self.now
        self.arrival_work[i] = self.prefill_tokens
        if preempted:
            self.preemptions_[i] += 1
            self.n_preemptions += 1
        else:
            self.retractions[i] += 1
            self.n_retractions += 1
        self.w_append(i)
        return 0

    cdef int make_room(self, long long n) except -1:
        """`_make_room`: retract the first of the fewest generated (longest prompt) until
        n tokens fit."""
        cdef Py_ssize_t j, best
        cdef long long v
        while self.n_run > 0:
            best = 0
            for j in range(1, self.n_run):
                v = self.run_[j]
                if (self.gen[v] < self.gen[self.run_[best]] or self.gen[v] == self.gen[self.run_[best]]
                        and self.prompt[v] > self.prompt[self.run_[best]]):
                    best = j
            v = self.run_[best]
            for j in range(best, self.n_run - 1):
                self.run_[j] = self.run_[j + 1]
            self.n_run -= 1
            self.release_to_queue(v)
            self.shrunk = True
            if self.take_kv(n):
                return 1
        return 1 if self.take_kv(n) else 0

    cdef int retract(self) except -1:
        """`_retract`: the running batch sorted by (generated, -prompt) descending, stable;
        pop the last until the rest can decode a step."""
        cdef Py_ssize_t m = self.n_run, j, k
        cdef long long v, gsum, msum
        cdef bint first = True
        # order = sorted(running, key, reverse=True), stable: an insertion sort that keeps
        # equal keys in running order
        for j in range(m):
            self.tmp[j] = self.run_[j]
        for j in range(1, m):
            v = self.tmp[j]
            k = j - 1
            while k >= 0 and (self.gen[self.tmp[k]] < self.gen[v] or (
                    self.gen[self.tmp[k]] == self.gen[v]
                    and -self.prompt[self.tmp[k]] < -self.prompt[v])):
                self.tmp[k + 1] = self.tmp[k]
                k -= 1
            self.tmp[k + 1] = v
        while first or self.room() // m < 1:
            first = False
            if m == 1:
                m = 0
                v = self.tmp[0]
                self.close_tokens(v)
                self.release_kv(v)
                self.leave(v, "aborted", "KV cache too small to decode even this "
                           "request alone")
                break
            m -= 1
            self.release_to_queue(self.tmp[m])
            if self.has_tree:  # release_req: evict at once what the rest need
                self.evict(m * RETRACT_STEPS)
        # running keeps the members of order, in running order
        k = 0
        for j in range(self.n_run):
            v = self.run_[j]
            if self.in_order(v, m):
                self.run_[k] = v
                k += 1
        self.n_run = k
        self.shrunk = True
        if m:
            gsum = 0
            msum = 0
            for j in range(m):
                gsum += self.gen[self.tmp[j]]
                msum += self.max_new[self.tmp[j]]
            self.ratio = min(1.0, <double>(gsum + RETRACT_STEPS * m) / <double>(msum + 1))
        return 0

    cdef bint in_order(self, long long v, Py_ssize_t m):
        cdef Py_ssize_t j
        for j in range(m):
            if self.tmp[j] == v:
                return True
        return False

    # ---- admission (Replica._schedule_prefill with twin/admission.py's Adder) ----------
    cdef inline double rem_total(self):
        return <double>self.room() - self.a_total_offset

    cdef int a_state(self):
        if self.rem_total() <= 0 or self.room() - self.a_cur_offset <= 0:
            return NO_TOKEN
        if self.a_rem_input <= 0 or (self.has_chunk and self.a_rem_chunk <= 0):
            return OTHER
        return CONTINUE

    cdef inline void a_take(self, long long extend, long long future):
        self.a_total_offset += <double>(extend + future)
        self.a_cur_offset += extend
        self.a_rem_input -= extend
        if self.has_chunk:
            self.a_rem_chunk -= extend

    cdef inline int a_append(self, long long i, long long ext) except -1:
        if self.a_n >= self.a_req.shape[0]:
            raise RuntimeError(f"the typed core: a prefill batch over {self.max_running}")
        self.a_req[self.a_n] = i
        self.a_ext[self.a_n] = ext
        self.a_n += 1
        return 0

    cdef int add_one(self, long long i) except -1:
        cdef long long left = self.max_new[i] - self.gen[i], future, extend, total, trunc
        future = left if left > 0 else 0
        if future > CLIP:
            future = CLIP
        extend = self.prompt[i] + self.gen[i] - self.prefix[i]
        total = extend + future
        if <double>total >= self.rem_total():
            return NO_TOKEN
        if extend >= self.a_rem_input and self.a_n > 0:
            return OTHER
        if self.has_tree:  # the matched path is locked: no longer evictable room
            nd = self.matched[i]
            if nd is not None:
                self.tree.lock_(<CNode>nd)
                self.node[i] = nd
            if <double>total >= self.rem_total():
                self.unlock(i)
                return NO_TOKEN
        if not self.has_chunk or extend <= self.a_rem_chunk:
            self.a_append(i, extend)
            self.a_take(extend, future)
        else:
            trunc = self.a_rem_chunk
            if trunc <= 0 or self.a_continuing:
                self.unlock(i)
                return OTHER
            if self.asks_chunks:  # `first_chunk_limit`: the chunk answer caps the first chunk,
                lim = self.ask_chunk(self.wview(i)).limit  # whose budget the pass then is
                if lim is not None and lim < self.a_rem_chunk:
                    self.a_rem_chunk = lim
                    trunc = lim
            self.a_append(i, trunc)
            self.a_new_chunked = i
            self.a_take(trunc, 0)
        return self.a_state()

    cdef inline bint matches_each(self):
        """Whether admission matches each request it considers (`wants_prefix_match`
        false): all but the cache-aware policies, which matched the whole queue to order
        it (lpm and hrrn only up to 128 waiting)."""
        if self.order_kind == ORDER_SPF or self.order_kind == ORDER_DFS:
            return False
        if self.order_kind == ORDER_ASK:  # as the asked policy's `wants_prefix_match` said
            return not self.ask_matched
        if self.order_kind == ORDER_LPM or self.order_kind == ORDER_HRRN:
            return self.w_len > MATCH_MAX_QUEUE
        return True

    cdef int match_waiting(self) except -1:
        """Every waiting request matched against the radix cache, in queue order (the
        cache-aware orders read the matches; nothing without the cache)."""
        cdef Py_ssize_t j
        if self.has_tree:
            for j in range(self.w_len):
                self.match(self.w_at(j))
        return 0

    cdef bint chunk_parked(self) except -1:
        """`_chunk_parked`: whether this pass is one of the decode-only passes the chunk
        answer asked for before the chunk due; asks the chunk question once per chunk."""
        cdef long long r = self.chunked
        cdef bint parked
        if self.due_i != r or self.due_computed != self.computed[r]:
            plan = self.ask_chunk(self.chunk_view(r))
            self.due_i, self.due_computed = r, self.computed[r]
            self.due_limit = -1 if plan.limit is None else plan.limit
            self.due_park_at = self.n_dec_steps + plan.park
        parked = self.n_run > 0 and self.due_park_at > self.n_dec_steps
        self.park_until = self.due_park_at if parked else 0
        return parked

    cdef object ask_chunk(self, view):
        """`_ask_chunk`: the policy's chunk answer for the request seen as `view`,
        checked."""
        snap = self.snapshot()
        plan = self.policy.chunk(snap, view, self.chunk, 1)
        snap.running.close()
        why = validate_chunk_plan(plan, 1)
        if why:
            raise ServetwinError(f"policy {self.policy.name!r} broke its contract at "
                                 f"t={self.clock()}: chunk question: {why}")
        return plan

    cdef object chunk_view(self, long long i):
        """`_chunked_view`: the chunked request's view, its `prefix_len` the tokens
        computed so far."""
        return dataclasses.replace(self.wview(i), prefix_len=self.computed[i])

    @property
    def has_chunked(self):
        """Whether a prompt is being prefilled in chunks (`Replica.chunked` not None)."""
        return self.chunked >= 0

    cdef bint ask_order(self) except -1:
        """`_order_waiting` asked of Python (ORDER_ASK): the queue matched if the policy
        wants it, then (two or more waiting, or an outside decider) a snapshot of the pass
        to `asker`; its plan applied at once, or True: the question is pending."""
        cdef Py_ssize_t m = self.w_len
        self.ask_matched = self.policy.wants_prefix_match(m)
        if self.ask_matched:
            self.match_waiting()
        if (m < 2 and not self.ask_all) or self.ask_skip:
            return False
        snap = self.snapshot()
        plan = self.asker(snap)
        if type(plan) is not Plan:  # an outside agent answers later (`answer`)
            self.ask_snap = snap
            self.asking = True
            return True
        self.apply_plan(plan)
        snap.running.close()
        return False

    cdef int apply_plan(self, plan) except -1:
        """`_order_waiting`'s end: the queue in the plan's order, its admission limit
        kept for this pass's `schedule_tail`."""
        cdef Py_ssize_t m = self.w_len, j
        order = plan.order
        if len(order) != m:
            raise RuntimeError(f"the typed core: a plan orders {len(order)} of {m} waiting")
        for j in range(m):
            self.wtmp[j] = self.w_at(order[j])
        self.write_queue(m)
        self.admit_n = -1 if plan.admit is None else plan.admit
        return 0

    def answer(self, plan):
        """The pending question's plan (checked by the decider): applied, the pass goes
        on at the next `run`."""
        if not self.asking:
            raise RuntimeError("the typed core: no question is pending")
        self.apply_plan(plan)
        self.ask_snap.running.close()
        self.ask_snap = None
        self.asking = False
        self.resuming = True

    cdef object snapshot(self, object candidate=None, double tokens_needed=0.0):
        """`Replica.snapshot(now, candidate, tokens_needed, lazy=True)` from the
        columns: the waiting views in queue order, the running ones built when first read
        (`CoreRunning`)."""
        cdef Py_ssize_t j
        waiting = tuple([self.wview(self.w_at(j)) for j in range(self.w_len)])
        running = CoreRunning(self, tuple([self.run_[j] for j in range(self.n_run)]),
                              self.ratio)
        return Snapshot(now=self.clock(), waiting=waiting, running=running,
                        kv_free=self.capacity - self.used, kv_evictable=self.evictable(),
                        kv_capacity=self.cap.max_total_num_tokens,
                        new_token_ratio=self.ratio, max_running_requests=self.max_running,
                        processed_tokens=self.prefill_tokens, candidate=candidate,
                        tokens_needed=tokens_needed)

    cdef object clock(self):
        """SimPy's clock as the Python replica reads it: the int 0 at first; in a fleet
        SimPy's own (a numpy float where a delay was one)."""
        return self.now_obj if self.fed else (0 if self.now_int else self.now)

    cdef object head_of(self, long long i):
        """`SimRequest.head`, computed once."""
        h = self.vhead[i]
        if h is _UNSET:
            h = self.vhead[i] = head_key(self.reqs[i].segments)
        return h

    cdef object wview(self, long long i):
        """twin/views.py `view(r, ratio, False)`: a waiting request's view, kept with the
        state it was built from and reused while that is the same."""
        cdef double ft = self.first_token[i]
        nd = self.matched[i]
        first = None if isnan(ft) else ft
        key = (self.queue_entry[i], self.prefix[i], self.max_new[i], self.gen[i], first,
               self.arrival_work[i], nd, nd is not None and (<CNode>nd).parent is None)
        hit = self.vcache[i]
        if hit is not None and hit[0] == key:
            return hit[1]
        req = self.reqs[i]
        v = new_view(req.rid, req.priority, self.sent[i], self.queue_entry[i],
                     self.prompt[i], self.prefix[i], self.max_new[i], self.gen[i],
                     self.eos[i] != 0, 0.0, first, None, self.arrival_work[i],
                     self.head_of(i), prefix_path(nd))
        self.vcache[i] = (key, v)
        return v

    def running_views(self, tuple idx, double ratio):
        """twin/views.py `view(r, ratio, True)` of the running requests `idx`."""
        cdef long long i, left
        cdef double ft, rs
        out = []
        for i in idx:
            ft, rs = self.first_token[i], self.round_start[i]
            left = self.max_new[i] - self.gen[i]
            if left > CLIP:
                left = CLIP
            req = self.reqs[i]
            out.append(new_view(
                req.rid, req.priority, self.sent[i], self.queue_entry[i], self.prompt[i],
                self.prefix[i], self.max_new[i], self.gen[i], self.eos[i] != 0,
                <double>left * (1.0 if self.eos[i] else ratio),
                None if isnan(ft) else ft, None if isnan(rs) else rs,
                self.arrival_work[i], self.head_of(i), ()))
        return tuple(out)

    cdef int order_dfs(self) except -1:
        """SGLang's dfs-weight: every waiting request matched in queue order, then the
        policy's own sort (twin/policy/sglang.py `DFSWeight.sort`, which reads only each
        request's radix path) over their paths."""
        cdef Py_ssize_t m = self.w_len, j
        self.match_waiting()
        if m < 2:
            return 0
        views = [SimpleNamespace(prefix_path=prefix_path(self.matched[self.w_at(j)]))
                 for j in range(m)]
        order = self.policy.sort(SimpleNamespace(waiting=views), set())
        for j in range(m):
            self.wtmp[j] = self.w_at(order[j])
        return self.write_queue(m)

    cdef int order_random(self) except -1:
        """SGLang's random (twin/policy/sglang.py `Random.order`): the queue shuffled by a
        generator seeded from the policy's seed, the pass's time, the prefill tokens so far
        and the queue's rids."""
        cdef Py_ssize_t m = self.w_len, j
        if m < 2:
            return 0
        now = self.clock()  # (in a fleet a numpy float's repr differs from a float's)
        rids = ",".join([self.reqs[self.w_at(j)].rid for j in range(m)])
        idx = list(range(m))
        random.Random(f"{self.seed}:{now!r}:{self.prefill_tokens}:{rids}").shuffle(idx)
        for j in range(m):
            self.wtmp[j] = self.w_at(idx[j])
        return self.write_queue(m)

    cdef int order_keyed(self) except -1:
        """`_order_waiting` for a policy whose order is `keyed_order` by a key: under
        priority scheduling (sign x priority, queue entry), lof's -max_new_tokens; stable
        (an insertion sort: the queue is mostly in order from the last pass)."""
        cdef Py_ssize_t m = self.w_len, j
        if m < 2:
            return 0
        for j in range(m):
            self.wtmp[j] = self.w_at(j)
            self.wdef[j] = 0
        return self.sort_queue(m)

    cdef int sort_queue(self, Py_ssize_t m) except -1:
        """Sort the queue's first m requests (in wtmp, their deferral in wdef) stably by
        the order's key (`after`), an insertion sort (the queue is mostly in order from
        the last pass), and put them back in the queue in that order."""
        cdef Py_ssize_t j, k
        cdef long long v
        cdef bint dv
        for j in range(1, m):
            v = self.wtmp[j]
            dv = self.wdef[j]
            k = j - 1
            while k >= 0 and self.after(self.wtmp[k], self.wdef[k], v, dv):
                self.wtmp[k + 1] = self.wtmp[k]
                self.wdef[k + 1] = self.wdef[k]
                k -= 1
            self.wtmp[k + 1] = v
            self.wdef[k + 1] = dv
        return self.write_queue(m)

    cdef int write_queue(self, Py_ssize_t m) except -1:
        """The queue's first m places from wtmp."""
        cdef Py_ssize_t j, cap = self.wq.shape[0]
        for j in range(m):
            self.wq[(self.w_head + j) % cap] = self.wtmp[j]
        return 0

    cdef inline bint after(self, long long a, bint da, long long b, bint db):
        """Whether request a (deferred: da) sorts after b under the queue's order."""
        cdef int kind = self.order_kind
        if kind == ORDER_LPM:
            return self.lpm_after(a, da, b, db)
        if kind == ORDER_SPF:
            return self.spf_after(a, da, b, db)
        if kind == ORDER_HRRN:
            return self.hrrn_after(a, b)
        return self.key_after(a, b)

    cdef inline bint key_after(self, long long a, long long b):
        """Whether a's key is greater than b's: lof's -max_new_tokens, or priority
        scheduling's (sign x priority, queue entry)."""
        cdef long long ka, kb
        if self.order_kind == ORDER_LOF:
            return self.max_new[a] < self.max_new[b]
        ka, kb = self.sign * self.prio[a], self.sign * self.prio[b]
        if ka != kb:
            return ka > kb
        return self.queue_entry[a] > self.queue_entry[b]

    cdef inline double reservation(self, long long v):
        """twin/policy/base.py `reservation` of running request v."""
        cdef long long left = self.max_new[v] - self.gen[v]
        if left > CLIP:
            left = CLIP
        return <double>left * (1.0 if self.eos[v] else self.ratio)

    cdef bint try_preempt(self, long long i, Py_ssize_t at) except -1:
        """`_try_preempt` for waiting request i (the queue's `at`-th) with SGLang's
        priority victims (twin/policy/base.py `priority_victims`): running requests by
        lowest priority, then newest queue entry, each whose priority is lower than i's by
        more than the threshold, until their reservations cover what i needs; or, asked of
        Python (ORDER_ASK), the policy's victims. They leave the batch in descending
        position, their reservations credited to the budget."""
        cdef long long mx = self.max_new[i], v, cprio = self.prio[i]
        cdef double need
        cdef Py_ssize_t j, k, nv = 0, m = self.n_run
        if self.has_tree:
            self.match(i)
        need = <double>(self.prompt[i] + self.gen[i] - self.prefix[i]
                        + (mx if mx < CLIP else CLIP)) - self.rem_total()
        if m == 0:
            return False
        if self.order_kind == ORDER_ASK:
            return self.ask_victims(at, need)
        # the running batch's positions sorted (stably) by (-sign x priority, -queue entry)
        for j in range(m):
            self.tmp[j] = j
        for j in range(1, m):
            v = self.tmp[j]
            k = j - 1
            while k >= 0 and self.victim_after(self.run_[self.tmp[k]], self.run_[v]):
                self.tmp[k + 1] = self.tmp[k]
                k -= 1
            self.tmp[k + 1] = v
        for j in range(m):
            v = self.run_[self.tmp[j]]
            if <double>((cprio - self.prio[v]) * -self.sign) > self.threshold:
                self.vict[nv] = self.tmp[j]
                nv += 1
                need -= self.reservation(v)
                if need <= 0:
                    break
            else:
                break
        if nv == 0 or need > 0:
            return False
        return self.drop_victims(nv)

    cdef bint ask_victims(self, Py_ssize_t at, double need) except -1:
        """`_try_preempt`'s question to a policy asked of Python: a snapshot with the
        candidate and what it needs; its victims (checked by the decider) dropped."""
        cdef Py_ssize_t j, nv
        snap = self.snapshot(at, need)
        plan = self.asker(snap)
        snap.running.close()
        if type(plan) is not Plan:
            raise RuntimeError("the typed core: a preempt question left pending")
        victims = plan.victims
        nv = len(victims)
        if nv == 0:
            return False
        for j in range(nv):
            self.vict[j] = victims[j]
        return self.drop_victims(nv)

    cdef bint drop_victims(self, Py_ssize_t nv) except -1:
        """The running batch's positions vict[:nv] leave it in descending position:
        popped, their reservations credited to the budget, back to the queue."""
        cdef Py_ssize_t j, k
        cdef long long v
        for j in range(1, nv):
            v = self.vict[j]
            k = j - 1
            while k >= 0 and self.vict[k] < v:
                self.vict[k + 1] = self.vict[k]
                k -= 1
            self.vict[k + 1] = v
        for j in range(nv):
            k = self.vict[j]
            v = self.run_[k]
            while k < self.n_run - 1:
                self.run_[k] = self.run_[k + 1]
                k += 1
            self.n_run -= 1
            self.a_total_offset -= self.reservation(v)
            self.release_to_queue(v, True)
        return True

    cdef inline bint victim_after(self, long long a, long long b):
        """Whether a's key (-sign x priority, -queue entry) is greater than b's."""
        cdef long long ka = -self.sign * self.prio[a], kb = -self.sign * self.prio[b]
        if ka != kb:
            return ka > kb
        return -self.queue_entry[a] > -self.queue_entry[b]

    cdef int mark_deferred(self, Py_ssize_t m) except -1:
        """The queue's first m requests into wtmp, wdef[j] set where SGLang defers
        request j (`in_batch_deferred`): a short match (at most 32 tokens) whose head an
        earlier such request shares."""
        cdef Py_ssize_t j, k
        cdef long long i, v, h
        cdef bint found
        for j in range(m):
            i = self.w_at(j)
            self.wtmp[j] = i
            self.wdef[j] = 0
            if self.prefix[i] > IN_BATCH or not self.head_ok[i]:
                continue
            h = self.head_h[i]
            found = False
            for k in range(j):  # an earlier request with a short match and this head
                v = self.wtmp[k]
                if self.head_ok[v] and self.head_h[v] == h and self.prefix[v] <= IN_BATCH:
                    found = True
                    break
            self.wdef[j] = found
        return 0

    cdef int order_spf(self) except -1:
        """`_order_waiting` under SGLang's shortest-prefill-first (twin/policy/sglang.py
        `ShortestPrefillFirst`): every waiting request matched in queue order, then sorted,
        stably, by (deferred, uncached fill tokens at least 1, queue entry)."""
        cdef Py_ssize_t m = self.w_len
        self.match_waiting()
        if m < 2:
            return 0
        self.mark_deferred(m)
        return self.sort_queue(m)

    cdef inline long long work(self, long long v):
        """twin/policy/sglang.py `prefill_work`: uncached fill tokens, at least 1."""
        cdef long long w = self.prompt[v] + self.gen[v] - self.prefix[v]
        return w if w > 1 else 1

    cdef inline bint spf_after(self, long long a, bint da, long long b, bint db):
        """Whether a's key (deferred, work, queue entry) is greater than b's."""
        cdef long long wa, wb
        if da != db:
            return da
        wa, wb = self.work(a), self.work(b)
        if wa != wb:
            return wa > wb
        return self.queue_entry[a] > self.queue_entry[b]

    cdef long long spf_limit(self, long long i):
        """`ShortestPrefillFirst.chunk_limit` for the chunked request i (page 1): the
        chunk left after reserving room for the shorter waiting requests at the queue's
        head, or -1 for no cap."""
        cdef long long budget = self.a_rem_chunk, remaining, reserved = 0, w
        cdef Py_ssize_t j
        if budget < 2:
            return -1
        remaining = self.prompt[i] + self.gen[i] - self.computed[i]
        for j in range(self.w_len):
            w = self.work(self.w_at(j))
            if w >= remaining or reserved + w > budget - 1:
                break
            reserved += w
        if reserved == 0:
            return -1
        return budget - reserved

    cdef int order_lpm(self) except -1:
        """`_order_waiting` under SGLang's lpm (twin/policy/sglang.py `LPM`): up to 128
        waiting, every one matched in queue order, then sorted, stably, longest cached
        prefix first, the requests whose short match (at most 32 tokens) shares its first
        32 tokens with an earlier such request last (`in_batch_deferred`); above 128 the
        queue stays as it is (fcfs)."""
        cdef Py_ssize_t m = self.w_len
        if m > MATCH_MAX_QUEUE:
            return 0
        self.match_waiting()
        if m < 2:
            return 0
        self.mark_deferred(m)
        if self.order_kind == ORDER_HRRN:
            self.hrrn_keys(m)
        return self.sort_queue(m)

    cdef int hrrn_keys(self, Py_ssize_t m) except -1:
        """HRRN's keys (twin/policy/sglang.py `HRRN`) of the m requests in wtmp/wdef,
        sorted by (key, rid): -waited / uncached prompt tokens, where waited is the
        prefill tokens processed since the request queued; no uncached tokens first
        (-inf), deferred last (inf)."""
        cdef Py_ssize_t j
        cdef long long v, unc, waited
        cdef double key
        for j in range(m):
            v = self.wtmp[j]
            unc = self.prompt[v] - self.prefix[v]
            if self.wdef[j]:
                key = INFINITY
            elif unc <= 0:
                key = -INFINITY
            else:
                waited = self.prefill_tokens - self.arrival_work[v]
                if waited < 0:
                    waited = 0
                key = <double>(-waited) / <double>unc
            self.hkey[v] = key
        return 0

    cdef inline bint hrrn_after(self, long long a, long long b):
        if self.hkey[a] != self.hkey[b]:
            return self.hkey[a] > self.hkey[b]
        return self.rank[a] > self.rank[b]

    cdef inline bint lpm_after(self, long long a, bint da, long long b, bint db):
        """Whether a's key is greater than b's (b moves before a)."""
        if da:
            return not db
        if db:
            return False
        return self.prefix[a] < self.prefix[b]

    cdef double reserved_sum(self):
        """`Adder._reserved_sum`: sum(min(left, clip) * ratio) in running order (1.0 for
        an ignore_eos request), from an int 0."""
        cdef Py_ssize_t j
        cdef long long v, left, isum = 0
        cdef bint all_eos = True
        cdef double s = 0.0
        if self.n_run == 0:
            return 0.0
        for j in range(self.n_run):
            if not self.eos[self.run_[j]]:
                all_eos = False
                break
        if all_eos:  # a sum of whole numbers: exact in any order
            for j in range(self.n_run):
                v = self.run_[j]
                left = self.max_new[v] - self.gen[v]
                isum += left if left < CLIP else CLIP
            return <double>isum
        for j in range(self.n_run):
            v = self.run_[j]
            left = self.max_new[v] - self.gen[v]
            if left > CLIP:
                left = CLIP
            s += <double>left * (1.0 if self.eos[v] else self.ratio)
        return s

    cdef bint schedule(self) except -1:
        """`_schedule_prefill` whole (a fleet's pass: no question is left pending):
        fills a_req/a_ext (a_n of them); False: none."""
        cdef int got = self.schedule_head()
        if got == S_ASKED:
            raise RuntimeError("the typed core: a question left pending in a fleet")
        return got == S_GO and self.schedule_tail()

    cdef int schedule_head(self) except -1:
        """`_schedule_prefill` up to its order question, the queue put in order: S_NONE
        (no batch this pass), S_GO (`schedule_tail` next) or S_ASKED (an outside
        decider's question pending)."""
        cdef Py_ssize_t held
        if self.preempt:
            self.batch_full = False  # SGLang resets it to try preemption each pass
        if self.chunked >= 0:
            self.batch_full = False
            if self.asks_chunks and self.chunk_parked():
                return S_NONE  # a decode-only pass: the chunk sits out, nobody is admitted
        elif self.w_len == 0 or self.batch_full:
            return S_NONE
        held = self.fl_slots
        if self.n_run + held >= self.max_running and self.chunked < 0 and not self.preempt:
            self.batch_full = True
            return S_NONE
        if self.order_kind == ORDER_LPM or self.order_kind == ORDER_HRRN:
            self.order_lpm()
        elif self.order_kind == ORDER_PRIORITY or self.order_kind == ORDER_LOF:
            self.order_keyed()
        elif self.order_kind == ORDER_SPF:
            self.order_spf()
        elif self.order_kind == ORDER_RANDOM:
            self.order_random()
        elif self.order_kind == ORDER_DFS:
            self.order_dfs()
        elif self.order_kind == ORDER_ASK and self.ask_order():
            return S_ASKED
        return S_GO

    cdef bint schedule_tail(self) except -1:
        """The rest of `_schedule_prefill`: admission over the ordered queue (at most
        `admit_n` of it when a plan withholds the rest)."""
        cdef Py_ssize_t j, held = self.fl_slots
        cdef long long i, left, rem, ext, fut, lim, cap, admit = self.admit_n
        cdef bint truncated, had_chunked = self.chunked >= 0
        cdef int res
        cdef Py_ssize_t m0
        self.admit_n = -1
        # --enable-mixed-chunk: the running requests' decode tokens ride in the prefill step
        mixed_bs = self.n_run if self.mixed else 0
        self.a_total_offset = <double>mixed_bs + self.reserved_sum()
        self.a_cur_offset = mixed_bs
        self.a_rem_input = self.max_prefill - mixed_bs
        self.a_rem_chunk = self.chunk - mixed_bs
        self.a_n = 0
        self.a_new_chunked = -1
        self.a_continuing = False
        if self.chunked >= 0:  # Adder.add_chunked(chunked, Replica._chunk_limit)
            i = self.chunked
            left = self.prompt[i] + self.gen[i] - self.computed[i]
            rem = self.a_rem_chunk
            lim = -1  # Replica._chunk_limit: the chunk answer's cap, spf's, the lower
            if self.asks_chunks:  # (the next chunk asks anew)
                if self.due_i == i and self.due_computed == self.computed[i]:
                    lim = self.due_limit
                self.due_i = -1
            if self.cap_chunk and self.has_chunk:
                cap = self.spf_limit(i)
                if cap >= 0 and (lim < 0 or cap < lim):
                    lim = cap
            if lim >= 0 and lim < rem:
                rem = lim
            truncated = self.has_chunk and left > rem
            ext = (left if left < rem else rem) if self.has_chunk else left
            self.a_append(i, ext)
            fut = self.max_new[i] - self.gen[i]
            if fut > CLIP:
                fut = CLIP
            self.a_take(ext, 0 if truncated else fut)
            self.a_continuing = truncated
            self.chunked = i if truncated else -1
        m0 = self.w_len  # (preempted requests join the queue's tail: not this pass's)
        for j in range(m0):
            if admit >= 0 and j >= admit:
                break  # the plan withholds the rest of the queue this pass
            i = self.w_at(j)
            if self.a_n + self.n_run + held >= self.max_running:
                self.batch_full = True
            if self.batch_full:
                if not self.preempt or not self.try_preempt(i, j):
                    break
            if self.has_tree and self.matches_each():
                self.match(i)
            res = self.add_one(i)
            if res != CONTINUE:
                if res == NO_TOKEN:
                    self.batch_full = True
                break
        if self.a_new_chunked >= 0:
            self.chunked = self.a_new_chunked
        if self.a_n == 0:
            return False
        # the admitted are the queue's head (the chunked request, if any, came first)
        j = self.a_n - (1 if had_chunked else 0)
        self.w_head = (self.w_head + j) % self.wq.shape[0]
        self.w_len -= j
        return True

    # ---- prefill (Replica._run_prefill, _prefill_done, _join_running) -------------------
    cdef int run_prefill(self) except -1:
        if self.prefill_pre():
            self.prefill_post(self.now + self.dur)
        return 0

    cdef int prefill_pre(self) except -1:
        """`_run_prefill` up to its step's sleep: 1 when a step runs (`dur` long), 0 when
        none was placed."""
        cdef Py_ssize_t j, m = 0
        cdef long long i, ext, tokens = 0
        cdef double now = self.now, dur
        cdef bint decoders
        self.scheduled_at = self.pass_at if self.overlap else NAN
        # place each (a_req/a_ext are compacted to the placed ones)
        for j in range(self.a_n):
            i = self.a_req[j]
            ext = self.a_ext[j]
            if self.computed[i] == 0:  # a new round: its matched prefix is cached
                self.computed[i] = self.prefix[i]
                self.cached[i] += self.prefix[i]
                if isnan(self.first_admit[i]):
                    self.first_admit[i] = now
                self.queued[i] += now - self.queue_entry[i]
            if not self.take_kv(ext) and not self.make_room(ext):
                if i == self.chunked:
                    self.chunked = -1
                self.release_kv(i)
                self.leave(i, "aborted", "prefill out of memory: the KV pool cannot hold "
                           "the next chunk even after retracting every running request")
                continue
            self.private_[i] += ext
            self.a_req[m] = i
            self.a_ext[m] = ext
            m += 1
        self.a_n = m
        self.placed_any = m > 0
        if m == 0:
            return 0
        # the running batch decodes in this step if its tokens fit (check_decode_mem): a
        # mixed step never retracts
        decoders = self.mixed and self.n_run > 0 and not self.room() < self.n_run
        if decoders and not self.grow(1):
            decoders = False
        for j in range(m):
            tokens += self.a_ext[j]
        self.prefill_tokens += tokens
        if decoders:
            t = self.st.step_time(self.chunks(), [
                self.prompt[self.run_[j]] + self.gen[self.run_[j]] for j in range(self.n_run)])
            self.mixed_steps += 1
        else:
            t = self.prefill_time()
            self.prefill_steps += 1
        dur = <double>t + 0.0
        self.busy_s += dur
        self.feeder_yield()  # the replica sleeps through the step
        self.dur = dur
        self.post_decoders = decoders
        self.in_prefill = True
        return 1

    cdef int prefill_post(self, double end) except -1:
        """The rest of `_run_prefill` once its step ended at `end`."""
        cdef Py_ssize_t j, m = self.a_n
        cdef long long i, before
        cdef bint decoders = self.post_decoders
        self.now = end
        self.now_int = False
        self.in_prefill = False
        if decoders:  # their token from this step (`_advance(decoders, 1)`)
            self.tl_add(&end, 1)
            self.n_dec_steps += 1
            for j in range(self.n_run):
                self.gen[self.run_[j]] += 1
                self.private_[self.run_[j]] += 1
        for j in range(m):
            i = self.a_req[j]
            self.computed[i] += self.a_ext[j]
            if i == self.chunked:
                if self.has_tree:  # SGLang caches the finished chunks
                    self.cache_chunk(i, end)
                continue
            # _prefill_done
            self.gen[i] += 1
            tl = self.tok[i]
            if tl is None:
                tl = self.tok[i] = []
            tl.append(end)
            if isnan(self.first_token[i]):
                self.first_token[i] = end
            if self.has_tree:  # the prompt is cached
                self.cache_in(i, self.reqs[i].segments, self.prompt[i] - self.prefix[i], end)
            if self.max_new[i] - self.gen[i] <= 0:
                self.shrunk = True
                before = self.room()
                self.finish_one(i, end)
                if self.overlap:
                    self.fl_add(1, self.room() - before)
            else:
                self.join_running(i, end)
        if decoders:
            self.finish_done(end)
        return 0

    cdef inline void fl_add(self, long long slots, long long tokens):
        self.fl_next_slots += slots
        self.fl_next_tokens += tokens if tokens > 0 else 0

    cdef inline int join_running(self, long long i, double now) except -1:
        if self.n_run >= self.run_.shape[0]:
            raise RuntimeError(f"the typed core: more than {self.max_running} running")
        self.dec_start[i] = self.n_dec_steps
        self.round_start[i] = now
        if self.vcache is not None:  # its waiting view is not read again (a retracted
            self.vcache[i] = None  # request's state differs when it waits again)
        if not isnan(self.left_batch[i]):
            self.lost[i] += now - self.left_batch[i]
            self.left_batch[i] = NAN
        self.run_[self.n_run] = i
        self.n_run += 1
        return 0

    # ---- decode (Replica._run_decode, _next_boundary, _finish_done) --------------------
    cdef int run_decode(self) except -1:
        if self.decode_pre() == RAN:
            self.decode_post(self.now + self.dur)
        return 0

    cdef int decode_pre(self) except -1:
        """`_run_decode` up to its run's sleep: RAN (`dur` long; `post_done`: the request
        with the fewest tokens left has them all), RAN_CUT (a fleet's run a submit may cut)
        or RETRACTED (no run: the next pass at once)."""
        cdef bint cut, arrivals
        cdef Py_ssize_t b = self.n_run, j, n, kk
        cdef long long i, fewest = 0, left, kv0 = 0, k, k_mem, room
        cdef double now = self.now, limit, t, dur, end_k
        cdef double[::1] tv
        cdef double* ev
        cdef const double* tp
        cdef long long jj, rr, qq, off
        cdef double x
        cdef const double* bp
        cdef const double* bn
        self.scheduled_at = self.pass_at if self.overlap else NAN
        room = self.room()
        k_mem = room // b  # Python's floor division (cdivision off)
        for j in range(b):
            i = self.run_[j]
            left = self.max_new[i] - self.gen[i]
            if j == 0 or left < fewest:
                fewest = left
            kv0 += self.prompt[i] + self.gen[i]
        k = k_mem if k_mem > 1 else 1
        if fewest < k:
            k = fewest
        if self.park_until:  # decode-only passes before a chunk: one step each
            if self.park_until - self.n_dec_steps < k:
                k = self.park_until - self.n_dec_steps
            self.park_until = 0
        # arrivals end the run (`_next_boundary`) unless the batch is full; in a fleet a
        # run may ignore them instead, and a submit cuts it (CutRuns._may_cut)
        arrivals = not self.batch_full or self.preempt
        cut = self.fed and self.cuts and arrivals and b * k <= self.capacity - self.used
        # _next_boundary
        limit = self.next_sample
        if self.has_horizon and self.horizon < limit:
            limit = self.horizon
        if self.overlap and (self.fl_slots or self.fl_tokens) and (
                self.w_len or self.chunked >= 0) and now < limit:
            limit = now
        if self.overlap and self.in_lo < self.in_hi and now < limit:
            limit = now
        if arrivals and not cut:
            if self.fed:
                nxt = self.feed.next_arrival()
                x = INFINITY if nxt is None else nxt
            else:
                x = self.next_at()
            if x < limit:
                limit = x
        tp = NULL
        if <double>(kv0 + b * (k - 1)) / <double>b <= self.quiet:
            # StepTimeCache.run inline where the run lies in one memo block
            jj = kv0 // b
            rr = kv0 % b
            qq = jj // BLOCK
            off = jj % BLOCK
            bp = self.block_at(b, rr, qq, off, off + 1)
            if bp != NULL:
                if k > 1:
                    x = (limit - now) / bp[off]
                    if -4.0e18 < x < 4.0e18:
                        bound = <long long>x + 1
                    else:
                        bound = int(x) + 1
                    if bound < k:
                        k = bound
                if off + k <= BLOCK:
                    tp = self.block_at(b, rr, qq, off, off + k) + off
                    n = k
                elif k <= BLOCK:  # StepTimeCache.decode: the two blocks' steps joined
                    bp = self.block_at(b, rr, qq, off, BLOCK)
                    memcpy(self.joined, bp + off, (BLOCK - off) * sizeof(double))
                    bn = self.block_at(b, rr, qq + 1, 0, off + k - BLOCK)
                    if bn != NULL:
                        memcpy(self.joined + (BLOCK - off), bn,
                               (off + k - BLOCK) * sizeof(double))
                        tp = self.joined
                        n = k
            if tp == NULL:
                times = self.cache.run(b, kv0, k, limit - now)
                k = len(times)
        else:
            times = self.rep._decode_times(b, kv0, k)
            if k > 1:
                bound = int((limit - now) / float(times[0])) + 1
                if bound < k:
                    k = bound
                    times = times[:bound]
        if tp == NULL:
            if times.dtype != np.float64:
                raise RuntimeError(f"the typed core: step times of dtype {times.dtype}, "
                                   "float64 expected")
            tv = np.ascontiguousarray(times)
            n = tv.shape[0]
            tp = &tv[0]
        ev = self.scratch_for(n)
        t = tp[0]
        ev[0] = t
        for j in range(1, n):
            t = t + tp[j]
            ev[j] = t
        for j in range(n):
            ev[j] = ev[j] + now
        if ev[n - 1] > limit:
            kk = search_left(&ev[0], n, limit) + 1
            if kk > n:
                kk = n
            k = kk
        if not self.grow(k):
            return RETRACTED
        if self.fed and self.tl_fill + k > TL_BLOCK:
            if k > TL_BLOCK:
                raise RuntimeError(f"the typed core: a decode run of {k} steps in a fleet "
                                   f"(at most {TL_BLOCK})")
            self.tl_close()
        self.busy0, self.ratio0 = self.busy_s, self.ratio
        self.tl_add(ev, k)
        self.n_dec_steps += k
        end_k = ev[k - 1]
        dur = end_k - now + 0.0
        self.decode_steps += k
        self.busy_s += dur
        t = self.ratio - <double>k * self.decay
        self.ratio = self.min_ratio if self.min_ratio > t else t
        for j in range(b):
            i = self.run_[j]
            self.gen[i] += k
            self.private_[i] += k
        self.feeder_yield()  # the replica sleeps through the run
        self.dur = dur
        self.post_done = k >= fewest
        if cut:
            self.run_t0, self.run_k = now, k
            return RAN_CUT
        return RAN
    
    cdef int decode_post(self, double end) except -1:
        """The rest of `_run_decode` once its run ended at `end`."""
        self.now = end
        self.now_int = False
        if self.post_done:
            self.finish_done(end)
        return 0

    cdef bint grow(self, long long k) except -1:
        """`_grow_decoders(running, k)` on a token pool: k more tokens for each running
        request, cached prefixes evicted when short; False (after SGLang's retraction)
        when even that cannot hold them."""
        cdef long long need = self.n_run * k
        if self.has_tree and need > self.capacity - self.used:
            self.evict(need - (self.capacity - self.used))
        if need > self.capacity - self.used:
            self.oom += 1
            if self.has_tree and self.evictable():
                self.evict(self.evictable())
                if need > self.capacity - self.used:
                    self.oom += 1
                    self.retract()
                    return False
            else:
                self.retract()
                return False
        self.used += need
        return True

    cdef int finish_done(self, double now) except -1:
        cdef Py_ssize_t j, m = 0, nd = 0
        cdef long long i, before
        for j in range(self.n_run):
            i = self.run_[j]
            if self.gen[i] >= self.max_new[i]:
                self.tmp[nd] = i
                nd += 1
            else:
                self.run_[m] = i
                m += 1
        if nd == 0:
            return 0
        self.n_run = m
        self.shrunk = True
        before = self.room()
        for j in range(nd):
            self.finish_one(self.tmp[j], now)
        if self.overlap:
            self.fl_add(nd, self.room() - before)
        return 0

    # ---- observation (Replica._sample) -----------------------------------------------
    cdef int sample(self, double now) except -1:
        cdef object t = now
        if self.now_int:  # SimPy's clock starts as the int 0
            t = 0
        self.series.append((0 if self.now_int else round_to(now, 6), self.n_run,
                            self.w_len, self.used, self.used, self.capacity - self.used,
                            self.tree.total_tokens if self.has_tree else 0,
                            round_to(self.ratio, 4), 0.0, 0.0))
        self.next_sample = (floor(now / self.every) + 1.0) * self.every
        if self.progress is not None:
            self.progress(len(self.finished), t)
        return 0

    # ---- the loop (Replica.run) -------------------------------------------------------
    cdef bint top(self, double now) except -1:
        """The top of a pass: arrivals taken in, the overlap loop's held slots turned, a
        sample due taken; True at the horizon (the run ends), else SGLang's filter of a
        shrunk batch clears batch_is_full."""
        cdef bint freed
        self.pull(now)
        if self.overlap:  # FreedLater.turn
            freed = self.fl_slots != 0 or self.fl_tokens != 0
            self.fl_slots, self.fl_tokens = self.fl_next_slots, self.fl_next_tokens
            self.fl_next_slots = self.fl_next_tokens = 0
            if freed:
                self.batch_full = False
        if now >= self.next_sample:
            self.sample(now)
        if self.has_horizon and now >= self.horizon:
            return True
        if self.shrunk:
            self.shrunk = False
            self.batch_full = False
        return False

    def run(self):
        """The whole run; True when stopped by Ctrl-C (the `stopped` list filled by the
        caller's signal handler), the state then whole between passes. With an outside
        decider (ORDER_ASK) it also returns (False) at a question left pending, `asking`
        set: `answer` it, then `run` again goes on with that pass."""
        cdef double now, wake, f
        cdef Py_ssize_t j
        cdef int got
        # the loop's counters in locals, kept in the core's fields across its returns
        cdef long long passes = self.passes, spins = self.spins
        cdef double same_t = self.same_t
        stopped = self.stopped
        if self.ended or self.asking:
            raise RuntimeError("the typed core: run after its end, or with a question "
                               "pending")
        try:
            while True:
                now = self.now
                if self.resuming:  # the pass whose question was just answered
                    self.resuming = False
                    got = self.schedule_tail()
                else:
                    passes += 1
                    if (passes & 255) == 0:
                        PyErr_CheckSignals()
                        if stopped:
                            return True
                    spins = spins + 1 if now == same_t else 0
                    same_t = now
                    if spins > 100_000:
                        raise RuntimeError(f"scheduler livelock at t={now}: 100,000 passes "
                                           f"without time advancing ({self.w_len} waiting, "
                                           f"{self.n_run} running)")
                    if self.top(now):
                        break
                    got = self.schedule_head()
                    if got == S_ASKED:
                        return False
                    got = got == S_GO and self.schedule_tail()
                if got:
                    self.run_prefill()
                    if not self.placed_any and self.n_run:
                        self.run_decode()
                elif self.n_run:
                    self.run_decode()
                elif self.overlap and (self.fl_slots or self.fl_tokens):  # FreedLater.release
                    self.fl_slots = self.fl_tokens = 0
                    self.batch_full = False
                    continue
                else:
                    self.batch_full = False
                    self.ratio = self.init_ratio
                    if self.in_lo < self.in_hi:
                        continue
                    if self.w_len or self.chunked >= 0:
                        if self.next_at() == INFINITY:  # feed.next_arrival() is None
                            self.reject_stuck()
                            continue
                    elif self.exhausted() and self.n_left == self.in_hi:  # feed.done()
                        break
                    self.feeder_yield()
                    # _idle: until the feeder sends something, or the horizon
                    wake = INFINITY
                    if self.has_horizon:
                        wake = now + (self.horizon - now if self.horizon - now > 0.0 else 0.0)
                    while self.fw < wake:
                        f = self.fw
                        if self.feeder_fire():
                            wake = f
                            break
                    if wake == INFINITY:
                        raise RuntimeError(f"the typed core found nothing to wake an idle "
                                           f"replica at t={now}")
                    self.now = wake
                    self.now_int = False
            self.end()
            self.ended = True
            return False
        finally:
            self.passes, self.spins, self.same_t = passes, spins, same_t
            self.write_back()

    # ---- a fleet's replica, run by SimPy (twin/core.py `life`) --------------------------
    def fleet_pass(self, now_obj):
        """One pass of `Replica.run` at SimPy's time `now_obj`, up to where the replica
        yields: F_PREFILL / F_RUN (sleep `dur`, then `prefill_post` / `decode_post`),
        F_CUT (a run a submit may cut: `cut`), F_IDLE (sleep until a
        submit or the horizon), F_AGAIN (the next pass at once) or F_END (the run ended:
        every request inside has left)."""
        cdef double now = now_obj
        self.now, self.now_obj = now, now_obj
        self.now_int = type(now_obj) is int
        self.spins = self.spins + 1 if now == self.same_t else 0
        self.same_t = now
        if self.spins > 100_000:
            raise RuntimeError(f"scheduler livelock at t={now}: 100,000 passes without time "
                               f"advancing ({self.w_len} waiting, {self.n_run} running)")
        if self.top(now):
            self.end()
            return F_END
        if self.schedule():
            if self.prefill_pre():
                return F_PREFILL
            if not self.placed_any and self.n_run:
                return self.f_decode()
            return F_AGAIN
        if self.n_run:
            return self.f_decode()
        if self.overlap and (self.fl_slots or self.fl_tokens):  # FreedLater.release
            self.fl_slots = self.fl_tokens = 0
            self.batch_full = False
            return F_AGAIN
        self.batch_full = False
        self.ratio = self.init_ratio
        if self.in_lo < self.in_hi:
            return F_AGAIN
        if self.w_len or self.chunked >= 0:
            if self.feed.next_arrival() is None:
                self.reject_stuck()
                return F_AGAIN
        elif self.feed.done():
            self.end()
            return F_END
        return F_IDLE

    cdef int f_decode(self) except -1:
        cdef int got = self.decode_pre()
        if got == RETRACTED:
            return F_AGAIN
        return F_CUT if got == RAN_CUT else F_RUN

    def after_prefill(self, end):
        self.prefill_post(end)

    def after_decode(self, end):
        self.decode_post(end)

    @property
    def sleep_s(self):
        """How long the step or run just planned lasts."""
        return self.dur

    def cut(self, double now):
        """A submit at `now` cuts the run just planned (F_CUT): the steps that end by the
        first step end at or after now are kept, the rest given back (`give_back`);
        answers how long the kept steps still run."""
        cdef Py_ssize_t k = self.run_k
        cdef long long keep = search_left(&self.tl_view[self.tl_fill - k], k, now) + 1
        if keep > k:
            keep = k
        if keep < k:
            self.give_back(keep)
        return self.tl_view[self.tl_fill - 1] - now

    def give_back(self, long long keep):
        """`CutRuns._give_back`: undo the last steps of the run just planned, keeping
        `keep`."""
        cdef long long d = self.run_k - keep, i
        cdef Py_ssize_t j
        cdef double t
        if d <= 0:
            return
        if d > self.tl_fill:
            raise RuntimeError("the typed core: a cut run outside its timeline block")
        for j in range(self.n_run):
            i = self.run_[j]
            self.gen[i] -= d
            self.private_[i] -= d
            self.used -= d
        self.tl_fill -= d
        self.n_dec_steps -= d
        self.decode_steps -= d
        self.busy_s = self.busy0 + (self.tl_view[self.tl_fill - 1] - self.run_t0)
        t = self.ratio0 - <double>keep * self.decay
        self.ratio = self.min_ratio if self.min_ratio > t else t
        self.run_k = keep

    def crash(self, str reason, now_obj):
        """`Replica.crash` at SimPy's `now_obj` (a fault interrupted the replica's process
        where it yielded): the steps that end after now are gone; every request inside
        (running, the chunked one, the queue, a prefill step's batch in flight, then the
        inbox) leaves aborted with the tokens emitted by now; the radix cache empties."""
        cdef double now = now_obj
        cdef Py_ssize_t j, drop = 0
        cdef long long i, keep
        self.now, self.now_obj = now, now_obj
        self.now_int = type(now_obj) is int
        while self.tl_fill > 0 and self.tl_view[self.tl_fill - 1] > now:
            self.tl_fill -= 1  # (a fleet's runs lie in the block being filled: tl_close)
            drop += 1
        self.n_dec_steps -= drop
        keep = self.n_dec_steps
        self.tl_sync()
        live, seen = [], set()
        for j in range(self.n_run):
            live.append(self.run_[j])
        if self.chunked >= 0:
            live.append(self.chunked)
        for j in range(self.w_len):
            live.append(self.w_at(j))
        if self.in_prefill:  # the batch of the step in flight (placed: none has left)
            for j in range(self.a_n):
                live.append(self.a_req[j])
            if self.post_decoders:  # a mixed step's decode tokens, taken before it ran
                self.used -= self.n_run
        self.n_run = self.w_len = 0
        self.chunked = -1
        self.in_prefill = False
        for i in live:
            if i in seen:
                continue
            seen.add(i)
            self.close_tokens(i)
            t = self.tok[i]
            if t:
                self.tok[i] = [(e[0], min(e[1], keep)) if isinstance(e, tuple) else e
                               for e in t if (e[0] < keep if isinstance(e, tuple)
                                              else e <= now)]
            self.release_kv(i)
            self.leave(i, "aborted", reason)
        inbox = self.rep._inbox
        if inbox:
            self.rep._inbox = []
            for sent, req in inbox:
                self.take_in(sent, req)
        for i in range(self.in_lo, self.in_hi):
            r = SimRequest(self.reqs[i], self.sent[i], i)
            r.status, r.error, r.finish_s = "aborted", reason, now_obj
            self.out(r)
        self.in_lo = self.in_hi
        if self.has_tree:
            self.used -= self.tree.evict_(self.tree.total_tokens)

    def restart(self):
        """`Replica.restart`: a fresh scheduler over the emptied pool."""
        self.batch_full = self.shrunk = False
        self.known = 0
        self.scheduled_at = NAN
        self.ratio = self.init_ratio
        self.placed_any = True
        self.fl_slots = self.fl_tokens = self.fl_next_slots = self.fl_next_tokens = 0
        self.same_t, self.spins = -1.0, 0

    def queue_load(self):
        """`len(running) + len(waiting)`: what the fleet's load poller reads."""
        return self.n_run + self.w_len

    def settle(self):
        """The replica's own fields as the Python loop would leave them now."""
        self.write_back()

    cdef int reject_stuck(self) except -1:
        cdef long long i = self.w_at(0)
        cdef long long left = self.max_new[i] - self.gen[i]
        self.w_head = (self.w_head + 1) % self.wq.shape[0]
        self.w_len -= 1
        self.leave(i, "aborted", f"could not be admitted into an idle server: needs "
                   f"{self.prompt[i] + self.gen[i] - self.prefix[i]} + "
                   f"{left if left < CLIP else CLIP} tokens, KV room "
                   f"{self.capacity - self.used + self.evictable()}")
        return 0

    cdef int drain(self) except -1:
        """`Deployment._drain`: every released request popped in turn, each releasing
        its client's next; when the clients' slots are held by requests that never
        leave, the rest are released regardless (`Source.release_rest`)."""
        cdef Py_ssize_t k, j
        cdef long long limit
        cdef double back = self.now + self.egress
        while not self.exhausted():
            k = len(self.heap)
            if k == 0:  # release_rest
                self.warm_left = 0
                limit, self.limit = self.limit, 1 << 62
                self.fill(back)
                self.limit = limit
                continue
            for j in range(k):
                self.pop_one()
            for j in range(k):
                self.src_finished(self.now)
        return 0

    cdef int end(self) except -1:
        """`Replica._end`: what is inside leaves aborted, then what was never taken in."""
        cdef Py_ssize_t j
        cdef long long i
        msg = f"simulation horizon {self.horizon_obj}s reached"
        for j in range(self.n_run):
            i = self.run_[j]
            self.close_tokens(i)
            self.leave(i, "aborted", msg)
        if self.chunked >= 0:
            self.close_tokens(self.chunked)
            self.leave(self.chunked, "aborted", msg)
        for j in range(self.w_len):
            i = self.w_at(j)
            self.close_tokens(i)
            self.leave(i, "aborted", msg)
        self.n_run = self.w_len = 0
        self.chunked = -1
        if self.closed:  # Deployment.unsent: the clients send the rest, in order
            self.drain()
        msg = f"not sent before the horizon {self.horizon_obj}s"
        for i in range(self.in_lo, self.in_hi if self.fed else self.n):
            r = SimRequest(self.reqs[i], self.sent[i], i)
            r.status, r.error, r.finish_s = "aborted", msg, self.now
            self.out(r)
        if self.fed:
            self.in_lo = self.in_hi
        else:
            self.in_lo = self.in_hi = self.n
        return 0

    cdef void write_back(self):
        """The replica's own fields, as the Python loop would leave them."""
        rep = self.rep
        self.tl_sync()
        if self.has_tree:  # the cache the run left (RadixCache's interface, typed)
            rep.tree = self.tree
        if not self.fed:  # (a fleet's clock is SimPy's)
            rep.env._now = self.now
        rep.alloc.used = self.used
        rep.alloc._oom = self.oom
        rep.n_dec_steps = self.n_dec_steps
        rep.new_token_ratio = self.ratio
        rep._next_sample = self.next_sample
        c = rep.counters
        c.prefill_steps, c.decode_steps = self.prefill_steps, self.decode_steps
        c.prefill_tokens, c.retractions = self.prefill_tokens, self.n_retractions
        c.preemptions = self.n_preemptions
        c.mixed_steps = self.mixed_steps
        c.busy_s = self.busy_s
