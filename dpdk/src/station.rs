//! A UDP endpoint on a DPDK port: one IPv4 address, ARP answered and asked, neighbours
//! learned from what arrives and asked again when they fall silent ([`Neighbours`]),
//! datagrams written straight into mbufs.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etherparse::ArpOperation;

use crate::headers::{self, Received, ARP_FRAME_LEN, UDP_HEADERS_LEN};
use crate::neighbours::Neighbours;
use crate::{DpdkError, Eal, Frame, FrameAllocator, MacAddr, Port, Queue, Settings};

/// Shortest Ethernet frame without its CRC; ARP frames are padded to it.
const MIN_FRAME_LEN: usize = 60;
/// How many times a full transmit queue is tried again before what it did not take is
/// dropped, as a switch's full queue drops.
const TRANSMIT_TRIES: usize = 64;

/// What a station counts beside the datagrams it passes on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StationCounters {
    pub arp_requests_answered: u64,
    pub arp_requests_sent: u64,
    /// Datagrams dropped because their destination's MAC was not known yet.
    pub unresolved: u64,
    /// Frames the transmit queue did not take.
    pub transmit_dropped: u64,
    /// Frames that were neither ARP nor UDP to this station.
    pub ignored: u64,
    /// UDP datagrams to this station whose checksum did not match: corrupted, dropped.
    pub bad_checksum: u64,
}

/// A UDP datagram received, in the frame it came in.
pub struct Datagram {
    frame: Frame,
    payload: Range<usize>,
    pub source: SocketAddrV4,
    /// The UDP port it was sent to.
    pub port: u16,
}

impl Datagram {
    pub fn payload(&self) -> &[u8] {
        &self.frame.bytes()[self.payload.clone()]
    }
}

/// A datagram being written, in the frame it will leave in.
pub struct OutgoingDatagram {
    frame: Frame,
}

impl OutgoingDatagram {
    /// A frame for a datagram of up to `payload_len` bytes from `allocator`; `None` when
    /// the pool is empty or the frame would not fit an mbuf.
    pub fn new(allocator: &FrameAllocator, payload_len: usize) -> Option<OutgoingDatagram> {
        allocator.frame(UDP_HEADERS_LEN + payload_len).map(|frame| OutgoingDatagram { frame })
    }

    /// Room for the payload.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.frame.bytes_mut()[UDP_HEADERS_LEN..]
    }

    /// The frame that carries the first `len` bytes of the payload from `source` to
    /// `destination`, each a MAC and a UDP address.
    pub fn finish(
        mut self,
        len: usize,
        source: (MacAddr, SocketAddrV4),
        destination: (MacAddr, SocketAddrV4),
    ) -> Frame {
        self.frame.truncate(UDP_HEADERS_LEN + len);
        headers::write_udp_headers(self.frame.bytes_mut(), source, destination, len);
        self.frame
    }
}

pub struct Station {
    ip: Ipv4Addr,
    mac: MacAddr,
    /// Where every frame goes, if configured: the peer's or a router's MAC.
    next_hop: Option<MacAddr>,
    neighbours: Neighbours,
    received: Vec<Frame>,
    outgoing: Vec<Frame>,
    burst: u16,
    counters: StationCounters,
    /// Last, so that the port closes (with its last queue) after every frame above is
    /// freed.
    queue: Queue,
}

impl Station {
    /// Starts EAL and the port of `settings` with up to `queues` queue pairs, and a
    /// station at `ip` on each queue the port has. They learn neighbours each from its
    /// own frames.
    pub fn start(settings: &Settings, ip: Ipv4Addr, queues: u16) -> Result<Vec<Station>, DpdkError> {
        if settings.device.trim().is_empty() {
            return Err(DpdkError::NoDevice { section: settings.section });
        }
        let eal = Eal::start(&settings.eal_args)?;
        let queues = Port::open(eal, &settings.port(queues))?;
        Ok(queues
            .into_iter()
            .map(|queue| Station::new(queue, ip, settings.peer_mac, settings.burst))
            .collect())
    }

    /// A station at `ip` on `queue`, receiving up to `burst` frames at a time; with
    /// `next_hop`, every frame goes to that MAC and ARP is only answered.
    pub fn new(queue: Queue, ip: Ipv4Addr, next_hop: Option<MacAddr>, burst: u16) -> Station {
        let mac = queue.port().mac();
        Station {
            queue,
            ip,
            mac,
            next_hop,
            neighbours: Neighbours::default(),
            received: Vec::with_capacity(usize::from(burst)),
            outgoing: Vec::with_capacity(usize::from(burst)),
            burst: burst.max(1),
            counters: StationCounters::default(),
        }
    }

    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    pub fn mac(&self) -> MacAddr {
        self.mac
    }

    pub fn port(&self) -> &Arc<Port> {
        self.queue.port()
    }

    pub fn counters(&self) -> StationCounters {
        self.counters
    }

    /// The longest UDP payload that leaves in one frame ([`Port::max_udp_payload`]).
    pub fn max_payload(&self) -> usize {
        self.port().max_udp_payload()
    }

