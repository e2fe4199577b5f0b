//! What a worker puts on the wire and takes from it, against what sparsity predicts.
//!
//! Each block (a packet's elements: `packet_numel`, twice as many 16-bit ones) holds data
//! on a rank with probability `density`, independently of every other block and rank
//! ([`crate::data::Contents::block_has_data`]). A worker then sends the payload of a
//! fraction `density` of its blocks, and receives the sums of the blocks that hold data
//! on at least one of the N ranks: a fraction 1 − (1 − density)^N, the union. Headers
//! travel besides the payload (an empty report for each slot whose first block is zero,
//! acks of the results a worker did not contribute to), so payload and packets are
//! counted apart, and the payload fractions compare with the model directly.

use netagg::ThreadCounters;
use netagg_wire::packet::datagram_len;

/// What a worker's threads sent and received over some jobs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Traffic {
    /// Data packets sent once each: one per slot's first block (empty when that block is
    /// zero), then one per non-zero block; a dense job sends one per block.
    pub data_packets: u64,
    /// Data packets sent again, for evidence of their loss.
    pub retransmissions: u64,
    /// Acks, the probes among them included.
    pub acks: u64,
    /// Header-only requests sent while the thread waited as a whole (for a late rank).
    pub probes: u64,
    /// Payload bytes sent, retransmissions included: datagrams less their headers and
    /// checksums.
    pub payload_sent: u64,
    /// New results received.
    pub results: u64,
    /// Payload bytes of the new results received.
    pub payload_received: u64,
}

impl Traffic {
    /// The traffic the counters `counted` record.
    pub fn of(counted: &ThreadCounters) -> Traffic {
        let header = datagram_len(0) as u64;
        Traffic {
            data_packets: counted.data_sent - counted.retransmissions,
            retransmissions: counted.retransmissions,
            acks: counted.acks_sent,
            probes: counted.probes,
            payload_sent: counted.bytes_sent - counted.packets_sent * header,
            results: counted.results_received,
            payload_received: counted.bytes_received - counted.results_received * header,
        }
    }
}

/// The fraction of the tensor's bytes a worker sends: its blocks that hold data.
pub fn upstream_model(density: f64) -> f64 {
    density
}

/// The fraction of the tensor's bytes a worker receives: the blocks that hold data on
/// at least one of `workers` ranks, 1 − (1 − density)^workers.
pub fn downstream_model(density: f64, workers: u16) -> f64 {
    1.0 - (1.0 - density).powi(workers as i32)
}

/// One direction's payload as a fraction of the tensor's bytes: what the model expects,
/// what this seed's blocks hold, and what travelled.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Fractions {
    pub model: f64,
    /// The fraction of elements in the blocks this seed gave data (to this rank, or to
    /// any rank for the union): the model's draw.
    pub seed: f64,
    /// Payload bytes per job over the tensor's bytes.
    pub measured: f64,
}

impl Fractions {
    /// How far what travelled is from the model: 1 when they agree.
    pub fn ratio(&self) -> f64 {
        self.measured / self.model
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traffic_counts_payload_without_headers_and_first_sends_apart() {
        let header = datagram_len(0) as u64;
        let counted = ThreadCounters {
            packets_sent: 10,
            data_sent: 8,
            retransmissions: 1,
            acks_sent: 2,
            bytes_sent: 10 * header + 5 * 1024,
            results_received: 6,
            bytes_received: 6 * header + 3 * 1024,
            ..Default::default()
        };
        let traffic = Traffic::of(&counted);
        assert_eq!(
            traffic,
            Traffic {
                data_packets: 7,
                retransmissions: 1,
                acks: 2,
                probes: 0,
                payload_sent: 5 * 1024,
                results: 6,
                payload_received: 3 * 1024
            }
        );
    }

    #[test]
    fn the_union_of_ranks_grows_with_their_number() {
        assert_eq!(upstream_model(0.1), 0.1);
        assert!((downstream_model(0.1, 2) - 0.19).abs() < 1e-12);
        assert!((downstream_model(0.1, 4) - 0.3439).abs() < 1e-12);
        assert_eq!(downstream_model(1.0, 4), 1.0);
        let fractions = Fractions { model: 0.19, seed: 0.2, measured: 0.2 };
        assert!((fractions.ratio() - 0.2 / 0.19).abs() < 1e-12);
    }
}
