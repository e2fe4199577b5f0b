//! The baseline for allreduce through the switch: a UDP relay that echoes every
//! datagram to its sender, and clients that stream a tensor through it.
//!
//! A worker of an allreduce sends each packet of its tensor once and gets one result
//! back per packet; so does a client of this relay, with the same datagram size (header,
//! payload and checksum, left zero here), the same window of datagrams in flight per thread and the same batched
//! socket ([`BatchSocket`]: GSO sends, recvmmsg and GRO). What the relay lacks is all the
//! switch adds: aggregation, sessions, loss recovery. The ratio of the two goodputs is
//! what those cost on top of the kernel's price per datagram.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use netagg_udp::{BatchSocket, SegmentBatch};
use netagg_wire::packet::{CHECKSUM_LEN, HEADER_LEN};

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

/// [`echo_relay`] on a thread of its own; stopped and joined by [`EchoRelay::stop`] or on
/// drop.
pub struct EchoRelay {
    address: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<io::Result<u64>>>,
}

impl EchoRelay {
    /// Binds `address` (port 0: any free port) with the socket buffer the switch's data
    /// socket asks for, and starts echoing.
    pub fn start(address: SocketAddr) -> io::Result<EchoRelay> {
        let socket = BatchSocket::bind(address, netagg_switch::DATA_SOCKET_BUFFER)?;
        let address = socket.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new().name("echo-relay".into()).spawn(move || echo_relay(socket, &stop))?
        };
        Ok(EchoRelay { address, stop, thread: Some(thread) })
    }

    /// The address the relay echoes at.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops the relay; returns how many datagrams it echoed, or why it failed.
    pub fn stop(mut self) -> io::Result<u64> {
        self.shut_down()
    }

    fn shut_down(&mut self) -> io::Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        let Some(thread) = self.thread.take() else { return Ok(0) };
        thread.join().map_err(|_| io::Error::other("the relay panicked"))?
    }
}

impl Drop for EchoRelay {
    fn drop(&mut self) {
        let _ = self.shut_down();
    }
}

/// The bytes of a `tensor_bytes` tensor each of `threads` threads streams: whole
/// packets of `packet_bytes`, as evenly as they go, the first threads taking one more
/// (and the last packet short), as netagg's context cuts a job among its threads.
pub fn thread_shares(tensor_bytes: usize, packet_bytes: usize, threads: usize) -> Vec<usize> {
    let packets = tensor_bytes.div_ceil(packet_bytes.max(1));
    let threads = threads.max(1);
    (0..threads)
        .map(|thread| {
            let count = packets / threads + usize::from(thread < packets % threads);
            let first = thread * (packets / threads) + thread.min(packets % threads);
            (count * packet_bytes).min(tensor_bytes.saturating_sub(first * packet_bytes))
        })
        .collect()
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

    /// Sends `input` in datagrams of `packet_bytes` of payload between a netagg-sized
    /// header and checksum, keeping `window` in flight, and writes each echoed payload to its place in
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
                if datagram.len() < HEADER_LEN + CHECKSUM_LEN {
                    return;
                }
                let index = u64::from_le_bytes(datagram[..8].try_into().unwrap_or_default()) as usize;
                let start = index * packet_bytes;
                if index < packets && !back[index] {
                    back[index] = true;
                    let payload = &datagram[HEADER_LEN..datagram.len() - CHECKSUM_LEN];
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
        self.datagram.extend_from_slice(&[0; CHECKSUM_LEN]);
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

    #[test]
    fn a_tensor_comes_back_whole_through_the_relay() {
        let relay = EchoRelay::start("127.0.0.1:0".parse().unwrap()).unwrap();
        let input: Vec<u8> = (0..100_003u32).map(|i| (i % 251) as u8).collect();
        let mut output = vec![0u8; input.len()];
        let mut client = StreamClient::connect(relay.address(), 1 << 20).unwrap();
        let counters = client.stream(&input, &mut output, 1024, 16).unwrap();
        let echoed = relay.stop().unwrap();
        assert!(output == input, "the echoed payloads rebuild the tensor");
        assert_eq!(counters.received, 98);
        assert!(echoed >= counters.received && echoed <= counters.sent + counters.resent, "{echoed} echoed");
    }

    #[test]
    fn shares_are_whole_packets_and_cover_the_tensor() {
        // 10 packets of 100 bytes, the last one 50: 4, 3 and 3 packets.
        assert_eq!(thread_shares(950, 100, 3), vec![400, 300, 250]);
        assert_eq!(thread_shares(100, 100, 2), vec![100, 0]);
        assert_eq!(thread_shares(0, 100, 2), vec![0, 0]);
    }
}
