//! The baseline for allreduce through the switch: a UDP relay that echoes every
//! datagram to its sender, and clients that stream a tensor through it.
//!
//! A worker of an allreduce sends each packet of its tensor once and gets one result
//! back per packet; so does a client of this relay, with the same datagram size (header
//! and payload), the same window of datagrams in flight per thread and the same batched
//! socket ([`BatchSocket`]: GSO sends, recvmmsg and GRO). What the relay lacks is all the
//! switch adds: aggregation, sessions, loss recovery. The ratio of the two goodputs is
//! what those cost on top of the kernel's price per datagram.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use netagg_udp::{BatchSocket, SegmentBatch};
use netagg_wire::packet::HEADER_LEN;

/// How long the relay sleeps in `recv` before it looks at `stop` again.
const RELAY_WAKEUP: Duration = Duration::from_millis(20);
/// A client with datagrams in flight and nothing back for this long sends them again.
const RESEND_AFTER: Duration = Duration::from_millis(50);

/// Echoes every datagram arriving at `socket` to its sender until `stop` is set;
/// returns how many it echoed. Each receive batch goes back as one GSO send per sender.
pub fn echo_relay(mut socket: BatchSocket, stop: &AtomicBool) -> io::Result<u64> {
    let mut batches: Vec<(SocketAddr, SegmentBatch)> = Vec::new();
    let mut spare: Vec<SegmentBatch> = Vec::new();
    let max_segments = socket.max_segments();
    let mut echoed = 0;
    while !stop.load(Ordering::Relaxed) {
        socket.recv(RELAY_WAKEUP, |from, datagram| {
            let open = batches.iter_mut().rev().find(|(to, _)| *to == from);
            match open {
                Some((_, batch)) if batch.accepts(datagram.len()) => batch.push(datagram),
                _ => {
                    let mut batch = spare.pop().unwrap_or_else(|| SegmentBatch::new(max_segments));
                    batch.push(datagram);
                    batches.push((from, batch));
                }
            }
            echoed += 1;
        })?;
        for (to, mut batch) in batches.drain(..) {
            socket.send(to, &batch)?;
            batch.clear();
            spare.push(batch);
        }
    }
    Ok(echoed)
}

/// One client thread's share of a tensor, streamed through the relay.
pub struct StreamClient {
    socket: BatchSocket,
    relay: SocketAddr,
    batch: SegmentBatch,
    datagram: Vec<u8>,
}

/// What a client saw while streaming.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamCounters {
    pub sent: u64,
    pub received: u64,
    /// Datagrams sent again after [`RESEND_AFTER`] of silence.
    pub resent: u64,
}

impl StreamClient {
    /// A client with a socket of its own, talking to `relay`.
    pub fn connect(relay: SocketAddr, socket_buffer: usize) -> io::Result<StreamClient> {
        let socket = BatchSocket::bind(SocketAddr::new(relay.ip(), 0), socket_buffer)?;
        socket.connect(relay)?;
        let batch = SegmentBatch::new(socket.max_segments());
        Ok(StreamClient { socket, relay, batch, datagram: Vec::new() })
    }

    /// Sends `input` in datagrams of `packet_bytes` of payload after a netagg-sized
    /// header, keeping `window` in flight, and writes each echoed payload to its place in
    /// `output`, as a worker stores results. Returns when every datagram has come back.
    pub fn stream(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        packet_bytes: usize,
        window: usize,
    ) -> io::Result<StreamCounters> {
        let packets = input.len().div_ceil(packet_bytes.max(1));
        let mut counters = StreamCounters::default();
        let mut back = vec![false; packets];
        let mut next = 0;
        let mut in_flight: Vec<usize> = Vec::with_capacity(window);
        let mut last_progress = Instant::now();
        while (counters.received as usize) < packets {
            while in_flight.len() < window.max(1) && next < packets {
                self.queue(input, next, packet_bytes)?;
                in_flight.push(next);
                next += 1;
                counters.sent += 1;
            }
            self.flush()?;
            let mut arrived = Vec::new();
            self.socket.recv(RESEND_AFTER, |_, datagram| {
                if datagram.len() < HEADER_LEN {
                    return;
                }
                let index = u64::from_le_bytes(datagram[..8].try_into().unwrap_or_default()) as usize;
                let start = index * packet_bytes;
                if index < packets && !back[index] {
                    back[index] = true;
                    let payload = &datagram[HEADER_LEN..];
                    output[start..start + payload.len()].copy_from_slice(payload);
                    arrived.push(index);
                }
            })?;
            if !arrived.is_empty() {
                counters.received += arrived.len() as u64;
                in_flight.retain(|index| !back[*index]);
                last_progress = Instant::now();
            } else if last_progress.elapsed() >= RESEND_AFTER {
                // Loopback drops only when a socket buffer overflows; send what is
                // missing again rather than hang.
                for index in in_flight.clone() {
                    self.queue(input, index, packet_bytes)?;
                    counters.resent += 1;
                }
                self.flush()?;
                last_progress = Instant::now();
            }
        }
        Ok(counters)
    }

    fn queue(&mut self, input: &[u8], index: usize, packet_bytes: usize) -> io::Result<()> {
        let start = index * packet_bytes;
        let payload = &input[start..(start + packet_bytes).min(input.len())];
        self.datagram.clear();
        self.datagram.extend_from_slice(&(index as u64).to_le_bytes());
        self.datagram.resize(HEADER_LEN, 0);
        self.datagram.extend_from_slice(payload);
        if !self.batch.accepts(self.datagram.len()) {
            self.flush()?;
        }
        self.batch.push(&self.datagram);
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        let result = self.socket.send(self.relay, &self.batch);
        self.batch.clear();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_tensor_comes_back_whole_through_the_relay() {
        let socket = BatchSocket::bind("127.0.0.1:0".parse().unwrap(), 1 << 20).unwrap();
        let relay = socket.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let relay_thread = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || echo_relay(socket, &stop).unwrap())
        };
        let input: Vec<u8> = (0..100_003u32).map(|i| (i % 251) as u8).collect();
        let mut output = vec![0u8; input.len()];
        let mut client = StreamClient::connect(relay, 1 << 20).unwrap();
        let counters = client.stream(&input, &mut output, 1024, 16).unwrap();
        stop.store(true, Ordering::Relaxed);
        let echoed = relay_thread.join().unwrap();
        assert!(output == input, "the echoed payloads rebuild the tensor");
        assert_eq!(counters.received, 98);
        assert!(echoed >= counters.received && echoed <= counters.sent + counters.resent, "{echoed} echoed");
    }
}
