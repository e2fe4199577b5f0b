//! The UDP backend: one socket per worker thread, batched system calls.
//!
//! A worker thread's packets are written straight into GSO batches and leave together at
//! the thread's flush; its results arrive through recvmmsg and GRO
//! ([`netagg_udp::BatchSocket`]), so a window of packets costs a few system calls rather
//! than one each. A GSO batch holds datagrams of one size for one destination, so the
//! [`Outbox`] keeps one open per size and destination: a sparse job's answers mix data
//! packets with header-only acks and empty contributions, and a single batch would leave
//! at every change of size (about 4 datagrams a call, against 46 in a dense job). The
//! switches' slot split gives a thread's contiguous slots to as few endpoints as it can,
//! so batches stay long.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_udp::{BatchSocket, SegmentBatch};
use netagg_wire::Endpoint;

use super::{DataPaths, SwitchTransport, Transport};

/// A worker thread's socket, bound before registration so its port can be announced.
pub struct UdpTransport {
    socket: BatchSocket,
    local: SocketAddr,
    /// The switches' data addresses, in [`DataPaths::endpoints`] order, and which takes
    /// each datagram; `None` until connected.
    switch: Option<(Vec<SocketAddr>, DataPaths)>,
    outbox: Outbox,
}

impl UdpTransport {
    /// Binds a socket at `ip` on a free port; `socket_buffer` sizes its kernel buffers
    /// (0: default).
    pub fn bind(ip: IpAddr, socket_buffer: usize) -> io::Result<UdpTransport> {
        let socket = BatchSocket::bind(SocketAddr::new(ip, 0), socket_buffer)?;
        let local = socket.local_addr()?;
        let outbox = Outbox::new(socket.max_segments());
        Ok(UdpTransport { socket, local, switch: None, outbox })
    }
}

fn not_connected() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the UDP transport has no switch address yet")
}

impl Transport for UdpTransport {
    fn describe(&self) -> String {
        format!("udp: a kernel socket at {}", self.local)
    }

    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        self.outbox.room(len)
    }

    fn send(&mut self, len: usize) -> io::Result<()> {
        let Some((addresses, paths)) = &self.switch else {
            return Err(not_connected());
        };
        let path = paths.owner(&self.outbox.room(len)[..len]);
        let socket = &self.socket;
        self.outbox.queue(len, path, |path, batch| socket.send(addresses[path], batch))
    }

    fn flush(&mut self) -> io::Result<()> {
        // Unconnected, `send` queued nothing.
        let Some((addresses, _)) = &self.switch else { return Ok(()) };
        let socket = &self.socket;
        self.outbox.flush(|path, batch| socket.send(addresses[path], batch))
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize> {
        match &self.switch {
            // Connected: the kernel takes datagrams from the one data address only.
            Some((addresses, _)) if addresses.len() > 1 => self.socket.recv(timeout, |source, datagram| {
                if addresses.contains(&source) {
                    sink(datagram);
                }
            }),
            _ => self.socket.recv(timeout, |_, datagram| sink(datagram)),
        }
    }
}

