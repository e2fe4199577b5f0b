//! The backends' sections: `[backend.dummy]` and `[backend.udp]`, and the DPDK and RDMA
//! ones that the switch's data path shares (`[backend.dpdk]` and `[switch.dpdk]`,
//! `[backend.rdma]` and `[switch.rdma]`).

use std::net::IpAddr;

use crate::kind::named_enum;

/// `[backend.dummy]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Dummy {
    /// Emulated link bandwidth in Mbit/s; 0 sends as fast as the CPU allows.
    pub bandwidth: f64,
    /// Sum as the switch would; false returns each packet unchanged.
    pub process_packets: bool,
}

/// `[backend.udp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Udp {
    /// Local address the worker threads' sockets bind to.
    pub bind_ip: IpAddr,
    /// Socket send and receive buffer size, bytes (0: the system default).
    pub socket_buffer: usize,
}

/// `[backend.dpdk]` and `[switch.dpdk]`: a DPDK port and the UDP endpoint on it.
#[derive(Debug, Clone, PartialEq)]
pub struct Dpdk {
    /// EAL's arguments, split at white space; EAL starts once per process.
    pub eal_args: String,
    /// The device: a virtual device's arguments or a PCI address.
    pub device: String,
    /// The endpoint's IPv4 address; unspecified: the side's default (see the keys).
    pub ip: IpAddr,
    /// Where every frame goes, if set; else each peer's MAC, by ARP.
    pub peer_mac: Option<[u8; 6]>,
    pub rx_descriptors: u16,
    pub tx_descriptors: u16,
    /// Mbufs in the port's pool.
    pub pool_size: u32,
    /// Frames received or sent at a time.
    pub burst: u16,
    /// How an idle receive queue is watched.
    pub poll: PollMode,
}

impl Dpdk {
    /// EAL's arguments, one string each.
    pub fn eal_arguments(&self) -> Vec<String> {
        self.eal_args.split_whitespace().map(String::from).collect()
    }

    /// This section in the DPDK crate's terms; `section` (`backend.dpdk`,
    /// `switch.dpdk`) is how its errors name the keys.
    #[cfg(feature = "dpdk")]
    pub fn settings(&self, section: &'static str) -> netagg_dpdk::Settings {
        netagg_dpdk::Settings {
            section,
            eal_args: self.eal_arguments(),
            device: self.device.clone(),
            peer_mac: self.peer_mac.map(netagg_dpdk::MacAddr),
            rx_descriptors: self.rx_descriptors,
            tx_descriptors: self.tx_descriptors,
            pool_size: self.pool_size,
            burst: self.burst,
            poll: match self.poll {
                PollMode::Busy => netagg_dpdk::PollMode::Busy,
                PollMode::Adaptive => netagg_dpdk::PollMode::Adaptive,
            },
        }
    }
}

named_enum! {
    /// How a DPDK endpoint waits for frames.
    pub enum PollMode {
        /// Polls the queue without pause: the lowest latency, a core per polling thread.
        Busy = "busy",
        /// Polls without pause while frames come, naps between polls once the queue has
        /// been idle a while: for cores shared with other work.
        Adaptive = "adaptive",
    }
}

/// `[backend.rdma]` and `[switch.rdma]`: the RDMA device and the queue pairs on it.
#[derive(Debug, Clone, PartialEq)]
pub struct Rdma {
    /// The verbs device (rxe0, mlx5_0); empty: the one rdma_cm routes the peer through.
    pub device: String,
    /// The device's port, from 1.
    pub device_port: u8,
    /// With a named device, the GID whose address the endpoint takes.
    pub gid_index: u32,
    /// Messages each queue pair keeps posted for receiving, and sends in flight at most.
    pub queue_depth: u32,
    /// Bytes of each registered receive and send buffer; 0: what a packet needs.
    pub message_size: usize,
    /// How a queue pair's completions are waited for.
    pub poll: RdmaPoll,
}

impl Rdma {
    /// This section in the RDMA crate's terms.
    #[cfg(feature = "rdma")]
    pub fn settings(&self) -> netagg_rdma::Settings {
        netagg_rdma::Settings {
            device: self.device.clone(),
            device_port: self.device_port,
            gid_index: self.gid_index,
            queue_depth: self.queue_depth,
            wait: match self.poll {
                RdmaPoll::Busy => netagg_rdma::Wait::Busy,
                RdmaPoll::Event => netagg_rdma::Wait::Event,
            },
        }
    }
}

named_enum! {
    /// How an RDMA endpoint waits for completions.
    pub enum RdmaPoll {
        /// Polls the completion queue without pause: the lowest latency, a core per polling
        /// thread.
        Busy = "busy",
        /// Sleeps on the completion channel until the device signals a completion: for cores
        /// shared with other work.
        Event = "event",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::ini;
    use crate::{BackendKind, Config, SwitchTransport};

    #[test]
    fn rdma_sections_are_read_and_set_from_the_environment() {
        let config = ini(
            "[general]\nbackend = rdma\n[backend.rdma]\ndevice = mlx5_0\ndevice_port = 2\ngid_index = 3\n\
             queue_depth = 1024\nmessage_size = 4096\npoll = busy\n[switch]\ntransport = rdma\n\
             [switch.rdma]\nqueue_depth = 64\n",
        )
        .unwrap();
        assert_eq!(config.general.backend, BackendKind::Rdma);
        assert_eq!(config.switch.transport, SwitchTransport::Rdma);
        assert_eq!(
            config.rdma,
            Rdma {
                device: "mlx5_0".into(),
                device_port: 2,
                gid_index: 3,
                queue_depth: 1024,
                message_size: 4096,
                poll: RdmaPoll::Busy,
            }
        );
        assert_eq!(config.switch.rdma, Rdma { queue_depth: 64, ..Rdma::default() });
        let defaults = Rdma::default();
        assert_eq!(
            (defaults.device.as_str(), defaults.device_port, defaults.gid_index, defaults.queue_depth),
            ("", 1, 1, 512)
        );
        assert_eq!((defaults.message_size, defaults.poll), (0, RdmaPoll::Event));

        let vars = [
            ("NETAGG_BACKEND_RDMA__DEVICE".to_string(), "rxe0".to_string()),
            ("NETAGG_SWITCH_RDMA__POLL".to_string(), "busy".to_string()),
        ];
        let config = Config::load_with_environment(None, &vars).unwrap();
        assert_eq!(config.rdma.device, "rxe0");
        assert_eq!(config.switch.rdma.poll, RdmaPoll::Busy);
        assert_eq!(config.switch.rdma.device, "");
    }
}
