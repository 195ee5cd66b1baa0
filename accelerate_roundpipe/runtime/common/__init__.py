"""Primitives every runtime layer uses: thread hand-offs, failure flags, fault injection."""