impl SwitchTransport for UdpTransport {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(self.local)
    }

    fn connect(&mut self, paths: &DataPaths) -> io::Result<()> {
        let addresses = paths
            .endpoints()
            .map(|(endpoint, control)| {
                endpoint.udp_address(control.switch).ok_or_else(|| {
                    let message = format!("the switch's data path is {endpoint}, not UDP");
                    io::Error::new(io::ErrorKind::Unsupported, message)
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        // One data address: the kernel accepts datagrams from it only. With several, the
        // socket stays unconnected and `recv` keeps theirs.
        if let [one] = addresses[..] {
            self.socket.connect(one)?;
        }
        self.switch = Some((addresses, paths.clone()));
        Ok(())
    }
}

/// Most GSO batches open at once: a job's datagrams come in a few sizes (full data
/// packets, a stream's shorter last block, header-only acks and empty contributions), to
/// one switch endpoint or a few.
const MAX_OPEN_BATCHES: usize = 4;

/// Datagrams queued for the next flush, in one GSO batch per destination and size (a
/// batch holds equal datagrams only), so that datagrams of two sizes taking turns still
/// leave in two system calls, not one per change of size.
///
/// A datagram is written into room lent by the batch with the longest datagrams, and
/// joins it in place; one of another size or destination is copied into its own batch,
/// so the copies are mostly of headers.
#[derive(Debug)]
struct Outbox {
    open: Vec<OpenBatch>,
    /// The batch whose room the next datagram is written into.
    lender: usize,
    max_segments: usize,
}

/// A batch of the outbox, with the index of its destination among the switch's addresses
/// and the length of its datagrams.
#[derive(Debug)]
struct OpenBatch {
    path: usize,
    segment: usize,
    batch: SegmentBatch,
}

impl Outbox {
    fn new(max_segments: usize) -> Outbox {
        let first = OpenBatch { path: 0, segment: 0, batch: SegmentBatch::new(max_segments) };
        Outbox { open: vec![first], lender: 0, max_segments }
    }

    /// Lends `len` bytes to write the next datagram into.
    fn room(&mut self, len: usize) -> &mut [u8] {
        self.open[self.lender].batch.room(len)
    }

    /// Queues the first `len` bytes of the last [`Outbox::room`] as a datagram to `path`;
    /// a batch that must leave first to make way for it goes to `send` with its path.
    fn queue(
        &mut self,
        len: usize,
        path: usize,
        mut send: impl FnMut(usize, &SegmentBatch) -> io::Result<()>,
    ) -> io::Result<()> {
        let same_kind = |open: &OpenBatch| open.path == path && open.segment == len;
        let joins = |open: &OpenBatch| same_kind(open) && !open.batch.is_empty() && open.batch.accepts(len);
        if let Some(target) = self.open.iter().position(joins) {
            self.place(target, len, path);
            return Ok(());
        }
        // No batch takes it. Its own kind's, full, leaves now; else an empty batch or a
        // new one starts; else, past the limit, a batch of another kind leaves to make room.
        let target = match self.open.iter().position(same_kind) {
            Some(full) => full,
            None => match self.open.iter().position(|open| open.batch.is_empty()) {
                Some(empty) => empty,
                None if self.open.len() < MAX_OPEN_BATCHES => {
                    let batch = SegmentBatch::new(self.max_segments);
                    self.open.push(OpenBatch { path, segment: len, batch });
                    self.open.len() - 1
                }
                None => (self.lender + 1) % self.open.len(),
            },
        };
        let mut result = Ok(());
        if !self.open[target].batch.is_empty() {
            let placed;
            (result, placed) = self.send_longest_first(Some(target), Some((len, path)), &mut send);
            if placed {
                return result;
            }
        }
        self.place(target, len, path);
        result
    }

    /// Sends batch `leaving` and every batch held of longer datagrams (all held, if
    /// `None`) to `send`, those of the longest first, and empties them: a shorter datagram
    /// never leaves before a longer one queued earlier (a probe's id counts the datagrams
    /// sent before it, so data it overtook would look lost). `room`, the length and path of
    /// a datagram written into the lender's room and not yet queued, starts the lender's
    /// batch anew if that batch leaves; the second value says whether it did.
    fn send_longest_first(
        &mut self,
        leaving: Option<usize>,
        room: Option<(usize, usize)>,
        send: &mut impl FnMut(usize, &SegmentBatch) -> io::Result<()>,
    ) -> (io::Result<()>, bool) {
        let mut result = Ok(());
        let mut placed = false;
        // At most `MAX_OPEN_BATCHES` batches: a bit each.
        let mut waiting = self
            .open
            .iter()
            .enumerate()
            .filter(|&(index, open)| match leaving {
                Some(leaving) => index == leaving || open.segment > self.open[leaving].segment,
                None => true,
            })
            .filter(|(_, open)| !open.batch.is_empty())
            .fold(0u8, |waiting, (index, _)| waiting | 1 << index);
        while let Some(next) = (0..self.open.len())
            .filter(|&index| waiting & 1 << index != 0)
            .max_by_key(|&index| self.open[index].segment)
        {
            waiting &= !(1 << next);
            let is_lender = next == self.lender;
            let open = &mut self.open[next];
            result = result.and(send(open.path, &open.batch));
            match room {
                Some((len, path)) if is_lender => {
                    // The datagram is in this batch's room: it starts the batch anew.
                    open.batch.restart_with_room(len);
                    open.path = path;
                    open.segment = len;
                    placed = true;
                }
                _ => open.batch.clear(),
            }
        }
        (result, placed)
    }

    /// Appends the datagram in the lender's room to batch `target`, which takes it.
    fn place(&mut self, target: usize, len: usize, path: usize) {
        if self.open[target].batch.is_empty() {
            self.open[target].path = path;
            self.open[target].segment = len;
        }
        if target == self.lender {
            self.open[target].batch.commit(len);
            return;
        }
        let (lender, target_batch) = pair_mut(&mut self.open, self.lender, target);
        target_batch.batch.push(&lender.batch.room(len)[..len]);
        // The batch of the longest datagrams lends the room, so that those join in place
        // and the copies are of the short ones.
        if len > lender.segment {
            self.lender = target;
        }
    }

    /// Sends every batch held to `send`, with its path, longest datagrams first, and
    /// empties them.
    fn flush(&mut self, mut send: impl FnMut(usize, &SegmentBatch) -> io::Result<()>) -> io::Result<()> {
        self.send_longest_first(None, None, &mut send).0
    }
}

/// Two distinct elements of `items`, mutably.
fn pair_mut<T>(items: &mut [T], first: usize, second: usize) -> (&mut T, &mut T) {
    assert_ne!(first, second, "a pair of two distinct elements");
    if first < second {
        let (head, tail) = items.split_at_mut(second);
        (&mut head[first], &mut tail[0])
    } else {
        let (head, tail) = items.split_at_mut(first);
        (&mut tail[0], &mut head[second])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batches an outbox sent, each as its path and datagrams, in order.
    type Sent = Vec<(usize, Vec<Vec<u8>>)>;

    fn record(sent: &mut Sent) -> impl FnMut(usize, &SegmentBatch) -> io::Result<()> + '_ {
        |path, batch| {
            sent.push((path, batch.datagrams().map(<[u8]>::to_vec).collect()));
            Ok(())
        }
    }

    /// Writes a datagram of `len` bytes of `fill` into the outbox's room and queues it.
    fn queue(outbox: &mut Outbox, sent: &mut Sent, len: usize, path: usize, fill: u8) {
        outbox.room(len)[..len].fill(fill);
        outbox.queue(len, path, record(sent)).unwrap();
    }

    #[test]
    fn data_and_headers_taking_turns_leave_in_one_send_each() {
        // A sparse job's answers: data packets and header-only acks interleaved.
        let mut outbox = Outbox::new(64);
        let mut sent = Sent::new();
        for i in 0..20u8 {
            queue(&mut outbox, &mut sent, 48, 0, i);
            queue(&mut outbox, &mut sent, 1072, 0, 100 + i);
        }
        assert!(sent.is_empty(), "nothing leaves before the flush");
        outbox.flush(record(&mut sent)).unwrap();
        assert!(outbox.open.iter().all(|open| open.batch.is_empty()));
        assert_eq!(sent.len(), 2, "two sends for 40 datagrams of two sizes");
        let headers: Vec<Vec<u8>> = (0..20).map(|i| vec![i; 48]).collect();
        let data: Vec<Vec<u8>> = (0..20).map(|i| vec![100 + i; 1072]).collect();
        assert_eq!(sent, [(0, data), (0, headers)], "the longest first");
        // The next flush's datagrams are written into the data batch, and join it in place.
        assert_eq!(outbox.open[outbox.lender].segment, 1072);
    }

    #[test]
    fn a_short_datagram_never_leaves_before_a_longer_one_queued_earlier() {
        // A data packet, then acks and a probe: the full batch of headers leaves, after
        // the data; the data batch, which lent the room, starts anew with the probe.
        let mut outbox = Outbox::new(2);
        let mut sent = Sent::new();
        queue(&mut outbox, &mut sent, 1072, 0, 1);
        for header in 2..5u8 {
            queue(&mut outbox, &mut sent, 48, 0, header);
        }
        queue(&mut outbox, &mut sent, 1072, 0, 5);
        outbox.flush(record(&mut sent)).unwrap();
        let order: Vec<(usize, u8)> = sent.iter().flat_map(|(_, d)| d).map(|d| (d.len(), d[0])).collect();
        assert_eq!(order, [(1072, 1), (48, 2), (48, 3), (1072, 5), (48, 4)]);
        assert_eq!(sent.len(), 4, "{sent:?}");
    }

    #[test]
    fn a_full_batch_leaves_and_its_next_datagram_starts_it_anew() {
        let mut outbox = Outbox::new(3);
        let mut sent = Sent::new();
        for i in 0..7u8 {
            queue(&mut outbox, &mut sent, 1072, 0, i);
            if i % 2 == 0 {
                queue(&mut outbox, &mut sent, 48, 0, 50 + i);
            }
        }
        // The last full batch, of headers, left after the data queued before them.
        assert_eq!(sent.len(), 4, "each full batch left as the next datagram of its size came");
        outbox.flush(record(&mut sent)).unwrap();
        let sizes: Vec<(usize, usize)> = sent.iter().map(|(_, d)| (d.len(), d[0].len())).collect();
        assert_eq!(sizes, [(3, 1072), (3, 1072), (1, 1072), (3, 48), (1, 48)]);
        let data: Vec<u8> =
            sent.iter().flat_map(|(_, d)| d).filter(|d| d.len() == 1072).map(|d| d[0]).collect();
        assert_eq!(data, [0, 1, 2, 3, 4, 5, 6], "every datagram once, in order");
        assert!(sent.iter().flat_map(|(_, d)| d).all(|d| d.iter().all(|&b| b == d[0])));
    }

    #[test]
    fn each_path_gets_its_own_batches_and_a_fifth_kind_sends_one_to_make_room() {
        let mut outbox = Outbox::new(64);
        let mut sent = Sent::new();
        for (path, len) in [(0, 1072), (1, 1072), (0, 48), (1, 48), (0, 1072), (1, 48)] {
            queue(&mut outbox, &mut sent, len, path, path as u8);
        }
        assert!(sent.is_empty(), "four kinds fit the open batches");
        queue(&mut outbox, &mut sent, 500, 0, 9);
        assert_eq!(sent.len(), 1, "a fifth kind sends one batch first");
        assert_ne!((sent[0].0, sent[0].1[0].len()), (0, 1072), "not the batch that lends the room");
        outbox.flush(record(&mut sent)).unwrap();
        let mut kinds: Vec<(usize, usize, usize)> =
            sent.iter().map(|(p, d)| (*p, d[0].len(), d.len())).collect();
        kinds.sort();
        assert_eq!(kinds, [(0, 48, 1), (0, 500, 1), (0, 1072, 2), (1, 48, 2), (1, 1072, 1)]);
        assert!(sent.iter().all(|(path, d)| d.iter().all(|d| d.iter().all(|&b| b == *path as u8 || b == 9))));
    }

    #[test]
    fn a_failed_send_is_reported_and_the_datagram_still_queued() {
        let mut outbox = Outbox::new(1);
        let mut sent = Sent::new();
        queue(&mut outbox, &mut sent, 100, 0, 1);
        outbox.room(100)[..100].fill(2);
        let refused = outbox.queue(100, 0, |_, _| Err(io::Error::other("refused")));
        assert_eq!(refused.unwrap_err().to_string(), "refused");
        outbox.flush(record(&mut sent)).unwrap();
        assert_eq!(sent, [(0, vec![vec![2; 100]])]);
    }
}
