"""What the compiled loops share (twin/_loopc.pyx, twin/_corec.pyx), inline."""


cdef inline Py_ssize_t search_left(const double* a, Py_ssize_t n, double key) noexcept nogil:
    """numpy's `searchsorted(key, side="left")` on a[:n]: the first i with not a[i] < key."""
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = lo + ((hi - lo) >> 1)
        if a[mid] < key:
            lo = mid + 1
        else:
            hi = mid
    return lo
