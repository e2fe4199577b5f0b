//! Backends: how a worker thread's packets reach the switch and come back.
//!
//! The protocol core above works in whole datagrams, so a backend only moves bytes: a
//! packet-level backend (UDP, DPDK) sends each as one datagram and busy-polls or sleeps
//! on its ring or socket; a message-level backend (RDMA) carries each as one message in
//! registered memory. The core writes each datagram straight into a buffer the backend
//! lends ([`Transport::send_buffer`]), so a backend with buffers of its own (a GSO
//! batch, an mbuf, a registered region) needs no copy. Nothing above this module changes
//! with the backend.
//!
//! [`open`] is the one place where the configured backend becomes transports; a new
//! backend adds a module here and an arm there. DPDK and RDMA are Cargo features of the
//! same names (on by default): a build without one refuses its backend by name. [`faults::FaultyTransport`] wraps any
//! of them to inject faults.

#[cfg(feature = "dpdk")]
pub mod dpdk;
pub mod dummy;
pub mod faults;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod udp;

use std::io;
use std::net::IpAddr;
use std::time::Duration;

use netagg_config::{BackendKind, Config};
use netagg_wire::packet::HEADER_LEN;
use netagg_wire::{Endpoint, Integrity, Packet, SlotSplit};

use crate::Error;

/// One worker thread's channel to the switch.
pub trait Transport: Send {
    /// Lends a buffer of at least `len` bytes for the next datagram to the switch.
    fn send_buffer(&mut self, len: usize) -> &mut [u8];
    /// Queues the first `len` bytes of the buffer [`Transport::send_buffer`] lent last
    /// as one datagram. It may leave at once or at [`Transport::flush`].
    fn send(&mut self, len: usize) -> io::Result<()>;
    /// Sends whatever [`Transport::send`] queued.
    fn flush(&mut self) -> io::Result<()>;
    /// Waits up to `timeout` for datagrams from the switch and hands each to `sink`;
    /// returns how many arrived (0 when the time ran out).
    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> io::Result<usize>;

    /// What carries the packets, for people: the backend, its device or address.
    fn describe(&self) -> String {
        "a transport of the program's own".into()
    }

    /// Queues a copy of `datagram`: [`Transport::send_buffer`] and [`Transport::send`]
    /// for a datagram that already exists.
    fn send_copy(&mut self, datagram: &[u8]) -> io::Result<()> {
        self.send_buffer(datagram.len())[..datagram.len()].copy_from_slice(datagram);
        self.send(datagram.len())
    }

    /// Fails the connection to the switch as a failing device would, to inject that
    /// fault (`sever_after` of `[faults]`); a transport without a connection has none to
    /// fail.
    fn sever(&mut self) {}
}

/// A transport to a real switch: the context announces its endpoint when it registers,
/// then connects it to the data endpoints of the switches' accepts.
pub trait SwitchTransport: Transport {
    /// Where the switch reaches this worker thread. An unspecified IP stands for the
    /// address the registration comes from.
    fn endpoint(&self) -> Endpoint;
    /// From now on exchanges datagrams with the data paths of `paths`, each datagram with
    /// the endpoint that owns its slot; an unspecified IP in an endpoint stands for its
    /// switch's control address.
    fn connect(&mut self, paths: &DataPaths) -> io::Result<()>;
}

/// Where a session's packets go: the switches (shards) that share its slots, each with
/// its data endpoints and the rule of its accept that names the one owning each slot (a
/// lane of a switch with several data-path threads, say).
///
/// Switch `k` of `K` owns the contiguous range of slots [`SlotSplit::Ranges`] gives
/// endpoint `k` of `K`; among its own endpoints, a slot goes where its accept's split over
/// all the session's slots says, as with one switch, since a switch is not told which
/// slots are its.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataPaths {
    /// In `general.switches` order; never empty.
    pub switches: Vec<SwitchPaths>,
    /// The session's slots.
    pub slots: u16,
}

/// One switch's part of a session's data path: what its accept said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchPaths {
    /// In the accept's order; never empty.
    pub endpoints: Vec<Endpoint>,
    pub split: SlotSplit,
    /// The two ends of its control connection.
    pub control: ControlAddresses,
}

impl DataPaths {
    /// The slots switch `switch` owns: a contiguous range, the first switch's the lowest.
    pub fn switch_slots(&self, switch: usize) -> std::ops::Range<u16> {
        SlotSplit::Ranges.owned(switch, self.slots, self.switches.len())
    }

