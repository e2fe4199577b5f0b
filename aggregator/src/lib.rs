//! netagg's aggregation engine and the worker side of its protocol, without I/O.
//!
//! - [`control`]: the switch's control plane: registration, the barrier that opens a
//!   session once every rank has registered, limits and departures.
//! - [`engine`]: the switch's core: sessions of slots that sum the packets of every worker,
//!   dense (SwitchML's semantics) and sparse (OmniReduce's block streams), loss-tolerant.
//! - [`worker`]: the worker thread's core: window, rounds, retransmission timers and sparse
//!   next-block bookkeeping.
//! - [`pacer`]: a worker's pacing of its data packets to the rate its path carries, from
//!   the standing queueing delay of its round trips; one pacer serves all its threads.
//! - [`faults`]: one direction of a faulty link (drop, duplicate, reorder, delay,
//!   corrupt, from a seeded RNG), which the client and switch shells wrap their
//!   transports with, and the links of [`sim`] are made of: the `netagg-faults` crate,
//!   re-exported.
//! - [`sim`]: an in-memory cluster that drives both over faulty links on a virtual clock,
//!   its session opened through [`control`].
//! - [`sum`]: the element-wise sums; [`sum16`]: the 16-bit floats' conversions to and
//!   from the float32 they are summed in.
//!
//! No core reads a clock, opens a socket or starts a thread: bytes and the time go in,
//! packets to send come out, so the switch process and the client library are thin shells
//! and every behaviour can be tested deterministically in memory.

#![forbid(unsafe_code)]

/// Declares a struct of `u64` event counters with `since`, which subtracts an earlier
/// snapshot, and `+`, which adds two, field by field.
macro_rules! counters {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$field_meta:meta])* pub $field:ident: u64,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct $name { $($(#[$field_meta])* pub $field: u64,)* }

        impl $name {
            /// The events counted since the snapshot `earlier`.
            pub fn since(&self, earlier: &$name) -> $name {
                $name { $($field: self.$field - earlier.$field,)* }
            }
        }

        impl core::ops::Add for $name {
            type Output = $name;
            fn add(self, other: $name) -> $name {
                $name { $($field: self.$field + other.$field,)* }
            }
        }
    };
}

pub mod control;
pub mod engine;
mod overtaking;
pub use netagg_faults as faults;
pub mod pacer;
mod round;
mod sequence_gaps;
pub mod sim;
pub mod sum;
pub mod sum16;
pub mod worker;
pub mod workers;
pub mod zero_scan;

pub use engine::{
    Departure, DropReason, Engine, EngineLimits, Recipient, SessionError, SessionId, SessionSpec, Summand,
    Transmit, Verdict,
};
pub use faults::{FaultCounters, FaultInjector, FaultRates};
pub use pacer::PacingConfig;
pub use worker::{
    BlockIo, BlockMask, JobSpec, JobStatus, Layout, SessionKey, SessionKeys, WorkerConfig, WorkerProtocol,
};
