//! The headers of the frames a DPDK endpoint reads and writes: Ethernet II carrying ARP
//! for IPv4, or IPv4 without options carrying UDP. Pure functions over bytes, so that
//! everything but the port is tested without DPDK.

use std::net::{Ipv4Addr, SocketAddrV4};

use etherparse::checksum::Sum16BitWords;
use etherparse::{
    ArpEthIpv4Packet, ArpOperation, EtherType, Ethernet2Header, IpNumber, Ipv4Header, NetSlice, SlicedPacket,
    TransportSlice, UdpHeader,
};

use crate::MacAddr;

/// Bytes before a UDP payload: Ethernet II (14), IPv4 without options (20), UDP (8).
pub const UDP_HEADERS_LEN: usize = Ethernet2Header::LEN + Ipv4Header::MIN_LEN + UdpHeader::LEN;
/// Bytes of IPv4 and UDP headers: an MTU less these is the largest UDP payload.
pub const IP_UDP_HEADERS_LEN: usize = Ipv4Header::MIN_LEN + UdpHeader::LEN;
/// Length of an ARP frame for IPv4 over Ethernet, before padding.
pub const ARP_FRAME_LEN: usize = Ethernet2Header::LEN + ArpEthIpv4Packet::LEN;

/// Time to live of the IPv4 packets sent, as Linux's default.
const TTL: u8 = 64;

/// What a received frame is to an endpoint at one IPv4 address.
#[derive(Debug, PartialEq, Eq)]
pub enum Received<'a> {
    /// A UDP datagram: its source with the MAC it came from, its destination port, and
    /// where its payload lies in the frame.
    Udp { source: SocketAddrV4, source_mac: MacAddr, port: u16, payload: std::ops::Range<usize> },
    /// An ARP request or reply for IPv4 over Ethernet.
    Arp(ArpEthIpv4Packet),
    /// A UDP datagram to this address whose checksum does not match its bytes: corrupted
    /// on its way, to be dropped.
    BadChecksum,
    /// Anything else: another protocol, another destination, a malformed frame; the
    /// text says which, for counters and logs.
    Other(&'a str),
}

/// Reads `frame` as received by the endpoint at `ip`.
///
/// A UDP checksum is checked where the sender filled it (0 is none, which IPv4 allows).
/// One that holds the sum of the pseudo-header alone is taken as unfilled too: a kernel
/// peer on a veth leaves that there for a checksum offload that never runs (its
/// `CHECKSUM_PARTIAL`, which af_packet does not pass to DPDK), and netagg's own CRC32C
/// covers the payload end to end anyway. IPv4 fragments are refused: netagg's datagrams
/// fit a frame.
pub fn read(frame: &[u8], ip: Ipv4Addr) -> Received<'_> {
    let Ok(packet) = SlicedPacket::from_ethernet(frame) else { return Received::Other("malformed") };
    let source_mac = match &packet.link {
        Some(etherparse::LinkSlice::Ethernet2(ethernet)) => MacAddr(ethernet.source()),
        _ => return Received::Other("not Ethernet II"),
    };
    match packet.net {
        Some(NetSlice::Arp(arp)) => match arp.to_packet().try_eth_ipv4() {
            Ok(arp) => Received::Arp(arp),
            Err(_) => Received::Other("ARP not for IPv4 over Ethernet"),
        },
        Some(NetSlice::Ipv4(ipv4)) => {
            let header = ipv4.header();
            if header.destination_addr() != ip {
                return Received::Other("IPv4 for another address");
            }
            if header.is_fragmenting_payload() {
                return Received::Other("IPv4 fragment");
            }
            let Some(TransportSlice::Udp(udp)) = packet.transport else { return Received::Other("not UDP") };
            let payload = udp.payload();
            let udp_header = udp.to_header();
            let (source, destination) = (header.source(), header.destination());
            if udp_header.checksum != 0
                && udp_header.checksum != pseudo_header_sum(source, destination, udp_header.length)
            {
                // A payload that fits a frame fits UDP's length field.
                let computed = udp_header.calc_checksum_ipv4_raw(source, destination, payload);
                if computed != Ok(udp_header.checksum) {
                    return Received::BadChecksum;
                }
            }
            let start = payload.as_ptr() as usize - frame.as_ptr() as usize;
            Received::Udp {
                source: SocketAddrV4::new(header.source_addr(), udp.source_port()),
                source_mac,
                port: udp.destination_port(),
                payload: start..start + payload.len(),
            }
        }
        _ => Received::Other("neither ARP nor IPv4"),
    }
}

/// The UDP checksum field a sender that leaves the checksum to an offload writes: the
/// folded sum of the IPv4 pseudo-header, not complemented (Linux's `CHECKSUM_PARTIAL`).
fn pseudo_header_sum(source: [u8; 4], destination: [u8; 4], udp_length: u16) -> u16 {
    let sum = Sum16BitWords::new()
        .add_4bytes(source)
        .add_4bytes(destination)
        .add_2bytes([0, IpNumber::UDP.0])
        .add_2bytes(udp_length.to_be_bytes());
    // In the byte order `UdpHeader::checksum` holds, as etherparse's own sums are.
    (!sum.ones_complement()).to_be()
}