    /// The slots each data endpoint takes, with its switch's index, in
    /// [`DataPaths::endpoints`] order: its switch's range cut by its accept's split over
    /// all the session's slots (empty for a lane that owns none of its switch's slots).
    pub fn endpoint_slots(&self) -> impl Iterator<Item = (usize, std::ops::Range<u16>)> + '_ {
        self.switches.iter().enumerate().flat_map(move |(switch, paths)| {
            let owned = self.switch_slots(switch);
            let endpoints = paths.endpoints.len();
            (0..endpoints).map(move |endpoint| {
                let lane = paths.split.owned(endpoint, self.slots, endpoints);
                let start = lane.start.max(owned.start);
                (switch, start..lane.end.min(owned.end).max(start))
            })
        })
    }

    /// Every switch's data endpoints, switch after switch, each with its switch's
    /// control addresses: [`DataPaths::owner`] indexes this order.
    pub fn endpoints(&self) -> impl Iterator<Item = (&Endpoint, ControlAddresses)> {
        self.switches
            .iter()
            .flat_map(|switch| switch.endpoints.iter().map(|endpoint| (endpoint, switch.control)))
    }

    /// The index in [`DataPaths::endpoints`] of the endpoint that takes `datagram`: the
    /// owner of its slot, or the first for bytes too short to name one (mangled by a
    /// fault injector, say).
    pub fn owner(&self, datagram: &[u8]) -> usize {
        if datagram.len() < HEADER_LEN {
            return 0;
        }
        let slot = Packet::new_unchecked(datagram).slot();
        // A slot beyond the session's, as corruption may make, still goes somewhere.
        let switches = self.switches.len();
        let switch = SlotSplit::Ranges.owner(slot, self.slots, switches).min(switches - 1);
        let before: usize = self.switches[..switch].iter().map(|s| s.endpoints.len()).sum();
        let SwitchPaths { endpoints, split, .. } = &self.switches[switch];
        before + split.owner(slot, self.slots, endpoints.len()).min(endpoints.len() - 1)
    }

    /// The one endpoint of a transport that reaches a single one (a test's in-memory
    /// transport), with its switch's control addresses; an error naming `backend`
    /// otherwise.
    pub fn single(&self, backend: &str) -> io::Result<(&Endpoint, ControlAddresses)> {
        let refused = |message: String| Err(io::Error::new(io::ErrorKind::Unsupported, message));
        match &self.switches[..] {
            [one] => match &one.endpoints[..] {
                [endpoint] => Ok((endpoint, one.control)),
                all => refused(format!(
                    "the switch announces {} data endpoints (switch.threads > 1); the {backend} backend \
                     reaches one: run that switch with switch.threads = 1, or use backend = udp",
                    all.len()
                )),
            },
            all => refused(format!(
                "the session spans {} switches (general.switches); the {backend} backend reaches one: \
                 list one switch, or use backend = udp",
                all.len()
            )),
        }
    }
}

impl std::fmt::Display for DataPaths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut separator = "";
        for (endpoint, _) in self.endpoints() {
            write!(f, "{separator}{endpoint}")?;
            separator = ", ";
        }
        Ok(())
    }
}

/// The two ends of the control connection a context registered over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlAddresses {
    /// The switch's address.
    pub switch: IpAddr,
    /// This side's: where an endpoint announced with an unspecified IP is reached.
    pub local: IpAddr,
}

/// What a backend gives a context: its worker threads' transports.
pub enum Links {
    /// Transports to a switch, one per worker thread, registered with it.
    Switch(Vec<Box<dyn SwitchTransport>>),
    /// Transports that emulate the switch in process (the dummy backend), with the
    /// session id and token the workers use (no registration), and whether the workers
    /// seal and check their packets, as the emulated switch does.
    Emulated { transports: Vec<Box<dyn Transport>>, session: u32, token: u64, integrity: Integrity },
}

/// The transports of the configured backend, one per worker thread.
pub fn open(config: &Config) -> Result<Links, Error> {
    let threads = config.general.num_worker_threads as usize;
    match config.general.backend {
        BackendKind::Dummy => dummy::links(config),
        BackendKind::Udp => {
            let transports = (0..threads)
                .map(|_| {
                    let transport = udp::UdpTransport::bind(config.udp.bind_ip, config.udp.socket_buffer)?;
                    Ok(Box::new(transport) as Box<dyn SwitchTransport>)
                })
                .collect::<io::Result<_>>()
                .map_err(|source| Error::io("binding the worker threads' UDP sockets", source))?;
            Ok(Links::Switch(transports))
        }
        #[cfg(feature = "dpdk")]
        BackendKind::Dpdk => Ok(Links::Switch(dpdk::transports(config)?)),
        #[cfg(feature = "rdma")]
        BackendKind::Rdma => Ok(Links::Switch(rdma::transports(config)?)),
        #[cfg(not(all(feature = "dpdk", feature = "rdma")))]
        backend => Err(Error::NotBuiltIn { backend }),
    }
}

#[cfg(test)]
mod paths_tests {
    use netagg_wire::{ElementType, MessageType, PacketRepr};

    use super::*;

