"""What a step's gradients should take on the links a run is on: netagg through one switch
that is the network, and a bandwidth-optimal ring over TCP (gloo's, MPI's).

The figures are the library's cost model (``netagg.model``, the Rust model that
``allreduce_benchmark --link-rate`` and ``simulate`` print); this file only reads the
links and words the result. A step's gradients count as one tensor: DDP's buckets
overlap with backward and with each other, so the model is what the links alone allow,
not a step's time.

Under ``netagg-run --link ...`` each rank's environment names the links
(``EMULATED_LINK_RATES``, one rate per rank, and ``EMULATED_LINK_DELAY``, the longest
one-way delay); :func:`emulated_links` reads them.
"""

import os
from dataclasses import dataclass

import netagg.model


@dataclass(frozen=True)
class Links:
    """Every worker's link: its rate each way in bits per second, by rank, and the
    longest one-way delay in seconds."""

    rates: tuple
    delay: float

    def slowest(self):
        return min(self.rates)

    def describe(self):
        rates = sorted(set(self.rates))
        rate = " to ".join(f"{r / 1e6:g} Mbit/s" for r in rates)
        return f"{len(self.rates)} links of {rate}, {self.delay * 1e3:g} ms"


def parse_rate(text):
    """Bits per second of a rate in tc's units, as netagg-run writes them: 100mbit."""
    lower = text.strip().lower()
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if lower.endswith(unit):
            return float(lower.removesuffix(unit)) * scale
    return float(lower)


def parse_delay(text):
    """Seconds of a delay: 5ms, 250us, 1s, or a plain number of milliseconds."""
    lower = text.strip().lower()
    for unit, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if lower.endswith(unit):
            return float(lower.removesuffix(unit)) * scale
    return float(lower) * 1e-3


def emulated_links(workers, environment=os.environ):
    """The first ``workers`` ranks' links under ``netagg-run --link ...``, or None off
    emulated links (or with unshaped ones)."""
    rates = environment.get("EMULATED_LINK_RATES")
    if not rates:
        return None
    parsed = [parse_rate(rate) for rate in rates.split(",")]
    if len(parsed) < workers:
        raise ValueError(f"EMULATED_LINK_RATES names {len(parsed)} links, fewer than the {workers} workers")
    return Links(tuple(parsed[:workers]), parse_delay(environment.get("EMULATED_LINK_DELAY", "0")))


def netagg_seconds(links, tensor_bytes, packet_numel=None, window_packets=None):
    """netagg's allreduce of ``tensor_bytes`` through one ideal switch, and what bounds
    it: ``"link rate"`` or ``"window"``; the library's defaults for the packet size and
    window unless given."""
    return netagg.model.netagg_seconds(list(links.rates), links.delay, tensor_bytes, packet_numel, window_packets)


def ring_seconds(links, tensor_bytes):
    """A bandwidth-optimal ring's allreduce of ``tensor_bytes`` over TCP: 2(N-1) steps,
    each a chunk of 1/N on the slowest link plus the chunk's path delay."""
    return netagg.model.ring_seconds(list(links.rates), links.delay, tensor_bytes)


def predict(links, tensor_bytes, packet_numel=None, window_packets=None):
    """The model's figures for a step's gradients, as a dict for a run's JSON."""
    netagg, bound = netagg_seconds(links, tensor_bytes, packet_numel, window_packets)
    return {
        "links": links.describe(),
        "netagg_ms": netagg * 1e3,
        "netagg_bound": bound,
        "ring_ms": ring_seconds(links, tensor_bytes) * 1e3,
    }


def summary(model):
    """One line of :func:`predict`'s figures."""
    return (
        f"model on {model['links']}: a step's gradients take {model['netagg_ms']:.1f} ms through netagg "
        f"(bound by the {model['netagg_bound']}), {model['ring_ms']:.1f} ms by a ring"
    )
