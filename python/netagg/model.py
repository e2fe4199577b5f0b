"""What a step's gradients should take on given links, from the library's cost model
(the Rust ``netagg::model`` that ``allreduce_benchmark --link-rate`` and ``simulate``
print): through one switch that is the network, and by a bandwidth-optimal ring over TCP.
Every byte a link carries counts: payload, netagg's or TCP's headers, and Ethernet's.

``rates`` holds every worker's link rate in bits per second, ``delay`` the longest
one-way delay in seconds; a value the model cannot take (a rate below 1 bit/s, a time
past its range) raises ValueError naming it::

    seconds, bound = netagg.model.netagg_seconds([100e6] * 4, 0.001, 1 << 20)
    ring = netagg.model.ring_seconds([100e6] * 4, 0.001, 1 << 20)
"""

from ._netagg import netagg_seconds, ring_seconds

__all__ = ["netagg_seconds", "ring_seconds"]