    /// `switches` switches of `endpoints` endpoints each, their ports numbered in a row.
    fn paths(switches: usize, endpoints: usize) -> DataPaths {
        let control = ControlAddresses { switch: [10, 0, 0, 1].into(), local: [10, 0, 0, 9].into() };
        let switches = (0..switches)
            .map(|switch| SwitchPaths {
                endpoints: (0..endpoints)
                    .map(|i| Endpoint::Udp(([10, 0, 0, 1], 48864 + (switch * endpoints + i) as u16).into()))
                    .collect(),
                split: SlotSplit::Ranges,
                control,
            })
            .collect();
        DataPaths { switches, slots: 8 }
    }

    fn packet(slot: u16) -> Vec<u8> {
        let repr = PacketRepr { slot, ..PacketRepr::new(MessageType::Data, ElementType::Int32, 1, 2, 0) };
        let mut bytes = vec![0; repr.buffer_len()];
        repr.emit(&mut bytes).unwrap();
        bytes
    }

    #[test]
    fn each_endpoint_takes_its_switchs_slots_that_its_lane_owns() {
        let slots = |switches, endpoints| -> Vec<_> { paths(switches, endpoints).endpoint_slots().collect() };
        assert_eq!(slots(1, 2), [(0, 0..4), (0, 4..8)]);
        assert_eq!(slots(2, 1), [(0, 0..4), (1, 4..8)]);
        // Each switch's lanes split all 8 slots: the second switch's first lane owns none
        // of its 4, and the first switch's second lane none of its own.
        assert_eq!(slots(2, 2), [(0, 0..4), (0, 4..4), (1, 4..4), (1, 4..8)]);
    }

    #[test]
    fn each_datagram_goes_to_the_owner_of_its_slot() {
        let owners: Vec<usize> = (0..8).map(|slot| paths(1, 2).owner(&packet(slot))).collect();
        assert_eq!(owners, [0, 0, 0, 0, 1, 1, 1, 1]);
        // A slot past the session's, or bytes too short for a header, still go somewhere.
        assert_eq!(paths(1, 2).owner(&packet(40)), 1);
        assert_eq!(paths(1, 2).owner(&[1, 2, 3]), 0);
        assert_eq!(paths(1, 1).owner(&packet(7)), 0);
    }

    #[test]
    fn switches_own_contiguous_ranges_and_their_lanes_split_as_they_would_alone() {
        let owners: Vec<usize> = (0..8).map(|slot| paths(2, 1).owner(&packet(slot))).collect();
        assert_eq!(owners, [0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!((paths(2, 1).switch_slots(0), paths(2, 1).switch_slots(1)), (0..4, 4..8));
        let four = paths(4, 1);
        assert_eq!(
            (0..8).map(|slot| four.owner(&packet(slot))).collect::<Vec<_>>(),
            [0, 0, 1, 1, 2, 2, 3, 3]
        );
        // Switch 1 of 2, with two lanes: its slots 4 to 7 all fall in its second lane's half
        // of the session, endpoint 1 of its own (3 of all).
        let lanes = paths(2, 2);
        assert_eq!(
            (0..8).map(|slot| lanes.owner(&packet(slot))).collect::<Vec<_>>(),
            [0, 0, 0, 0, 3, 3, 3, 3]
        );
        assert_eq!(lanes.endpoints().count(), 4);
        assert_eq!(paths(3, 1).owner(&packet(200)), 2);
    }

    #[test]
    fn a_backend_that_reaches_one_endpoint_refuses_several_by_name() {
        let one = paths(1, 1);
        assert_eq!(one.single("memory").unwrap(), (&one.switches[0].endpoints[0], one.switches[0].control));
        let error = paths(1, 2).single("memory").unwrap_err();
        assert_eq!(
            error.to_string(),
            "the switch announces 2 data endpoints (switch.threads > 1); the memory backend reaches one: run that \
             switch with switch.threads = 1, or use backend = udp"
        );
        let error = paths(2, 1).single("memory").unwrap_err();
        assert_eq!(
            error.to_string(),
            "the session spans 2 switches (general.switches); the memory backend reaches one: list one switch, \
             or use backend = udp"
        );
        assert_eq!(paths(1, 2).to_string(), "udp 10.0.0.1:48864, udp 10.0.0.1:48865");
    }
}

#[cfg(all(test, not(all(feature = "dpdk", feature = "rdma"))))]
mod tests {
    use super::*;

    /// A backend whose feature this build left out is refused by name, before anything
    /// is opened, with the feature that brings it back.
    #[test]
    fn a_backend_left_out_of_the_build_is_refused_naming_its_feature() {
        let left_out =
            [(BackendKind::Dpdk, cfg!(feature = "dpdk")), (BackendKind::Rdma, cfg!(feature = "rdma"))];
        for (backend, _) in left_out.into_iter().filter(|(_, built)| !built) {
            let mut config = Config::default();
            config.general.backend = backend;
            let Err(error) = open(&config) else { panic!("{backend} opened without its feature") };
            assert_eq!(error, Error::NotBuiltIn { backend });
            let message = error.to_string();
            assert!(message.starts_with(&format!("backend = {backend} is not built into")), "{message}");
            assert!(message.contains(&format!("the Cargo feature `{backend}`")), "{message}");
        }
    }
}
