//! The cost model of allreduce on given links (`netagg::model`) for Python, as
//! `netagg.model`: what a step's gradients should take through one switch that is the
//! network and by a ring, the figures `allreduce_benchmark --link-rate` and `simulate`
//! print, so that a training script reads its own times against them.

use std::time::Duration;

use netagg::model::{Bound, Link, ModelError, Scenario};
use netagg::Config;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// One ideal switch's scenario: every worker's link at its rate (bits per second), all
/// with the longest one-way delay (seconds). The model checks the rates.
fn scenario(
    rates: &[f64],
    delay: f64,
    tensor_bytes: u64,
    packet_numel: Option<i64>,
    window_packets: Option<i64>,
) -> PyResult<Scenario> {
    if rates.is_empty() {
        return Err(PyValueError::new_err("rates: give one rate (bits per second) per worker"));
    }
    let delay = Duration::try_from_secs_f64(delay)
        .map_err(|_| PyValueError::new_err(format!("delay: {delay} s is not a delay in seconds")))?;
    // The library's own checks of the keys these arguments stand for, and its defaults.
    let mut config = Config::default();
    let arguments = [
        ("packet_numel", "general.packet_numel", packet_numel),
        ("window_packets", "general.max_outstanding_packets", window_packets),
    ];
    for (argument, key, value) in arguments {
        if let Some(value) = value {
            config
                .set(key, &value.to_string())
                .map_err(|error| PyValueError::new_err(format!("{argument}: {error}")))?;
        }
    }
    let (packet_numel, window_packets) =
        (config.general.packet_numel, config.general.max_outstanding_packets);
    let mut scenario = Scenario::uniform(
        rates.len(),
        Link { bits_per_second: rates[0], delay },
        tensor_bytes,
        u64::from(packet_numel) * 4,
        u64::from(window_packets),
    );
    for (link, &rate) in scenario.links.iter_mut().zip(rates) {
        link.bits_per_second = rate;
    }
    Ok(scenario)
}

/// netagg's allreduce of `tensor_bytes` through one switch that is the network: its
/// seconds, and what bounds it, "link rate" or "window". `packet_numel` and
/// `window_packets` default to the library's `general.packet_numel` and
/// `general.max_outstanding_packets`.
#[pyfunction]
#[pyo3(signature = (rates, delay, tensor_bytes, packet_numel=None, window_packets=None))]
pub fn netagg_seconds(
    rates: Vec<f64>,
    delay: f64,
    tensor_bytes: u64,
    packet_numel: Option<i64>,
    window_packets: Option<i64>,
) -> PyResult<(f64, &'static str)> {
    let prediction =
        scenario(&rates, delay, tensor_bytes, packet_numel, window_packets)?.netagg().map_err(refused)?;
    let bound = match prediction.bound {
        Bound::LinkRate => "link rate",
        Bound::Window => "window",
    };
    Ok((prediction.time.as_secs_f64(), bound))
}

/// A bandwidth-optimal ring's allreduce of `tensor_bytes` over TCP, in seconds.
#[pyfunction]
pub fn ring_seconds(rates: Vec<f64>, delay: f64, tensor_bytes: u64) -> PyResult<f64> {
    Ok(scenario(&rates, delay, tensor_bytes, None, None)?.ring().map_err(refused)?.as_secs_f64())
}

/// The model's refusal of a link or a tensor, as the argument error it is.
fn refused(error: ModelError) -> PyErr {
    PyValueError::new_err(error.to_string())
}
