"""The cost model through the module (``netagg.model``, as examples/python/cost_model.py
words it) against the same Rust model as ``simulate`` prints it, its refusals, and the
example's reading of netagg-run's link variables."""

import subprocess
import sys

import pytest

import netagg.model
from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples" / "python"))
import cost_model  # noqa: E402


def simulated_models(simulate, workers, rate, delays, tensor_bytes):
    """simulate's analytic figures per delay: {delay: (netagg, ring)}, each a pair of
    seconds and half the last printed digit's worth."""
    command = [simulate, "--workers", str(workers), "--rates", rate, "--delays", ",".join(delays)]
    command += ["--tensor-bytes", str(tensor_bytes)]
    output = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {}
    # | N | link | netagg s | model s | sim/model | ring s | ring model s | ...
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) > 6 and cells[0] == str(workers):
            delay = cells[1].split(", ")[1]
            rows[delay] = (seconds(cells[3]), seconds(cells[6]))
    return rows


def seconds(text):
    """simulate's "94.043 ms" (or µs, s): seconds, and half a unit of its last digit."""
    value, unit = text.split()
    scale = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6}[unit]
    decimals = len(value.split(".")[1]) if "." in value else 0
    return float(value) * scale, 0.5 * 10**-decimals * scale


# The DDP example's gradients (1,074,600 bytes), on links where the rate binds netagg and
# where, at 20 ms, its window does; and the AlexNet-sized model's.
@pytest.mark.parametrize(
    "tensor_bytes, delays, bounds",
    [
        (1_074_600, {"0ns": 0.0, "1ms": 0.001, "20ms": 0.020}, {"link rate", "window"}),
        (17_444_136, {"5ms": 0.005}, {"link rate"}),
    ],
    ids=["small", "alexnet"],
)
def test_the_module_gives_the_figures_simulate_prints(bin_dir, tensor_bytes, delays, bounds):
    simulate = bin_dir / "simulate"
    if not simulate.is_file():
        pytest.fail(f"{simulate} is missing: cargo build --release --workspace --bins")
    rows = simulated_models(simulate, 4, "100mbit", ["0" if d == "0ns" else d for d in delays], tensor_bytes)
    assert rows.keys() == delays.keys(), rows
    seen = set()
    for printed, delay in delays.items():
        links = cost_model.Links((100e6,) * 4, delay)
        netagg, bound = cost_model.netagg_seconds(links, tensor_bytes)
        seen.add(bound)
        ring = cost_model.ring_seconds(links, tensor_bytes)
        (rust_netagg, netagg_digit), (rust_ring, ring_digit) = rows[printed]
        assert abs(netagg - rust_netagg) <= netagg_digit, (printed, netagg, rows[printed])
        assert abs(ring - rust_ring) <= ring_digit, (printed, ring, rows[printed])
    assert seen == bounds


def test_the_module_refuses_links_it_cannot_model_naming_the_value():
    with pytest.raises(ValueError, match="rates: give one rate"):
        netagg.model.netagg_seconds([], 0.001, 1 << 20)
    with pytest.raises(ValueError, match="rank 1's link: 0.5 bit/s is not a rate of at least 1 bit/s"):
        netagg.model.ring_seconds([100e6, 0.5], 0.001, 1 << 20)
    with pytest.raises(ValueError, match="delay: -1 s is not a delay"):
        netagg.model.netagg_seconds([100e6], -1.0, 1 << 20)
    # The largest tensor at 1 bit/s: its time does not fit the model's figures (a panic
    # before, raised as PanicException).
    with pytest.raises(ValueError, match="netagg's allreduce of 18446744073709551615 bytes would take"):
        netagg.model.netagg_seconds([1.0] * 2, 0.0, 2**64 - 1)
    with pytest.raises(ValueError, match="the ring's allreduce of 18446744073709551615 bytes would take"):
        netagg.model.ring_seconds([1.0] * 2, 0.0, 2**64 - 1)
    # Packet sizes and windows as the library's configuration takes them.
    with pytest.raises(
        ValueError,
        match=r"packet_numel: configuration: key 'general.packet_numel' = '16364': expected an integer from 1 to 16363",
    ):
        netagg.model.netagg_seconds([100e6], 0.001, 1 << 20, packet_numel=16364)
    with pytest.raises(ValueError, match=r"window_packets: .* 'general.max_outstanding_packets' = '0': expected"):
        netagg.model.netagg_seconds([100e6], 0.001, 1 << 20, window_packets=0)
    with pytest.raises(ValueError, match=r"packet_numel: .* = '-1': expected an integer from 1 to 16363"):
        netagg.model.netagg_seconds([100e6], 0.001, 1 << 20, packet_numel=-1)
    largest, _ = netagg.model.netagg_seconds([100e6], 0.001, 1 << 20, packet_numel=16363)
    assert largest < netagg.model.netagg_seconds([100e6], 0.001, 1 << 20, packet_numel=1)[0]
    # A slower link sets the pace; a smaller window binds on a long path.
    even, _ = netagg.model.netagg_seconds([100e6] * 4, 0.001, 1 << 20)
    uneven, _ = netagg.model.netagg_seconds([100e6] * 3 + [50e6], 0.001, 1 << 20)
    assert 1.9 < uneven / even < 2.0
    assert netagg.model.netagg_seconds([1e9] * 4, 0.010, 16 << 20, window_packets=64)[1] == "window"


def test_netagg_runs_link_variables_are_read_for_the_workers():
    environment = {"EMULATED_LINK_RATES": "100mbit,100mbit,1gbit", "EMULATED_LINK_DELAY": "5000us"}
    assert cost_model.emulated_links(2, environment) == cost_model.Links((100e6, 100e6), 0.005)
    assert cost_model.emulated_links(3, environment).slowest() == 100e6
    assert cost_model.emulated_links(2, {}) is None
    with pytest.raises(ValueError, match="names 3 links, fewer than the 4 workers"):
        cost_model.emulated_links(4, environment)


def test_the_summary_names_the_links_and_both_times():
    model = cost_model.predict(cost_model.Links((100e6,) * 4, 0.001), 1_074_600)
    assert cost_model.summary(model) == (
        "model on 4 links of 100 Mbit/s, 1 ms: a step's gradients take 96.0 ms through netagg "
        "(bound by the link rate), 146.8 ms by a ring"
    )
