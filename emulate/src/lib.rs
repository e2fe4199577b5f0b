//! Emulated networks: a switch and N workers, each in a network namespace of its own,
//! joined to a bridge by veth pairs whose two directions are shaped (rate, delay,
//! jitter, loss), so that an allreduce crosses links like a real network's.
//!
//! - [`link`]: what a link is (rate, delay, jitter, loss, queue), from the command line
//!   or a topology file, with per-rank overrides;
//! - [`fabric`]: the namespaces, veth pairs, bridge and qdiscs of a run, removed on drop;
//! - [`delay_line`]: delay, jitter and loss in user space, for kernels without `netem`;
//! - [`monitor`]: whether the links or the host's CPU set a run's pace.

pub mod delay_line;
pub mod fabric;
pub mod link;
pub mod monitor;
mod netns;
