//! The kernel's hold on the UDP ports a DPDK endpoint answers at.

use std::io;
use std::net::{Ipv4Addr, SocketAddr};

use socket2::{Domain, Protocol, Socket, Type};

use crate::DpdkError;

/// A kernel UDP socket that holds a port a DPDK endpoint uses, so that no kernel program
/// takes it, and that drops whatever the kernel receives for it. Where the DPDK port
/// shares its interface with the kernel (an af_packet device, a veth in tests), the
/// kernel sees every datagram the endpoint receives and would otherwise answer each with
/// an ICMP port-unreachable.
pub struct PortReservation {
    _socket: Socket,
    port: u16,
}

impl PortReservation {
    /// Reserves UDP port `port` (0: one the kernel chooses) at `ip`, or at every address
    /// where `ip` is not the kernel's (a NIC DPDK took from it).
    pub fn new(ip: Ipv4Addr, port: u16) -> Result<PortReservation, DpdkError> {
        Self::bind(ip, port).map_err(|error| DpdkError::Reservation { ip, port, reason: error.to_string() })
    }

    fn bind(ip: Ipv4Addr, port: u16) -> io::Result<PortReservation> {
        let socket = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
        let bound = socket.bind(&SocketAddr::from((ip, port)).into());
        if let Err(error) = bound {
            if error.raw_os_error() != Some(libc::EADDRNOTAVAIL) {
                return Err(error);
            }
            socket.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())?;
        }
        // A classic BPF program of one instruction, "return 0": keep no byte of anything.
        const BPF_RET_K: u16 = 0x06;
        socket.attach_filter(&[libc::sock_filter { code: BPF_RET_K, jt: 0, jf: 0, k: 0 }])?;
        let port = socket.local_addr()?.as_socket().map_or(port, |address| address.port());
        Ok(PortReservation { _socket: socket, port })
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserved_port_is_held_until_the_reservation_drops() {
        let reservation = PortReservation::new(Ipv4Addr::LOCALHOST, 0).unwrap();
        assert_ne!(reservation.port(), 0);
        let error = PortReservation::new(Ipv4Addr::LOCALHOST, reservation.port()).err().unwrap();
        let expected = format!("cannot reserve UDP port {} at 127.0.0.1: ", reservation.port());
        assert!(error.to_string().starts_with(&expected), "{error}");
        let port = reservation.port();
        drop(reservation);
        assert_eq!(PortReservation::new(Ipv4Addr::LOCALHOST, port).unwrap().port(), port);
    }

    #[test]
    fn an_address_not_the_kernels_reserves_the_port_at_every_address() {
        // TEST-NET-1: assigned to no interface here.
        let reservation = PortReservation::new(Ipv4Addr::new(192, 0, 2, 1), 0).unwrap();
        let taken = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, reservation.port()));
        assert!(taken.is_err(), "port {} is free on loopback", reservation.port());
    }
}