/// Writes the Ethernet, IPv4 and UDP headers of a datagram whose `payload_len` bytes
/// follow them in `frame`, into its first [`UDP_HEADERS_LEN`] bytes. The UDP checksum is
/// computed in software, over the payload just written and still in cache: af_packet,
/// which the tests and CI run on, offers no checksum offload, and a NIC's is not asked
/// for yet. A kernel receiver checks it as a DPDK one does.
pub fn write_udp_headers(
    frame: &mut [u8],
    (source_mac, source): (MacAddr, SocketAddrV4),
    (destination_mac, destination): (MacAddr, SocketAddrV4),
    payload_len: usize,
) {
    let ethernet =
        Ethernet2Header { source: source_mac.0, destination: destination_mac.0, ether_type: EtherType::IPV4 };
    let udp_len = (UdpHeader::LEN + payload_len) as u16;
    let mut ipv4 =
        Ipv4Header::new(udp_len, TTL, IpNumber::UDP, source.ip().octets(), destination.ip().octets())
            .expect("a netagg datagram is far below IPv4's limit");
    ipv4.dont_fragment = true;
    ipv4.header_checksum = ipv4.calc_header_checksum();
    let payload = &frame[UDP_HEADERS_LEN..UDP_HEADERS_LEN + payload_len];
    let udp = UdpHeader::with_ipv4_checksum(source.port(), destination.port(), &ipv4, payload)
        .expect("a netagg datagram is far below UDP's limit");
    let (ethernet_bytes, rest) = frame.split_at_mut(Ethernet2Header::LEN);
    ethernet_bytes.copy_from_slice(&ethernet.to_bytes());
    let (ip_bytes, rest) = rest.split_at_mut(Ipv4Header::MIN_LEN);
    ip_bytes.copy_from_slice(&ipv4.to_bytes());
    rest[..UdpHeader::LEN].copy_from_slice(&udp.to_bytes());
}

