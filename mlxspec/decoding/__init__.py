"""Decoding over the round loop: the engine (`Engine.stream`, the batch of one of `batch/`),
one request's state and steps, the draft length that pays and the verify-cost curve it is
priced on, and the form the target's weights take.

With batch/, the decoding layer: imports proposers/, suffix/, drafter/ (the heads they draft
with), structured/, markup/, models/ and the leaves; never a front end, the registry or the
server.
"""
