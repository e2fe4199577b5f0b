//! Backends: how a worker thread's packets reach the switch and come back.
//!
//! The protocol core above works in whole datagrams, so a backend only moves bytes: a
//! packet-level backend (UDP, DPDK) sends each as one datagram and busy-polls or sleeps
//! on its ring or socket; a message-level backend (RDMA) carries each as one message
//! written with immediate data into registered memory. Nothing above this trait changes
//! with the backend. [`faults::FaultyTransport`] wraps any of them to inject faults.

pub mod dummy;
pub mod faults;
pub mod udp;

use std::io;
use std::time::Duration;

/// One worker thread's channel to the switch.
pub trait Transport: Send {
    /// Queues a datagram for the switch. It may leave at once or at [`Transport::flush`].
    fn send(&mut self, datagram: &[u8]) -> io::Result<()>;
    /// Sends whatever [`Transport::send`] queued.
    fn flush(&mut self) -> io::Result<()>;
    /// Waits up to `timeout` for datagrams from the switch and hands each to `sink`;
    /// returns how many arrived (0 when the time ran out).
    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize>;
}
