# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The records' per-request work, compiled (issue 14; docs/perf.md, "A typed core").

The same functions as twin/record_table.py's Python ones, giving the same values and the
same bytes: `plan_gaps` (a request's token events as gap pieces), `times` (its rounded
times), `window` (the steps a chunk's requests used) and `LineWriter` (the JSON lines of
`requests.jsonl`). The Python code is the specification; tests/test_records_compiled.py
runs both on the same requests and compares. Floats are written by CPython's own
`PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0, NULL)`, the function behind
`float.__repr__`, so a number reads exactly as `json.dumps` writes it, except whole
microseconds (the records' rounded times and gaps), whose digits `put_micros` writes
itself, the same ones (its docstring says why; a test compares); times are rounded by
the builtin `round`, strings escaped by `json`'s own `encode_basestring_ascii` wherever
they are not plain printable ASCII.

Built from Cython's PyPI wheel as an optional extension (setup.py): without a C
compiler the install succeeds and the Python code runs (twin/record_table.py says why).
"""

from libc.math cimport NAN, copysign, fabs, floor, fma, fmod, isinf, isnan, rint, signbit
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy, strlen

import numpy as np

from json.encoder import encode_basestring_ascii as _json_str


cdef extern from "Python.h":
    char* PyOS_double_to_string(double val, char format_code, int precision, int flags,
                                int* ptype) except NULL
    int Py_DTSF_ADD_DOT_0
    void PyMem_Free(void* p)
    bint PyUnicode_IS_ASCII(object o)
    const char* PyUnicode_AsUTF8AndSize(object o, Py_ssize_t* size) except NULL
    long long PyLong_AsLongLongAndOverflow(object o, int* overflow) except? -1
    double PyLong_AsDouble(object o) except? -1.0


_round = round
cdef bytes _NO_IGNORE_EOS = b',"ignore_eos":false'


# ---- growable C arrays -------------------------------------------------------------------
cdef struct Buf:
    char* data
    Py_ssize_t n
    Py_ssize_t cap


cdef int _reserve(void** data, Py_ssize_t* cap, Py_ssize_t need, Py_ssize_t item) except -1:
    cdef Py_ssize_t c = cap[0] * 2
    cdef void* p
    if c < need:
        c = need
    if c < 1024:
        c = 1024
    p = realloc(data[0], c * item)
    if p == NULL:
        raise MemoryError()
    data[0] = p
    cap[0] = c
    return 0


cdef inline int put(Buf* b, const char* s, Py_ssize_t k) except -1:
    if b.n + k > b.cap:
        _reserve(<void**>&b.data, &b.cap, b.n + k, 1)
    memcpy(b.data + b.n, s, k)
    b.n += k
    return 0


cdef inline int put_repr(Buf* b, double x) except -1:
    """repr(x): `put_micros` where it can, else CPython's own."""
    cdef int k
    if b.n + 32 > b.cap:
        _reserve(<void**>&b.data, &b.cap, b.n + 32, 1)
    k = put_micros(b.data + b.n, x)
    if k:
        b.n += k
        return 0
    return put_dtoa(b, x)


# "00" .. "99": two decimal digits per lookup
cdef const char* _PAIRS = (b"00010203040506070809101112131415161718192021222324252627282930313233"
                           b"34353637383940414243444546474849505152535455565758596061626364656667"
                           b"6869707172737475767778798081828384858687888990919293949596979899")


cdef int put_micros(char* out, double x) noexcept nogil:
    """repr(x) written to `out` (room for 32 bytes) when x is a whole number of
    microseconds, the double nearest some K / 10**6, with 1e-4 <= |x| < 2**28: the
    times and gaps the records round to 6 decimals (`round` and `np.round` both give
    that double); its length then, else 0 and nothing written.

    repr gives the shortest decimal that reads back as x (the nearest to x among such).
    K / 10**6, its trailing zeros dropped, reads back as x; any other decimal of as few
    digits would be a multiple of 10**-6 (10**-7 across a power of ten) apart from it by
    more than x's ulp (at most 2**-24 below 2**28), so it cannot read back as x. From
    1e-4 on, repr writes the digits without an exponent."""
    cdef double ax = fabs(x), kd
    cdef unsigned long long k, ip
    cdef unsigned int fp, hi, lo
    cdef int n = 0, j, digits
    cdef char tmp[24]
    if not (ax >= 1e-4 and ax < 268435456.0):  # (NaN fails both)
        return 0
    kd = rint(ax * 1e6)  # K: ax * 1e6 < 2**48, within 1/4 of it
    if kd / 1e6 != ax:  # (IEEE division: the double nearest K / 10**6)
        return 0
    k = <unsigned long long>kd
    ip = k // 1000000
    fp = <unsigned int>(k % 1000000)
    if x < 0:
        out[0] = 45  # '-'
        n = 1
    if ip == 0:  # (the gaps: under a second)
        out[n] = 48
        n += 1
    else:
        j = digits_before(tmp + 24, ip)
        memcpy(out + n, tmp + 24 - j, j)
        n += j
    out[n] = 46  # '.'
    n += 1
    if fp == 0:
        out[n] = 48
        return n + 1
    # the six decimals, two at a time, then the trailing zeros dropped
    hi = fp // 10000
    lo = fp % 10000
    memcpy(out + n, _PAIRS + 2 * hi, 2)
    memcpy(out + n + 2, _PAIRS + 2 * (lo // 100), 2)
    memcpy(out + n + 4, _PAIRS + 2 * (lo % 100), 2)
    digits = 6
    while out[n + digits - 1] == 48:
        digits -= 1
    return n + digits


def micros_repr(double x):
    """`put_micros` to Python: repr(x) as bytes, or None where it does not apply
    (tests/test_records_compiled.py compares it with repr)."""
    cdef char out[32]
    cdef int k = put_micros(out, x)
    return out[:k] if k else None


cdef int put_dtoa(Buf* b, double x) except -1:
    """repr(x), by CPython's own float formatting."""
    cdef char* s = PyOS_double_to_string(x, b'r', 0, Py_DTSF_ADD_DOT_0, NULL)
    try:
        put(b, s, strlen(s))
    finally:
        PyMem_Free(s)
    return 0


cdef int put_num(Buf* b, object x) except -1:
    """A JSON number as `json.dumps` writes a float (twin/record_table.py `_num`)."""
    cdef double d
    if x is None:
        return put(b, "null", 4)
    d = x
    if isnan(d):
        return put(b, "NaN", 3)
    if isinf(d):
        return put(b, "Infinity", 8) if d > 0 else put(b, "-Infinity", 9)
    return put_repr(b, d)


cdef int put_int(Buf* b, object v) except -1:
    """str(int(v))."""
    cdef int overflow = 0
    cdef long long x
    if type(v) is not int:
        v = int(v)
    x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow:
        s = str(v).encode()
        return put(b, s, len(s))
    return put_ll(b, x)


cdef inline int digits_before(char* end, unsigned long long u) noexcept nogil:
    """u's decimal digits written to end[-k:], k returned (at most 20)."""
    cdef int k = 0
    while True:
        k += 1
        end[-k] = <char>(48 + u % 10)
        u //= 10
        if u == 0:
            return k


cdef int put_ll(Buf* b, long long x) except -1:
    """str(x)."""
    cdef unsigned long long u
    cdef char tmp[24]
    cdef int k
    cdef bint neg
    neg = x < 0
    u = <unsigned long long>(-(x + 1)) + 1 if neg else <unsigned long long>x
    k = digits_before(tmp + 24, u)
    if neg:
        k += 1
        tmp[24 - k] = b'-'
    return put(b, tmp + 24 - k, k)


cdef int put_str(Buf* b, object s) except -1:
    """`json.encoder.encode_basestring_ascii(s)`: plain printable ASCII copied as it is."""
    cdef Py_ssize_t k, i
    cdef const char* p
    cdef unsigned char c
    if type(s) is str and PyUnicode_IS_ASCII(s):
        p = PyUnicode_AsUTF8AndSize(s, &k)
        for i in range(k):
            c = <unsigned char>p[i]
            if c < 32 or c > 126 or c == 34 or c == 92:
                break
        else:
            put(b, "\"", 1)
            put(b, p, k)
            return put(b, "\"", 1)
    e = _json_str(s)
    p = PyUnicode_AsUTF8AndSize(e, &k)
    return put(b, p, k)


# ---- token gaps --------------------------------------------------------------------------
cdef struct I64s:
    long long* data
    Py_ssize_t n
    Py_ssize_t cap


cdef struct F64s:
    double* data
    Py_ssize_t n
    Py_ssize_t cap


cdef inline int push_i(I64s* v, long long x) except -1:
    if v.n == v.cap:
        _reserve(<void**>&v.data, &v.cap, v.n + 1, sizeof(long long))
    v.data[v.n] = x
    v.n += 1
    return 0


cdef inline int push_f(F64s* v, double x) except -1:
    if v.n == v.cap:
        _reserve(<void**>&v.data, &v.cap, v.n + 1, sizeof(double))
    v.data[v.n] = x
    v.n += 1
    return 0


cdef object _i64_array(I64s* v):
    out = np.empty(v.n, dtype=np.int64)
    cdef long long[::1] mv = out
    if v.n:
        memcpy(&mv[0], v.data, v.n * sizeof(long long))
    return out


cdef object _f64_array(F64s* v):
    out = np.empty(v.n, dtype=float)
    cdef double[::1] mv = out
    if v.n:
        memcpy(&mv[0], v.data, v.n * sizeof(double))
    return out


def plan_gaps(list reqs_, const double[::1] ends, Py_ssize_t off):
    """twin/record_table.py `plan_gaps` (the `Plan`'s fields, as a tuple)."""
    cdef tuple reqs = tuple(reqs_)
    cdef Py_ssize_t n = len(reqs), i, a, b, m = ends.shape[0]
    cdef long long n_out
    cdef double prev = 0.0, x
    cdef bint has_prev
    cdef I64s start
    cdef I64s length
    cdef F64s braw
    start.data = NULL
    start.n = start.cap = 0
    length.data = NULL
    length.n = length.cap = 0
    braw.data = NULL
    braw.n = braw.cap = 0
    first = np.empty(n + 1, dtype=np.int64)
    nout = np.empty(n, dtype=np.int64)
    cdef long long[::1] fv = first
    cdef long long[::1] ov = nout
    fv[0] = 0
    if off < 0:
        raise ValueError(f"negative step offset {off}")
    try:
        for i in range(n):
            has_prev = False
            n_out = 0
            for ev in reqs[i].tok_events:
                if isinstance(ev, tuple):
                    a, b = ev
                    if b <= a:
                        continue
                    if a < off or b - off > m:
                        raise IndexError(f"token event {ev} outside the steps "
                                         f"{off}..{off + m - 1}")
                    if has_prev:
                        push_i(&start, -1 - braw.n)
                        push_i(&length, 1)
                        push_f(&braw, ends[a - off] - prev)
                    if b - a > 1:
                        push_i(&start, a - off)
                        push_i(&length, b - 1 - a)
                    prev = ends[b - 1 - off]
                    has_prev = True
                    n_out += b - a
                else:
                    x = ev
                    if has_prev:
                        push_i(&start, -1 - braw.n)
                        push_i(&length, 1)
                        push_f(&braw, x - prev)
                    prev = x
                    has_prev = True
                    n_out += 1
            fv[i + 1] = start.n
            ov[i] = n_out
        return first, _i64_array(&start), _i64_array(&length), nout, _f64_array(&braw)
    finally:
        free(start.data)
        free(length.data)
        free(braw.data)


def round_6(double x):
    """`round6` to Python (tests/test_records_compiled.py compares it with round)."""
    return round6(x)


def window(list reqs):
    """twin/record_table.py `step_range`: the steps [lo, hi) that `reqs`' token events use."""
    cdef Py_ssize_t a, b, lo = 0, hi = 0
    cdef bint seen = False
    for r in reqs:
        for ev in r.tok_events:
            if isinstance(ev, tuple):
                a, b = ev
                if b > a:
                    if not seen or a < lo:
                        lo = a
                        seen = True
                    if b > hi:
                        hi = b
    if not seen:
        return 0, 0
    return lo, hi


# ---- rounded times -----------------------------------------------------------------------
cdef double[7] _TENS = [1.0, 10.0, 100.0, 1000.0, 10000.0, 100000.0, 1000000.0]


cdef double round_to(double x, int digits) except? -1.0:
    """round(x, digits) for digits 0..6, exactly as Python's `float.__round__` gives it:
    the integer N nearest |x| * 10**digits (ties to even), from the product and its exact
    error (fma), then N / 10**digits with x's sign: IEEE division rounds it correctly, as
    `float.__round__`'s strtod of "Ne-digits" does, and round half to even is symmetric.
    NaN, infinities, |x| >= 1e9 and other digits go to Python's round itself."""
    cdef double ax = fabs(x), p, e, lo, a, n, scale
    if not (ax < 1e9) or digits < 0 or digits > 6:
        return _round(x, digits)
    scale = _TENS[digits]
    p = ax * scale  # < 2**50: its ulp is at most 1/4
    e = fma(ax, scale, -p)  # ax * scale == p + e exactly, |e| <= ulp(p) / 2 <= 1/8
    lo = floor(p)
    # p - lo is exact (Sterbenz, or lo == 0); so is its difference with 1/2 from 1/4 up, and
    # below 1/4 that difference is under -1/4 whatever its rounding: adding e cannot turn it.
    # The sum of two exact doubles has the sign of the exact sum.
    a = ((p - lo) - 0.5) + e
    if a > 0 or (a == 0 and fmod(lo, 2.0) != 0):
        n = lo + 1
    else:
        n = lo
    return copysign(n / scale, x)


cdef inline double round6(double x) except? -1.0:
    return round_to(x, 6)


def round_digits(double x, int digits):
    """`round_to` to Python (tests/test_records_compiled.py compares it with round)."""
    return round_to(x, digits)


cdef inline object _r(double x):
    return round6(x)


cdef int time_row(tuple cols, double arrival, bint has_ttft, double first, bint ok,
                  double finish, long long n_out, bint admitted, double queued,
                  double lost) except -1:
    """Append one request's rounded times to `cols` (six lists: arrival, TTFT, TPOT, E2E,
    queue and lost seconds, None where the record has null); `finish` read only when
    `ok`, `first` only when `has_ttft`, `queued` only when `admitted`."""
    cdef double ttft = first - arrival if has_ttft else 0.0, e2e
    (<list>cols[0]).append(_r(arrival))
    (<list>cols[1]).append(_r(ttft) if has_ttft else None)
    if ok:
        e2e = finish - arrival
        (<list>cols[2]).append(_r((e2e - ttft) / <double>(n_out - 1)) if n_out > 1 else None)
        (<list>cols[3]).append(_r(e2e))
    else:
        (<list>cols[2]).append(None)
        (<list>cols[3]).append(None)
    (<list>cols[4]).append(_r(queued) if admitted else None)
    (<list>cols[5]).append(_r(lost))
    return 0


def times(list reqs_, const long long[::1] n_out):
    """twin/record_table.py `RecordTable._times`: per request, as the record writes them,
    arrival, TTFT, TPOT, E2E, queue and lost seconds (None where the record has null)."""
    cdef tuple reqs = tuple(reqs_)
    cdef Py_ssize_t i, n = len(reqs)
    cdef bint ok, has_ttft, admitted
    cdef double finish
    cdef tuple cols = ([], [], [], [], [], [])
    if n_out.shape[0] != n:
        raise ValueError(f"{n_out.shape[0]} output counts for {n} records")
    for i in range(n):
        r = reqs[i]
        ok = r.status == "ok"
        fts = r.first_token_s
        has_ttft = fts is not None
        finish = r.finish_s if ok else 0.0  # (an ok request without a finish: TypeError)
        if ok and n_out[i] > 1 and not has_ttft:
            raise TypeError(f"request {r.rid!r}: ok without a first token")
        admitted = r.first_admit_s is not None
        time_row(cols, r.arrival_s, has_ttft, fts if has_ttft else 0.0, ok, finish,
                 n_out[i], admitted, r.queued_s if admitted else 0.0, r.lost_s)
    return cols


def times_of(const double[::1] arrival, const double[::1] first, const double[::1] finish,
             const signed char[::1] status, signed char ok_code,
             const long long[::1] n_out, const double[::1] queued,
             const signed char[::1] admitted, const double[::1] lost):
    """`times` from a chunk's columns (twin/record_table.py `Cols`: NaN there is None):
    the same lists, by the same arithmetic; None where a request is ok without a finish,
    or with tokens after the first without a first token (`times` then raises on its
    attributes, as the Python code does)."""
    cdef Py_ssize_t i, n = arrival.shape[0]
    cdef bint ok, has_ttft
    cdef tuple cols = ([], [], [], [], [], [])
    if not (first.shape[0] == finish.shape[0] == status.shape[0] == n_out.shape[0]
            == queued.shape[0] == admitted.shape[0] == lost.shape[0] == n):
        raise ValueError("times_of: columns of different lengths")
    for i in range(n):
        has_ttft = not isnan(first[i])
        ok = status[i] == ok_code
        if ok and (isnan(finish[i]) or (n_out[i] > 1 and not has_ttft)):
            return None
        time_row(cols, arrival[i], has_ttft, first[i], ok, finish[i], n_out[i],
                 admitted[i] != 0, queued[i], lost[i])
    return cols


# ---- records as dicts ----------------------------------------------------------------------
def records(list reqs, first, start, length, n_out, tuple times, list step_gaps,
            list own_gaps, Py_ssize_t i0, Py_ssize_t i1):
    """twin/record_table.py `RecordTable._record` of requests i0..i1-1, as a list: the
    same dicts (keys in the same order; each token gap the float of `step_gaps` or
    `own_gaps` the Python code takes)."""
    cdef const long long[::1] f1 = first
    cdef const long long[::1] s1 = start
    cdef const long long[::1] l1 = length
    cdef const long long[::1] n1 = n_out
    cdef Py_ssize_t i, k, s, n_steps = len(step_gaps), n_own = len(own_gaps)
    cdef list out = [], itl
    cdef list arrival, ttft, tpot, e2e, queue, lost
    arrival, ttft, tpot, e2e, queue, lost = times
    if not (0 <= i0 <= i1 <= len(reqs)) or f1.shape[0] != len(reqs) + 1 \
            or n1.shape[0] != len(reqs) or s1.shape[0] != l1.shape[0]:
        raise ValueError("records: columns that do not fit together")
    for i in range(i0, i1):
        r = reqs[i]
        itl = []
        for k in range(f1[i], f1[i + 1]):
            s = s1[k]
            if s >= 0:
                if s + l1[k] > n_steps or l1[k] < 0:
                    raise IndexError(f"token gap piece {s}+{l1[k]} beyond {n_steps} steps")
                itl.extend(step_gaps[s:s + l1[k]])
            else:
                if -1 - s >= n_own:
                    raise IndexError(f"boundary gap {-1 - s} beyond {n_own}")
                itl.append(own_gaps[-1 - s])
        rec = {"rid": r.rid, "arrival_s": arrival[i], "prompt_tokens": r.prompt_tokens,
               "cached_tokens": r.cached_tokens, "output_tokens": n1[i],
               "priority": r.priority, "ttft_s": ttft[i], "tpot_s": tpot[i], "itl_s": itl,
               "e2e_s": e2e[i], "queue_s": queue[i], "retractions": r.retractions,
               "preemptions": r.preemptions, "status": r.status, "error": r.error,
               "lost_s": lost[i], "kv_moved_bytes": round(r.moved_bytes)}
        if not r.ignore_eos:
            rec["ignore_eos"] = False
        out.append(rec)
    return out


# ---- requests.jsonl ----------------------------------------------------------------------
def _check_plan(n, first, start, length, n_out, times, n_gaps, n_own, n_uniq, inv):
    """Refuse columns that do not fit together before `block` reads them unchecked."""
    first, start, length = np.asarray(first), np.asarray(start), np.asarray(length)
    if (len(first) != n + 1 or len(n_out) != n or len(start) != len(length)
            or first[0] != 0 or first[n] != len(start) or (np.diff(first) < 0).any()):
        raise ValueError(f"a plan's columns do not fit {n} records: first {len(first)}, "
                         f"n_out {len(n_out)}, start {len(start)}, length {len(length)}")
    if len(times) != 6 or any(len(col) != n for col in times):
        raise ValueError(f"times: 6 columns of {n} expected")
    step = start >= 0
    if step.any() and ((length[step] < 1).any()
                       or (length[step] > n_gaps - start[step]).any()):
        raise ValueError(f"a step piece outside the {n_gaps} step gaps")
    if (~step).any() and (-1 - start[~step] >= n_own).any():
        raise ValueError(f"a boundary piece outside the {n_own} boundary gaps")
    if len(inv) and (np.min(inv) < 0 or np.max(inv) >= n_uniq):
        raise ValueError(f"a step gap's index outside the {n_uniq} distinct gaps")


cdef class LineWriter:
    """The JSON lines of a `RecordTable` (twin/record_table.py `RecordTable.lines`), a block
    of requests at a time: `block(i0, i1)` gives the lines of requests i0..i1-1 as one
    bytes and their lengths."""

    cdef tuple reqs
    cdef const long long[::1] first
    cdef const long long[::1] start
    cdef const long long[::1] length
    cdef const long long[::1] n_out
    cdef const double[::1] own
    cdef tuple times
    cdef char* text  # every step gap's repr and a comma, in the timeline's order (owned)
    cdef bint built  # __init__ ran: it runs once (`block` reads `text` without a copy)
    cdef const long long[::1] text_at  # where step gap g's text starts (and ends: g + 1)
    cdef Buf out  # a block's lines, kept from block to block (no fresh pages each time)
    # the requests' columns (twin/record_table.py `Cols`), where read already: prompt,
    # cached, priority, retractions, preemptions, moved bytes; status code, ignore_eos
    cdef bint cm
    cdef const long long[:, ::1] ci
    cdef const signed char[:, ::1] cf
    cdef list c_rids, c_errors
    cdef tuple statuses

    def __dealloc__(self):
        free(self.out.data)
        free(self.text)

    def __init__(self, list reqs, first, start, length, n_out, times, uniq, inv, own,
                 cols=None, tuple statuses=None):
        """`uniq`, `inv`: the distinct step gaps and each step gap's index among them
        (`RecordTable._step_unique`): each distinct gap is formatted once, and the text of
        every step gap is laid out once, so a request's run of steps is one copy. `inv`
        None: `uniq` is every step gap in turn, each formatted where it stands (a
        timeline without NaN or -0.0, whose distinct values need not be found first)."""
        cdef Buf d, b
        cdef Py_ssize_t j, g, n_gaps
        cdef bint direct = inv is None
        if self.built:
            raise TypeError("a LineWriter is initialized once")
        cdef const double[::1] u = np.ascontiguousarray(uniq, dtype=float)
        cdef const long long[::1] iv = np.ascontiguousarray(
            np.empty(0, dtype=np.int64) if direct else inv, dtype=np.int64)
        cdef tuple rs = tuple(reqs)
        cdef tuple tm = tuple([tuple(c) for c in times])
        cdef const long long[::1] f1 = first
        cdef const long long[::1] s1 = start
        cdef const long long[::1] l1 = length
        cdef const long long[::1] n1 = n_out
        cdef const double[::1] o1 = np.ascontiguousarray(own, dtype=float)
        n_gaps = u.shape[0] if direct else iv.shape[0]
        _check_plan(len(rs), first, start, length, n_out, tm, n_gaps,
                    o1.shape[0], u.shape[0], iv)
        dat = np.empty(u.shape[0] + 1, dtype=np.int64)
        at = np.empty(n_gaps + 1, dtype=np.int64)
        cdef long long[::1] dv = dat
        cdef long long[::1] av = at
        d.data = b.data = NULL
        d.n = d.cap = b.n = b.cap = 0
        try:
            av[0] = 0
            if direct:
                _reserve(<void**>&b.data, &b.cap, 10 * n_gaps + 32, 1)
                for g in range(n_gaps):  # (a run of equal gaps: the first one's text again)
                    if g and u[g] == u[g - 1]:
                        put(&b, b.data + av[g - 1], av[g] - av[g - 1])
                    else:
                        put_repr(&b, u[g])
                        put(&b, ",", 1)
                    av[g + 1] = b.n
            else:
                dv[0] = 0
                for j in range(u.shape[0]):
                    put_repr(&d, u[j])
                    put(&d, ",", 1)
                    dv[j + 1] = d.n
                for g in range(n_gaps):
                    j = iv[g]
                    put(&b, d.data + dv[j], dv[j + 1] - dv[j])
                    av[g + 1] = b.n
            self.text, b.data = b.data, NULL  # (kept as it is: no copy into a bytes)
            self.built = True
        finally:
            free(d.data)
            free(b.data)
        self.cm = cols is not None
        if self.cm:  # (`Cols`; `statuses`: the names of its status codes)
            self.ci = np.ascontiguousarray(np.stack(
                [cols.prompt, cols.cached, cols.priority, cols.retractions,
                 cols.preemptions, cols.moved]), dtype=np.int64)
            self.cf = np.ascontiguousarray(np.stack(
                [cols.status, cols.ignore_eos.view(np.int8)]), dtype=np.int8)
            self.c_rids, self.c_errors = list(cols.rids), list(cols.errors)
            self.statuses = tuple(statuses)
            if (self.ci.shape[1] != len(rs) or len(self.c_rids) != len(rs)
                    or len(self.c_errors) != len(rs)
                    or (len(rs) and (np.min(cols.status) < 0
                                     or np.max(cols.status) >= len(statuses)))):
                raise ValueError(f"columns that do not fit {len(rs)} records")
        self.text_at = at
        self.reqs, self.times = rs, tm
        self.first, self.start, self.length, self.n_out, self.own = f1, s1, l1, n1, o1

    def block(self, Py_ssize_t i0, Py_ssize_t i1, tails=None, into=None):
        """(the lines of requests i0..i1-1, each with its newline; their byte lengths).
        `tails`: per request (from i0), bytes that end its object (a fleet's fields);
        `into`: a file-like object whose `write` takes the lines' bytes instead (a view
        of the writer's own buffer: no bytes object made), the first item then None."""
        cdef Buf b
        cdef Py_ssize_t i, k, g, s, e, line0
        cdef list tl
        cdef const char* text = self.text  # (freed only with the writer: built once)
        cdef tuple reqs = self.reqs
        if not 0 <= i0 <= i1 <= len(reqs):
            raise IndexError(f"block {i0}..{i1} of {len(reqs)} records")
        cdef const long long[::1] first = self.first, start = self.start, length = self.length
        cdef const long long[::1] n_out = self.n_out, text_at = self.text_at
        cdef const double[::1] own = self.own
        if tails is not None:
            tails = list(tails)
            if len(tails) != i1 - i0:
                raise ValueError(f"{len(tails)} tails for {i1 - i0} records")
        cdef tuple arr_c, ttft_c, tpot_c, e2e_c, queue_c, lost_c
        arr_c, ttft_c, tpot_c, e2e_c, queue_c, lost_c = self.times
        cdef bint cm = self.cm
        cdef const long long[:, ::1] ci = self.ci
        cdef const signed char[:, ::1] cf = self.cf
        sizes = np.empty(i1 - i0, dtype=np.int64)
        cdef long long[::1] sv = sizes
        b = self.out  # (its memory: taken back below, however the block ends)
        self.out.data = NULL
        self.out.n = self.out.cap = 0
        b.n = 0
        try:
            for i in range(i0, i1):
                r = reqs[i]
                line0 = b.n
                put(&b, "{\"rid\":", 7)
                put_str(&b, self.c_rids[i] if cm else r.rid)
                put(&b, ",\"arrival_s\":", 13)
                put_num(&b, arr_c[i])
                put(&b, ",\"prompt_tokens\":", 17)
                if cm:
                    put_ll(&b, ci[0, i])
                else:
                    put_int(&b, r.prompt_tokens)
                put(&b, ",\"cached_tokens\":", 17)
                if cm:
                    put_ll(&b, ci[1, i])
                else:
                    put_int(&b, r.cached_tokens)
                put(&b, ",\"output_tokens\":", 17)
                put_ll(&b, n_out[i])
                put(&b, ",\"priority\":", 12)
                if cm:
                    put_ll(&b, ci[2, i])
                else:
                    put_int(&b, r.priority)
                put(&b, ",\"ttft_s\":", 10)
                put_num(&b, ttft_c[i])
                put(&b, ",\"tpot_s\":", 10)
                put_num(&b, tpot_c[i])
                put(&b, ",\"itl_s\":[", 10)
                e = 0  # gaps written so far
                for k in range(first[i], first[i + 1]):
                    s = start[k]
                    if e:
                        put(&b, ",", 1)
                    e += 1
                    if s >= 0:  # step gaps s .. s + length - 1, without the last comma
                        g = s + length[k]
                        put(&b, text + text_at[s], text_at[g] - text_at[s] - 1)
                    else:
                        g = -1 - s
                        put_repr(&b, own[g])
                put(&b, "],\"e2e_s\":", 10)
                put_num(&b, e2e_c[i])
                put(&b, ",\"queue_s\":", 11)
                put_num(&b, queue_c[i])
                put(&b, ",\"retractions\":", 15)
                if cm:
                    put_ll(&b, ci[3, i])
                else:
                    put_int(&b, r.retractions)
                put(&b, ",\"preemptions\":", 15)
                if cm:
                    put_ll(&b, ci[4, i])
                else:
                    put_int(&b, r.preemptions)
                put(&b, ",\"status\":", 10)
                put_str(&b, self.statuses[cf[0, i]] if cm else r.status)
                put(&b, ",\"error\":", 9)
                err = self.c_errors[i] if cm else r.error
                if err is None:
                    put(&b, "null", 4)
                else:
                    put_str(&b, err)
                put(&b, ",\"lost_s\":", 10)
                put_num(&b, lost_c[i])
                put(&b, ",\"kv_moved_bytes\":", 18)
                if cm:
                    put_ll(&b, ci[5, i])
                else:
                    put_int(&b, _round(r.moved_bytes))
                if not (cf[1, i] if cm else r.ignore_eos):
                    put(&b, _NO_IGNORE_EOS, len(_NO_IGNORE_EOS))
                if tails is not None:
                    tl = tails
                    tail = <bytes?>tl[i - i0]
                    put(&b, tail, len(tail))
                put(&b, "}\n", 2)
                sv[i - i0] = b.n - line0
            if into is None:
                return (b.data[:b.n] if b.n else b""), sizes
            if b.n:
                into.write(<unsigned char[:b.n]><unsigned char*>b.data)
            return None, sizes
        finally:
            if self.out.data != NULL:  # (a block formatted meanwhile, by `into.write`)
                free(b.data)
            else:
                self.out = b


# ---- the summary's token gaps ----------------------------------------------------------------
def plain(const double[::1] values):
    """True when no value is NaN or has its sign bit set (-0.0, which equals 0.0 but
    prints apart): then equal values are the same bits and print alike."""
    cdef Py_ssize_t i
    cdef double x
    for i in range(values.shape[0]):
        x = values[i]
        if isnan(x) or signbit(x):
            return False
    return True


def weigh_micros(const double[::1] values, const long long[::1] starts,
                 const long long[::1] lens):
    """How many of the pieces values[s:s + n] ((s, n) of `starts`, `lens`) take each
    value: (the distinct values taken, sorted; how many times each, as floats), or None
    where a value is NaN or has its sign bit set (twin/record_table.py `weighed_gaps`).
    The step gaps are whole microseconds (`np.round(..., 6)`: K / 10**6 for an integer
    K): those below `_DENSE` microseconds are counted by K in an array, the others
    (and any value that is not such a number) sorted by numpy."""
    cdef Py_ssize_t m = values.shape[0], k, g, at = -1, k_lo = _DENSE, k_hi = -1
    cdef long long s, c = 0, run = 0  # run: what the current run of `at` took so far
    cdef double x, kd, prev = 0.0
    if starts.shape[0] != lens.shape[0]:
        raise ValueError(f"{starts.shape[0]} starts for {lens.shape[0]} lengths")
    edge = np.zeros(m + 1, dtype=np.int64)
    cdef long long[::1] ev = edge
    for k in range(starts.shape[0]):
        s = starts[k]
        if s < 0 or lens[k] < 0 or lens[k] > m - s:
            raise ValueError(f"a piece {s}+{lens[k]} outside the {m} values")
        ev[s] += 1
        ev[s + lens[k]] -= 1
    dense = np.zeros(_DENSE, dtype=float)
    cdef double[::1] dv = dense
    cdef F64s ov, ow  # the others: (value, weight) per element taken
    ov.data = ow.data = NULL
    ov.n = ov.cap = ow.n = ow.cap = 0
    try:
        for g in range(m):
            x = values[g]
            if isnan(x) or signbit(x):
                return None
            c += ev[g]
            if c == 0:
                continue
            if at >= 0 and x == prev:  # (a run of equal gaps: the same microsecond,
                run += c               # counted here and added to its counter at the end)
                continue
            if at >= 0:
                dv[at] += <double>run
            kd = rint(x * 1e6)
            if kd < _DENSE and kd / 1e6 == x:
                at = <Py_ssize_t>kd
                prev = x
                run = c
                if at < k_lo:
                    k_lo = at
                if at > k_hi:
                    k_hi = at
            else:
                at = -1
                push_f(&ov, x)
                push_f(&ow, <double>c)
        if at >= 0:
            dv[at] += <double>run
        nz = np.flatnonzero(dense[k_lo:k_hi + 1]) + k_lo if k_hi >= 0 else \
            np.empty(0, dtype=np.intp)  # (only the microseconds taken: not all 2**20)
        u, w = nz / 1e6, dense[nz]  # (K / 10**6: the double np.round gave)
        if ov.n:
            u, inv = np.unique(np.concatenate((u, _f64_array(&ov))), return_inverse=True)
            w = np.bincount(inv, weights=np.concatenate((w, _f64_array(&ow))),
                            minlength=len(u))
        return u, w
    finally:
        free(ov.data)
        free(ow.data)


_DENSE = 1 << 20  # step gaps under ~1.05 s: counted by microsecond


# ---- reading the gaps back ----------------------------------------------------------------
cdef class Gather:
    """twin/record_table.py `_Pieces`: values[s:s + n] for each (s, n) of `starts`, `lens`,
    read in order, `take(k)` elements at a time, each a new array (copied piece by piece:
    no index arrays)."""

    cdef const double[::1] values
    cdef const long long[::1] starts
    cdef const long long[::1] lens
    cdef Py_ssize_t piece, pos  # the next element: offset `pos` in piece `piece`

    def __init__(self, values, starts, lens):
        cdef const double[::1] v = np.ascontiguousarray(values, dtype=float)
        s = np.ascontiguousarray(starts, dtype=np.int64)
        n = np.ascontiguousarray(lens, dtype=np.int64)
        if len(s) != len(n):
            raise ValueError(f"{len(s)} starts for {len(n)} lengths")
        if len(s) and ((s < 0).any() or (n < 0).any() or (n > v.shape[0] - s).any()):
            raise ValueError(f"a piece outside the {v.shape[0]} values")
        self.values, self.starts, self.lens = v, s, n
        self.piece = self.pos = 0

    def take(self, Py_ssize_t k):
        """The next k elements."""
        cdef const double[::1] v = self.values
        cdef const long long[::1] s = self.starts
        cdef const long long[::1] n = self.lens
        cdef Py_ssize_t done = 0, c, m = s.shape[0]
        if k < 0:
            raise ValueError(f"take {k}")
        out = np.empty(k, dtype=float)
        cdef double[::1] o = out
        while done < k:
            if self.piece >= m:
                raise ValueError(f"{k} elements asked, {done} left")
            c = n[self.piece] - self.pos
            if c > k - done:
                c = k - done
            if c > 0:
                memcpy(&o[done], &v[s[self.piece] + self.pos], c * sizeof(double))
            done += c
            self.pos += c
            if self.pos == n[self.piece]:
                self.piece += 1
                self.pos = 0
        return out


# ---- timeseries.csv --------------------------------------------------------------------------
def csv_block(list rows, Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t width=-1,
              bint none_empty=False):
    """`"".join(",".join(map(str, row)) + "\\n" for row in rows[i0:i1])`, UTF-8 encoded:
    floats by repr (which str is), ints as digits, anything else by its own str.
    `width` >= 0: each row cut or padded to that many cells (padding: empty cells);
    `none_empty`: None as an empty cell (a fleet's timeseries.csv, twin/fleet.py)."""
    cdef Buf b
    cdef Py_ssize_t i, j, m
    cdef tuple row
    if not 0 <= i0 <= i1 <= len(rows):
        raise IndexError(f"rows {i0}..{i1} of {len(rows)}")
    b.data = NULL
    b.n = b.cap = 0
    try:
        for i in range(i0, i1):
            row = tuple(rows[i])
            m = len(row) if width < 0 else min(len(row), width)
            for j in range(m):
                if j:
                    put(&b, ",", 1)
                x = row[j]
                if type(x) is float:
                    put_repr(&b, <double>x)
                elif type(x) is int:
                    put_int(&b, x)
                elif x is None and none_empty:
                    pass
                else:
                    s = str(x).encode()
                    put(&b, s, len(s))
            for j in range(m, width):  # (padding)
                if j:
                    put(&b, ",", 1)
            put(&b, "\n", 1)
        return b.data[:b.n] if b.n else b""
    finally:
        free(b.data)


# ---- a chunk's columns -----------------------------------------------------------------------
cdef inline bint _f(object v, double* out, bint none_ok):
    """v as a double into `out` (None: NaN where `none_ok`); False where the columns
    cannot hold it (another type, or a NaN that would read as None)."""
    cdef double d
    if v is None:
        if not none_ok:
            return False
        out[0] = NAN
        return True
    if type(v) is float:
        d = v
    elif type(v) is int:
        try:
            d = v
        except OverflowError:
            return False
    else:
        return False
    if isnan(d):
        return False
    out[0] = d
    return True


cdef inline bint _i(object v, long long* out):
    cdef int overflow = 0
    if type(v) is not int:
        return False
    out[0] = PyLong_AsLongLongAndOverflow(v, &overflow)
    return not overflow


def columns(list reqs_, dict codes):
    """twin/record_table.py `request_columns`: each request's fields the records read, as
    columns, in one pass (`codes`: status -> its code); None where one does not fit them
    (a numpy integer, an int beyond 64 bits, a NaN time, an unknown status): the caller
    then reads the requests' attributes as before."""
    cdef tuple reqs = tuple(reqs_)
    cdef Py_ssize_t i, n = len(reqs)
    cdef double m
    arrival = np.empty(n)
    first = np.empty(n)
    finish = np.empty(n)
    queued = np.empty(n)
    lost = np.empty(n)
    ints = np.empty((7, n), dtype=np.int64)  # index prompt cached priority retr. preempt. moved
    flags = np.empty((3, n), dtype=np.int8)  # status code, ignore_eos, admitted
    cdef double[::1] av = arrival, fv = first, ev = finish, qv = queued, lv = lost
    cdef long long[:, ::1] iv = ints
    cdef signed char[:, ::1] gv = flags
    cdef list rids = [], errors = []
    for i in range(n):
        r = reqs[i]
        code = codes.get(r.status)
        if code is None:
            return None
        gv[0, i] = <signed char><int>code
        mb = r.moved_bytes
        if type(mb) is float:
            m = mb
            if not (fabs(m) < 4.0e18):
                return None
            iv[6, i] = <long long>rint(m)  # round(m): half to even, as rint
        elif not _i(mb, &iv[6, i]):
            return None
        if not (_f(r.arrival_s, &av[i], False) and _f(r.first_token_s, &fv[i], True)
                and _f(r.finish_s, &ev[i], True) and _f(r.queued_s, &qv[i], False)
                and _f(r.lost_s, &lv[i], False) and _i(r.index, &iv[0, i])
                and _i(r.prompt_tokens, &iv[1, i]) and _i(r.cached_tokens, &iv[2, i])
                and _i(r.priority, &iv[3, i]) and _i(r.retractions, &iv[4, i])
                and _i(r.preemptions, &iv[5, i])):
            return None
        eos = r.ignore_eos
        if eos is True:
            gv[1, i] = 1
        elif eos is False:
            gv[1, i] = 0
        else:
            return None
        gv[2, i] = r.first_admit_s is not None
        rids.append(r.rid)
        errors.append(r.error)
    return (arrival, ints[0], flags[0], ints[1], ints[2], ints[3], ints[4], ints[5],
            ints[6], flags[1].astype(bool), first, finish, queued, lost,
            flags[2].astype(bool), rids, errors)


def rows_array(list rows, Py_ssize_t width):
    """`np.asarray(rows, dtype=float).reshape(-1, width)` for rows of `width` Python ints
    and floats (bools too); None where a row is not such a sequence (numpy then)."""
    cdef Py_ssize_t i, j, n = len(rows)
    out = np.empty((n, width))
    cdef double[:, ::1] ov = out
    cdef tuple row
    for i in range(n):
        x = rows[i]
        if type(x) is not tuple:
            return None
        row = <tuple>x
        if len(row) != width:
            return None
        for j in range(width):
            v = row[j]
            if type(v) is float:
                ov[i, j] = <double>v
            elif type(v) is int or type(v) is bool:
                ov[i, j] = PyLong_AsDouble(v)
            else:
                return None
    return out
