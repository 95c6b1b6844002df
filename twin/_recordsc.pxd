# The records writer's C functions other compiled modules use (twin/_corec.pyx).

cdef double round_to(double x, int digits) except? -1.0
