# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The scheduler loop's decode pass, compiled (issue 14): `Replica._run_decode`
(twin/replica.py) for SGLang's token pool with the step-time memo, the case every default
run and every fleet takes, and the admission budget's reserved sum
(`Adder._reserved_sum`, twin/admission.py). The Python methods are the specification and
run wherever this module is not built, and wherever it declines (returns None, having
changed nothing): a block allocator, a policy's park or time slice, a step log; an
EOS-stopping request's reservation.

The same floats in the same order: the run's ends are the sequential prefix sum of its
step times plus `now` (numpy's `cumsum`, then `+=`), the first end at or after the limit
found by numpy's binary search, the ratio decays by `k * decay`."""

from cpython.buffer cimport (PyBUF_ANY_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE,
                             PyBuffer_Release, PyObject_GetBuffer)
from cpython.long cimport PyLong_AsLongLong, PyLong_CheckExact, PyLong_FromLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.string cimport memcpy

from twin._search cimport search_left

import numpy as np

from twin.perf.step_cache import BLOCK as _BLOCK
from twin.request_state import SimRequest

cdef long long BLOCK = _BLOCK


# A running request's numbers are read and written in its slots directly (SimRequest has
# __slots__: each is a PyObject* at a fixed offset, which its member descriptor holds).
# Reached through getattr, each costs a type lookup and a descriptor call, and a large
# batch's pass is mostly those. Any other type goes through getattr.
cdef extern from "structmember.h":
    ctypedef struct PyMemberDef:
        const char* name
        int type
        Py_ssize_t offset
        int flags
    int T_OBJECT_EX
    int READONLY

cdef extern from "Python.h":
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member


cdef Py_ssize_t slot_offset(str name) except -1:
    d = SimRequest.__dict__[name]
    if type(d).__name__ != "member_descriptor":
        raise TypeError(f"SimRequest.{name} is not a slot")
    cdef PyMemberDef* m = (<PyMemberDescrObject*><PyObject*>d).d_member
    if m.type != T_OBJECT_EX or m.flags & READONLY:
        raise TypeError(f"SimRequest.{name} is not a writable object slot")
    return m.offset


cdef object SR = None  # None: every request through getattr
cdef Py_ssize_t GEN = 0, MAXNEW = 0, PROMPT = 0, PRIVATE = 0, INDEX = 0, EOS = 0
try:
    EOS = slot_offset("ignore_eos")
    GEN = slot_offset("generated_tokens")
    MAXNEW = slot_offset("max_new_tokens")
    PROMPT = slot_offset("prompt_tokens")
    PRIVATE = slot_offset("private")
    INDEX = slot_offset("index")
    SR = SimRequest
except (KeyError, TypeError):  # SimRequest without these slots: getattr it is
    pass


cdef inline PyObject* slot(object o, Py_ssize_t off):
    """The slot's value, borrowed (NULL: unset)."""
    return (<PyObject**>((<char*><PyObject*>o) + off))[0]


cdef inline object add_k(object o, Py_ssize_t off, str name, long long k):
    """`o.<name> += k`, in the slot when `o` is a SimRequest holding an exact int."""
    cdef PyObject* v
    cdef PyObject** p
    cdef object new
    if type(o) is SR:
        p = <PyObject**>((<char*><PyObject*>o) + off)
        v = p[0]
        if v != NULL and PyLong_CheckExact(<object>v):
            new = PyLong_FromLongLong(PyLong_AsLongLong(<object>v) + k)
            Py_INCREF(new)
            p[0] = <PyObject*>new
            Py_XDECREF(v)
            return None
    setattr(o, name, getattr(o, name) + k)


cdef bint as_doubles(object arr, Py_buffer* buf, int flags) except -1:
    """A C view of `arr` when it holds contiguous float64 ("d"); False otherwise (a
    backend that answers in another dtype goes to the Python code)."""
    try:
        PyObject_GetBuffer(arr, buf, flags | PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT)
    except (BufferError, TypeError, ValueError):
        return False
    if buf.itemsize != 8 or buf.format == NULL or not (
            buf.format[0] == b'd' and buf.format[1] == 0
            or buf.format[0] in b'<=@' and buf.format[1] == b'd' and buf.format[2] == 0):
        PyBuffer_Release(buf)
        return False
    return True


cdef bint grow(object alloc, list owners, long long b, long long k) except -1:
    """`TokenPool.grow_all(owners, k) is not None`, inline."""
    cdef dict held
    if b * k > <long long>alloc.capacity - <long long>alloc.used:
        alloc._oom += 1
        return False
    held = alloc.held
    for o in owners:
        held[o] = held.get(o, 0) + k
    alloc.used += b * k
    return True


cdef object bounded(object span, double first, long long k):
    """`int(span / first) + 1` as Python computes it (None when it would raise)."""
    cdef double x = <double>span / first
    if -4.0e18 < x < 4.0e18:
        return <long long>x + 1
    try:
        return int(span / first) + 1
    except (OverflowError, ValueError, ZeroDivisionError):
        return None


def reserved_sum(list running, long long clip):
    """`Adder._reserved_sum` (twin/admission.py) when every running request has
    `ignore_eos` True and exact-int lengths: float(sum(min(max_new - generated, clip))), the
    same float (a sum of whole numbers below 2**53). None otherwise, for the Python code
    (an empty batch, an EOS-stopping request, another type)."""
    cdef long long total = 0, clipped = 0, top = 0, left
    cdef Py_ssize_t i, b = len(running)
    cdef PyObject* pe
    cdef PyObject* pg
    cdef PyObject* pm
    if b == 0:
        return None
    for i in range(b):
        req = running[i]
        if type(req) is not SR:
            return None
        pe = slot(req, EOS)
        pg = slot(req, GEN)
        pm = slot(req, MAXNEW)
        if (pe == NULL or <object>pe is not True or pg == NULL or pm == NULL
                or not PyLong_CheckExact(<object>pg) or not PyLong_CheckExact(<object>pm)):
            return None
        left = PyLong_AsLongLong(<object>pm) - PyLong_AsLongLong(<object>pg)
        total += left
        clipped += left if left < clip else clip
        if i == 0 or left > top:
            top = left
    if total > 9007199254740992 or total < -9007199254740992:
        return None
    return float(total) if top <= clip else float(clipped)


def decode(rep):
    """One decode pass of `rep` (`Replica._run_decode` up to its sleep): None when the pass
    is outside this code's coverage (nothing changed), False when the step could not be
    charged (requests were retracted; no time passes), else (duration, done), or, for a
    run a submit may cut (a fleet's, twin/decode_cut.py), (duration, done, the steps'
    ends, the busy time and new_token_ratio before the run) for `_wait_or_cut`."""
    cdef list running = rep.running
    cdef Py_ssize_t b = len(running), n, j, kk, i
    cdef long long fewest, kv0, left, k, k_mem, room, bb, q, r_, off
    cdef double now, limit, t, dur, dur_copy, ratio
    cdef Py_buffer tb, eb
    cdef const double* tp
    cdef double* ep = NULL
    cdef double stack[256]
    cdef double end_k
    cdef bint in_block, has_tb
    cdef PyObject* pg
    cdef PyObject* pm
    cdef PyObject* pp
    cdef long long g_
    if b == 0 or not rep._counts_only or rep._park_until or rep.step_log is not None:
        return None
    if rep.slice_s:
        return None
    cache = rep._cache
    st = rep.st
    if cache is None or rep._cache_st is not st:
        return None
    env = rep.env
    now = env._now
    fl = rep.freed_later
    tree = rep.tree
    alloc = rep.alloc
    # room(): free tokens, evictable cached tokens, minus what the overlap loop holds
    room = <long long>alloc.capacity - <long long>alloc.used
    if tree is not None:
        room += <long long>tree.evictable_tokens + <long long>alloc.cache_slack()
    if fl is not None:
        room -= <long long>fl.tokens
    fewest = 0
    kv0 = 0
    for i in range(b):
        req = running[i]
        pg = slot(req, GEN) if type(req) is SR else NULL
        pm = slot(req, MAXNEW) if pg != NULL else NULL
        pp = slot(req, PROMPT) if pm != NULL else NULL
        if (pp != NULL and PyLong_CheckExact(<object>pg) and PyLong_CheckExact(<object>pm)
                and PyLong_CheckExact(<object>pp)):
            g_ = PyLong_AsLongLong(<object>pg)
            left = PyLong_AsLongLong(<object>pm) - g_
            kv0 += PyLong_AsLongLong(<object>pp) + g_
        else:
            g = req.generated_tokens
            left = <long long>(req.max_new_tokens - g)
            kv0 += <long long>(req.prompt_tokens + g)
        if i == 0 or left < fewest:
            fewest = left
    k_mem = room // b if room >= 0 else -((-room + b - 1) // b)  # Python's floor division
    k = k_mem if k_mem > 1 else 1
    if fewest < k:
        k = fewest
    if k < 1:
        return None
    # `_may_cut`: in a fleet a submit may cut the run, which then ignores arrivals
    cut = (rep.feed.cuts_runs and (not rep.batch_full or rep.preempt) and rep._stall == 0
           and b * k <= <long long>alloc.capacity - <long long>alloc.used)
    # `_next_boundary(arrivals=not cut)`
    limit_o = rep._next_sample
    horizon = rep.horizon
    if horizon is not None and horizon < limit_o:
        limit_o = horizon
    if fl is not None and (fl.slots or fl.tokens) and (rep.waiting or rep.chunked is not None):
        if now < limit_o:
            limit_o = now
    if fl is not None and rep._inbox and now < limit_o:
        limit_o = now
    if not cut and (not rep.batch_full or rep.preempt):
        nxt = rep.feed.next_arrival()
        if nxt is not None and nxt < limit_o:
            limit_o = nxt
    limit = limit_o
    span = limit_o - now
    rep._scheduled_at = rep._pass_at if fl is not None else None
    # the run's step times (StepTimeCache.run, or `_decode_times` beyond the memo), then
    # k bounded by the first step (steps only lengthen as KV grows)
    off = 0
    in_block = False
    if <double>(kv0 + b * (k - 1)) / <double>b <= <double>cache.quiet:
        q = (kv0 // b) // BLOCK
        r_ = kv0 % b
        blk = cache._blocks.get((b, r_, q))
        if blk is None:
            blk = cache._block(b, r_, q)
        if blk is not None:
            off = (kv0 // b) % BLOCK
            times = blk
            in_block = True
        else:
            times = st.decode_times(b, np.arange(kv0, kv0 + b * k, b))
    else:
        times = rep._decode_times(b, kv0, k)
    if not as_doubles(times, &tb, 0):
        return None
    has_tb = True
    try:
        tp = <const double*>tb.buf
        n = tb.len // 8 - off
        if n < 1:
            return None
        if k > 1:
            bound = bounded(span, tp[off], k)
            if bound is None:
                return None
            if bound < k:
                k = bound
        if in_block and off + k > BLOCK:  # the run goes past its memo block
            PyBuffer_Release(&tb)
            has_tb = False
            times = cache.decode(b, kv0, k)
            off = 0
            if not as_doubles(times, &tb, 0):
                return None
            has_tb = True
            tp = <const double*>tb.buf
            n = tb.len // 8
        if k < n:
            n = k
        if n < 1:
            return None
        # ends = times.cumsum(); ends += now: the sequential prefix sum, then + now
        if n <= 256:
            ep = &stack[0]
        else:
            ep = <double*>PyMem_Malloc(n * sizeof(double))
        if ep == NULL:
            raise MemoryError()
        t = tp[off]
        ep[0] = t
        for j in range(1, n):
            t = t + tp[off + j]
            ep[j] = t
    finally:
        if has_tb:
            PyBuffer_Release(&tb)
    try:
        for j in range(n):
            ep[j] = ep[j] + now
        kk = n
        if ep[n - 1] > limit:
            kk = search_left(ep, n, limit) + 1
            if kk > n:
                kk = n
        k = kk
        ends = np.empty(k)
        as_doubles(ends, &eb, PyBUF_WRITABLE)
        memcpy(eb.buf, ep, k * sizeof(double))
        PyBuffer_Release(&eb)
        end_k = ep[k - 1]
    finally:
        if ep != &stack[0]:
            PyMem_Free(ep)
    # `_grow_decoders(running, k)` on a token pool
    owners = [<object>slot(req, INDEX) if type(req) is SR and slot(req, INDEX) != NULL
              else req.index for req in running]
    bb = b
    need = bb * k - (<long long>alloc.capacity - <long long>alloc.used)
    if need > 0 and tree is not None:
        tree.evict(need)
    ok = grow(alloc, owners, bb, k)
    if not ok and tree is not None and tree.evictable_tokens:
        tree.evict(tree.evictable_tokens)
        ok = grow(alloc, owners, bb, k)
    if not ok and rep.defrag.enabled:
        rep._compact()
        ok = grow(alloc, owners, bb, k)
    if not ok:
        rep._retract()
        return False
    dur_copy = rep._stall
    c = rep.counters
    busy0, ratio0 = c.busy_s, rep.new_token_ratio
    rep._stall = 0.0
    chunks = rep._end_chunks
    chunks.append(ends)
    if len(chunks) > 4096:
        last = len(chunks) - 1
        rep._end_blocks.append(np.concatenate(chunks[:last]))
        del chunks[:last]
    rep.n_dec_steps += k
    dur = end_k - now + dur_copy
    c.stall_s += dur_copy
    c.decode_steps += k
    c.busy_s += dur
    ratio = <double>rep.new_token_ratio - <double>k * <double>rep.ratio_decay
    min_ratio = rep.min_ratio
    rep.new_token_ratio = min_ratio if min_ratio > ratio else ratio
    for req in running:
        add_k(req, GEN, "generated_tokens", k)
        add_k(req, PRIVATE, "private", k)
    if cut:
        return dur, k >= fewest, ends, busy0, ratio0
    return dur, k >= fewest