    /// Receives one burst: answers ARP, learns neighbours, and hands each UDP datagram
    /// to `sink`. Returns how many it handed.
    pub fn poll(&mut self, sink: &mut dyn FnMut(Datagram)) -> usize {
        if self.queue.receive(&mut self.received, self.burst) == 0 {
            return 0;
        }
        let mut handed = 0;
        let mut frames = std::mem::take(&mut self.received);
        for frame in frames.drain(..) {
            match headers::read(frame.bytes(), self.ip) {
                Received::Udp { source, source_mac, port, payload } => {
                    self.learn(*source.ip(), source_mac);
                    sink(Datagram { frame, payload, source, port });
                    handed += 1;
                }
                Received::Arp(arp) => {
                    self.learn(arp.sender_ipv4_addr(), MacAddr(arp.sender_mac));
                    if arp.operation == ArpOperation::REQUEST && arp.target_ipv4_addr() == self.ip {
                        self.send_arp(Some(MacAddr(arp.sender_mac)), arp.sender_ipv4_addr());
                        self.counters.arp_requests_answered += 1;
                    }
                }
                Received::BadChecksum => self.counters.bad_checksum += 1,
                Received::Other(_) => self.counters.ignored += 1,
            }
        }
        self.received = frames;
        if !self.outgoing.is_empty() {
            self.flush();
        }
        handed
    }

    /// A frame for a datagram of up to `payload_len` bytes; `None` when the pool is empty
    /// (the datagram is then lost, as on a congested link) or the payload does not fit a
    /// frame.
    pub fn datagram(&self, payload_len: usize) -> Option<OutgoingDatagram> {
        if payload_len > self.max_payload() {
            return None;
        }
        // From the port itself: an allocator would cost a reference count each way.
        self.port().frame(UDP_HEADERS_LEN + payload_len).map(|frame| OutgoingDatagram { frame })
    }

    /// Queues the first `len` bytes of `datagram`'s payload from UDP port `from` to `to`;
    /// it leaves at [`Station::flush`] or when a burst is full. False if it was dropped
    /// because `to`'s MAC is not known yet (it is asked for).
    pub fn send(&mut self, datagram: OutgoingDatagram, len: usize, from: u16, to: SocketAddrV4) -> bool {
        let Some(destination_mac) = self.ask_mac(*to.ip()) else {
            self.counters.unresolved += 1;
            return false;
        };
        let source = SocketAddrV4::new(self.ip, from);
        self.outgoing.push(datagram.finish(len, (self.mac, source), (destination_mac, to)));
        if self.outgoing.len() >= usize::from(self.burst) {
            self.flush();
        }
        true
    }

    /// Sends everything queued; what the transmit queue still refuses after a few tries
    /// is dropped and counted.
    pub fn flush(&mut self) {
        let mut outgoing = std::mem::take(&mut self.outgoing);
        self.transmit(&mut outgoing);
        self.outgoing = outgoing;
    }

    /// Sends `frames`, finished elsewhere ([`OutgoingDatagram::finish`]), and empties it;
    /// what the transmit queue still refuses after a few tries is dropped and counted.
    pub fn transmit(&mut self, frames: &mut Vec<Frame>) {
        for _ in 0..TRANSMIT_TRIES {
            if frames.is_empty() {
                return;
            }
            self.queue.transmit(frames);
        }
        self.counters.transmit_dropped += frames.len() as u64;
        frames.clear();
    }

    /// Makes frames from the port's pool, for threads that do not hold the station.
    pub fn allocator(&self) -> FrameAllocator {
        self.port().allocator()
    }

    /// Sets the station's IPv4 address, once it is known (from where a control
    /// connection leaves, say).
    pub fn set_ip(&mut self, ip: Ipv4Addr) {
        self.ip = ip;
    }

    /// The MAC of `ip` if this station knows it (or the configured next hop), without
    /// asking.
    pub fn known_mac(&self, ip: Ipv4Addr) -> Option<MacAddr> {
        self.next_hop.or_else(|| self.neighbours.known(ip))
    }

    /// The MAC to send to for `ip`, asking for it by ARP if it is not known or `ip` has
    /// been silent a while (at most every 100 ms); the request leaves with the next
    /// flush.
    pub fn ask_mac(&mut self, ip: Ipv4Addr) -> Option<MacAddr> {
        if let Some(next_hop) = self.next_hop {
            return Some(next_hop);
        }
        let lookup = self.neighbours.lookup(ip, Instant::now());
        if lookup.ask {
            self.send_arp(None, ip);
            self.counters.arp_requests_sent += 1;
        }
        lookup.mac
    }

    /// Waits up to `timeout` for `ip`'s MAC, asking by ARP; UDP datagrams that arrive
    /// meanwhile go to `sink`.
    pub fn resolve(
        &mut self,
        ip: Ipv4Addr,
        timeout: Duration,
        sink: &mut dyn FnMut(Datagram),
    ) -> Result<MacAddr, DpdkError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(mac) = self.ask_mac(ip) {
                return Ok(mac);
            }
            self.flush();
            if Instant::now() >= deadline {
                return Err(DpdkError::Unresolved { ip, timeout });
            }
            if self.poll(sink) == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    fn learn(&mut self, ip: Ipv4Addr, mac: MacAddr) {
        if !ip.is_unspecified() && !mac.is_multicast() {
            self.neighbours.learn(ip, mac);
        }
    }

    /// Queues an ARP request for `target_ip` (to everyone), or a reply to `target_mac`.
    fn send_arp(&mut self, target_mac: Option<MacAddr>, target_ip: Ipv4Addr) {
        let Some(mut frame) = self.port().frame(MIN_FRAME_LEN) else {
            self.counters.transmit_dropped += 1;
            return;
        };
        let bytes = frame.bytes_mut();
        bytes.fill(0);
        headers::write_arp(bytes, (self.mac, self.ip), (target_mac, target_ip));
        const { assert!(ARP_FRAME_LEN <= MIN_FRAME_LEN) };
        self.outgoing.push(frame);
    }
}