/// Writes an ARP frame into the first [`ARP_FRAME_LEN`] bytes of `frame`: a request
/// (broadcast) when `target_mac` is `None`, else a reply to it.
pub fn write_arp(
    frame: &mut [u8],
    (sender_mac, sender_ip): (MacAddr, Ipv4Addr),
    (target_mac, target_ip): (Option<MacAddr>, Ipv4Addr),
) {
    let (operation, destination, target) = match target_mac {
        None => (ArpOperation::REQUEST, MacAddr::BROADCAST, MacAddr([0; 6])),
        Some(mac) => (ArpOperation::REPLY, mac, mac),
    };
    let ethernet =
        Ethernet2Header { source: sender_mac.0, destination: destination.0, ether_type: EtherType::ARP };
    let arp = ArpEthIpv4Packet {
        operation,
        sender_mac: sender_mac.0,
        sender_ipv4: sender_ip.octets(),
        target_mac: target.0,
        target_ipv4: target_ip.octets(),
    };
    frame[..Ethernet2Header::LEN].copy_from_slice(&ethernet.to_bytes());
    frame[Ethernet2Header::LEN..ARP_FRAME_LEN].copy_from_slice(&arp.to_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: MacAddr = MacAddr([2, 0, 0, 0, 0, 0xa]);
    const B: MacAddr = MacAddr([2, 0, 0, 0, 0, 0xb]);

    fn address(last: u8, port: u16) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, last), port)
    }

    /// RFC 1071's sum of big-endian 16-bit words, folded, written out plainly to check
    /// etherparse's against.
    fn ones_sum(bytes: &[u8]) -> u16 {
        let mut sum: u32 =
            bytes.chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]))).sum();
        while sum > 0xFFFF {
            sum = (sum & 0xFFFF) + (sum >> 16);
        }
        sum as u16
    }

    /// The IPv4 pseudo-header of the UDP datagram in `frame`: addresses, protocol, length.
    fn pseudo_header(frame: &[u8]) -> Vec<u8> {
        [&frame[26..34], &[0, 17], &frame[38..40]].concat()
    }

    /// A frame of `payload` from A to B, as [`write_udp_headers`] writes it.
    fn udp_frame(payload: &[u8]) -> Vec<u8> {
        let mut frame = vec![0u8; UDP_HEADERS_LEN + payload.len()];
        frame[UDP_HEADERS_LEN..].copy_from_slice(payload);
        write_udp_headers(&mut frame, (A, address(1, 4000)), (B, address(2, 5000)), payload.len());
        frame
    }

    #[test]
    fn a_udp_frame_reads_back_as_written() {
        let payload = b"netagg";
        let frame = udp_frame(payload);
        // What Linux would put on the wire for the same datagram, byte by byte.
        assert_eq!(&frame[..6], &B.0);
        assert_eq!(&frame[6..12], &A.0);
        assert_eq!(&frame[12..14], &[0x08, 0x00]);
        assert_eq!(frame[14], 0x45);
        assert_eq!(u16::from_be_bytes([frame[16], frame[17]]), 20 + 8 + 6);
        assert_eq!(frame[23], 17);
        assert_eq!(&frame[26..30], &[10, 0, 0, 1]);
        assert_eq!(&frame[30..34], &[10, 0, 0, 2]);
        assert_eq!(&frame[34..38], &[0x0f, 0xa0, 0x13, 0x88]);
        assert_eq!(&frame[38..40], &[0, 14]);
        // The UDP checksum: pseudo-header, header and payload sum to 0xffff with it.
        assert_ne!(&frame[40..42], &[0, 0]);
        assert_eq!(ones_sum(&[pseudo_header(&frame), frame[34..].to_vec()].concat()), 0xffff);
        // The IPv4 header's checksum sums to 0xffff with it.
        let sum: u32 =
            frame[14..34].chunks(2).map(|pair| u32::from(u16::from_be_bytes([pair[0], pair[1]]))).sum();
        assert_eq!((sum & 0xffff) + (sum >> 16), 0xffff);

        match read(&frame, *address(2, 0).ip()) {
            Received::Udp { source, source_mac, port, payload: range } => {
                assert_eq!((source, source_mac, port), (address(1, 4000), A, 5000));
                assert_eq!(&frame[range], payload);
            }
            other => panic!("read {other:?}"),
        }
        assert_eq!(read(&frame, *address(3, 0).ip()), Received::Other("IPv4 for another address"));
    }

    #[test]
    fn a_flipped_bit_in_a_udp_datagram_fails_its_checksum() {
        let frame = udp_frame(&[0x5A; 64]);
        let is_udp = |frame: &[u8]| matches!(read(frame, *address(2, 0).ip()), Received::Udp { .. });
        assert!(is_udp(&frame));
        // Every bit of the ports and the payload (the length and the checksum itself fail
        // other checks, or may pass as none).
        for bit in (34 * 8..38 * 8).chain(42 * 8..frame.len() * 8) {
            let mut corrupted = frame.clone();
            corrupted[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(read(&corrupted, *address(2, 0).ip()), Received::BadChecksum, "bit {bit}");
        }
    }

    #[test]
    fn a_udp_checksum_left_to_an_offload_or_none_is_taken() {
        let mut frame = udp_frame(&[0x5A; 64]);
        let is_udp = |frame: &[u8]| matches!(read(frame, *address(2, 0).ip()), Received::Udp { .. });
        // None, as IPv4 allows.
        frame[40..42].copy_from_slice(&[0, 0]);
        assert!(is_udp(&frame));
        // The pseudo-header's sum, which a kernel peer on a veth leaves for an offload.
        let partial = ones_sum(&pseudo_header(&frame));
        frame[40..42].copy_from_slice(&partial.to_be_bytes());
        assert!(is_udp(&frame));
        // Anything else is corruption.
        frame[41] ^= 1;
        assert_eq!(read(&frame, *address(2, 0).ip()), Received::BadChecksum);
    }

    #[test]
    fn arp_requests_and_replies_read_back() {
        let mut frame = [0u8; 60];
        write_arp(&mut frame, (A, *address(1, 0).ip()), (None, *address(2, 0).ip()));
        assert_eq!(&frame[..6], &MacAddr::BROADCAST.0);
        let Received::Arp(request) = read(&frame, *address(1, 0).ip()) else { panic!("not ARP") };
        assert_eq!(request.operation, ArpOperation::REQUEST);
        assert_eq!((request.sender_mac, request.sender_ipv4_addr()), (A.0, *address(1, 0).ip()));
        assert_eq!(request.target_ipv4_addr(), *address(2, 0).ip());

        write_arp(&mut frame, (B, *address(2, 0).ip()), (Some(A), *address(1, 0).ip()));
        let Received::Arp(reply) = read(&frame, *address(1, 0).ip()) else { panic!("not ARP") };
        assert_eq!(reply.operation, ArpOperation::REPLY);
        assert_eq!((reply.sender_mac, reply.target_mac), (B.0, A.0));
        assert_eq!(&frame[..6], &A.0);
    }

    #[test]
    fn malformed_and_foreign_frames_are_other() {
        assert_eq!(read(&[], Ipv4Addr::LOCALHOST), Received::Other("malformed"));
        assert_eq!(read(&[0u8; 10], Ipv4Addr::LOCALHOST), Received::Other("malformed"));
        let mut frame = vec![0u8; UDP_HEADERS_LEN + 4];
        write_udp_headers(&mut frame, (A, address(1, 1)), (B, address(2, 2)), 4);
        // A length beyond the frame is malformed, not read past the end.
        frame[16..18].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(read(&frame, *address(2, 0).ip()), Received::Other("malformed"));
        frame[12..14].copy_from_slice(&[0x86, 0xdd]);
        assert!(matches!(read(&frame, *address(2, 0).ip()), Received::Other(_)));
    }
}
