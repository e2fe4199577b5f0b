//! netagg's software switch, startable in process: the aggregation engine behind a data
//! port (UDP, or any [`DataPort`]), and a TCP control plane where workers register.
//!
//! `netagg-switch` (the binary) is a shell over [`Switch`]: it parses flags, handles
//! signals and prints counters. Benchmarks and tests start a [`Switch`] directly, on port
//! 0 if they like, and read the ports it bound:
//!
//! ```no_run
//! let mut settings = netagg_config::Config::default().switch;
//! settings.control = "127.0.0.1:0".parse()?;
//! settings.data = "127.0.0.1:0".parse()?;
//! let switch = netagg_switch::Switch::start(&settings)?;
//! println!("workers register at {}, send to {:?}", switch.control_addr(), switch.data_endpoints());
//! switch.stop()?; // dropping it stops it too, ignoring a data path error
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]

mod control;
mod datapath;
mod lanes;
mod metrics;
pub mod port;
mod tree;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use netagg_aggregator::control::{ControlLimits, Rack};
use netagg_aggregator::EngineLimits;
use netagg_config::SwitchTransport;
use netagg_wire::Endpoint;

use crate::control::ControlPlane;
pub use crate::datapath::Counters;
use crate::datapath::{DataPath, Lane};
use crate::lanes::Lanes;
pub use crate::metrics::resident_bytes;
use crate::metrics::MetricsServer;
pub use crate::port::udp::SOCKET_BUFFER as DATA_SOCKET_BUFFER;
pub use crate::port::DataPort;
use crate::tree::UpperSwitch;

/// Why a switch could not start, or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum SwitchError {
    #[error("cannot listen on {address}: {source}")]
    Listen { address: SocketAddr, source: io::Error },
    #[error("cannot bind UDP {address}: {source}")]
    Bind { address: SocketAddr, source: io::Error },
    /// `switch.threads` above 1 for a transport whose data path runs on one thread.
    #[error(
        "switch.threads = {threads}, but the {transport} data path runs on one thread: only udp \
         runs several; set switch.threads = 1"
    )]
    Threads { transport: SwitchTransport, threads: u16 },
    /// The data port of the last of `switch.threads` lanes would be past port 65535.
    #[error("switch.data = {data} leaves no room for {threads} data ports (one per thread) below 65536")]
    Ports { data: SocketAddr, threads: u16 },
    #[error("cannot start the DPDK data path: {0}")]
    Dpdk(String),
    #[error("cannot start the RDMA data path: {0}")]
    Rdma(String),
    /// The configured transport is a Cargo feature this build left out.
    #[error(
        "switch.transport = {transport} is not built into this netagg-switch: build it with the Cargo \
         feature `{transport}` (on by default; scripts/install-deps installs the system libraries \
         it needs)"
    )]
    NotBuiltIn { transport: SwitchTransport },
    #[error("cannot serve the metrics at {address} (switch.metrics): {source}")]
    Metrics { address: SocketAddr, source: io::Error },
    #[error("cannot start the switch: {0}")]
    Start(io::Error),
    #[error("data path failed: {0}")]
    DataPath(io::Error),
    #[error("data path panicked")]
    DataPathPanicked,
}

/// A running switch: its data path, control plane and their threads.
///
/// [`Switch::stop`], or dropping it, closes every worker's control connection (their
/// jobs fail as if the switch process had exited), stops the data path and joins every
/// thread the switch started.
pub struct Switch {
    control_addr: SocketAddr,
    data_endpoints: Vec<Endpoint>,
    lanes: Lanes,
    plane: Arc<ControlPlane>,
    threads: Threads,
    /// The metrics endpoint, if `switch.metrics` asks for one.
    metrics: Option<MetricsServer>,
}

/// The switch's threads; each is `None` before it starts and once it is joined.
#[derive(Default)]
struct Threads {
    /// One per lane of the data path, in lane order.
    datapath: Vec<JoinHandle<io::Result<()>>>,
    acceptor: Option<JoinHandle<()>>,
    events: Option<JoinHandle<()>>,
    timers: Option<JoinHandle<()>>,
}

/// How long [`Switch::counters`] waits for the data path to answer.
const COUNTERS_WAIT: Duration = Duration::from_secs(2);

impl Switch {
    /// Binds the control (TCP) and data (UDP) addresses of `settings`, port 0 choosing
    /// a free port, and starts serving with its limits and faults. `stats_interval` and
    /// `log_level` are left to the caller, who owns the output and the logger.
    ///
    /// This is where the configured transport becomes [`DataPort`]s, one per lane
    /// (`switch.threads`): a new transport adds its port here. UDP runs any number of
    /// lanes, lane `i` at the data port + `i` (each on a free port if that is 0); DPDK
    /// and RDMA run one, and refuse more by name. A rack's switch (`switch.upstream`)
    /// sends up from the same port, which RDMA's cannot: [`netagg_config::Config::validate`]
    /// refuses that combination, as loading a config does. They are Cargo features of the
    /// same names (on by default): a build without one refuses its transport by name.
    pub fn start(settings: &netagg_config::Switch) -> Result<Switch, SwitchError> {
        let threads = settings.threads.max(1);
        if threads > 1 && settings.transport != SwitchTransport::Udp {
            return Err(SwitchError::Threads { transport: settings.transport, threads });
        }
        match settings.transport {
            SwitchTransport::Udp => {
                let ports = (0..threads)
                    .map(|lane| {
                        let mut address = settings.data;
                        if address.port() != 0 {
                            let port = address.port().checked_add(lane);
                            address
                                .set_port(port.ok_or(SwitchError::Ports { data: settings.data, threads })?);
                        }
                        port::UdpPort::bind(address).map_err(|source| SwitchError::Bind { address, source })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Switch::start_with_ports(settings, ports)
            }
            #[cfg(feature = "dpdk")]
            SwitchTransport::Dpdk => {
                let port = port::DpdkPort::open(settings).map_err(SwitchError::Dpdk)?;
                Switch::start_with_port(settings, port)
            }
            #[cfg(feature = "rdma")]
            SwitchTransport::Rdma => {
                let port = port::RdmaPort::open(settings).map_err(SwitchError::Rdma)?;
                Switch::start_with_port(settings, port)
            }
            #[cfg(not(all(feature = "dpdk", feature = "rdma")))]
            transport => Err(SwitchError::NotBuiltIn { transport }),
        }
    }

    /// [`Switch::start`] with a data port of one's own (a [`port::MemorySocket`] in
    /// tests, say): [`Switch::start_with_ports`] with one lane.
    pub fn start_with_port<P: DataPort>(
        settings: &netagg_config::Switch,
        port: P,
    ) -> Result<Switch, SwitchError> {
        Switch::start_with_ports(settings, vec![port])
    }

    /// [`Switch::start`] with data ports of one's own, one lane each, whatever
    /// `settings.data` and `settings.threads` say. Each port is wrapped in a
    /// [`port::FaultyPort`] (seeded apart) if `settings.faults` sets any fault.
    pub fn start_with_ports<P: DataPort>(
        settings: &netagg_config::Switch,
        ports: Vec<P>,
    ) -> Result<Switch, SwitchError> {
        if !settings.faults.is_active() {
            return Switch::serve(settings, ports);
        }
        tracing::warn!(faults = ?settings.faults, "injecting faults into the data path");
        let faulty = (0u64..)
            .zip(ports)
            .map(|(lane, port)| {
                let faults = netagg_config::Faults {
                    seed: settings.faults.seed.wrapping_add(lane),
                    ..settings.faults
                };
                port::FaultyPort::new(port, &faults)
            })
            .collect();
        Switch::serve(settings, faulty)
    }

    fn serve<P: DataPort>(settings: &netagg_config::Switch, ports: Vec<P>) -> Result<Switch, SwitchError> {
        if ports.is_empty() {
            return Err(SwitchError::Start(io::Error::new(
                io::ErrorKind::InvalidInput,
                "no data port to serve",
            )));
        }
        let control = TcpListener::bind(settings.control)
            .map_err(|source| SwitchError::Listen { address: settings.control, source })?;
        let control_addr = control.local_addr().map_err(SwitchError::Start)?;
        let data_endpoints: Vec<Endpoint> = ports.iter().map(DataPort::endpoint).collect();
        let max_datagram = ports.iter().filter_map(DataPort::max_datagram).min();

        let (events, event_receiver) = crossbeam_channel::unbounded();
        let activity = Arc::new(Mutex::new(Default::default()));
        let channels: Vec<_> = ports.iter().map(|_| crossbeam_channel::unbounded()).collect();
        let lanes =
            Lanes::new(channels.iter().map(|(sender, _)| sender.clone()).collect(), Arc::clone(&activity));
        let plane_limits = ControlLimits { max_datagram, ..control_limits(settings) };
        let upper = (!settings.upstream.is_empty()).then(|| UpperSwitch {
            address: settings.upstream.clone(),
            rack: Rack { index: settings.rack, count: settings.racks },
            data_endpoints: data_endpoints.clone(),
            register_timeout: settings.register_timeout,
        });
        let plane = ControlPlane::new(lanes.clone(), data_endpoints.clone(), plane_limits, upper);
        // Built before any thread starts, so that a failed start stops what did start.
        let mut switch =
            Switch { control_addr, data_endpoints, lanes, plane, threads: Threads::default(), metrics: None };
        let count = ports.len();
        for (index, (port, (_, commands))) in ports.into_iter().zip(channels).enumerate() {
            let lane = Lane { index, count };
            let datapath =
                DataPath::new(port, limits(settings), lane, commands, events.clone(), Arc::clone(&activity));
            let name = if count == 1 { "datapath".to_string() } else { format!("datapath-{index}") };
            switch.threads.datapath.push(spawn(&name, move || datapath.run())?);
        }
        drop(events);
        let plane = Arc::clone(&switch.plane);
        switch.threads.acceptor = Some(spawn("control", move || plane.serve(control))?);
        let plane = Arc::clone(&switch.plane);
        switch.threads.events = Some(spawn("control-events", move || plane.handle_events(event_receiver))?);
        let plane = Arc::clone(&switch.plane);
        switch.threads.timers = Some(spawn("control-timers", move || plane.drive_timers())?);
        if let Some(address) = settings.metrics {
            let metrics = MetricsServer::start(address, switch.lanes.clone(), Arc::clone(&switch.plane))
                .map_err(|source| SwitchError::Metrics { address, source })?;
            tracing::info!(address = %metrics.address(), "serving metrics at /metrics");
            switch.metrics = Some(metrics);
        }
        let data = switch.data_endpoints.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        tracing::info!(%control_addr, %data, "switch ready");
        Ok(switch)
    }

    /// The TCP address workers register at, with the port actually bound.
    pub fn control_addr(&self) -> SocketAddr {
        self.control_addr
    }

    /// Where the metrics endpoint listens (`GET /metrics`), with the port actually bound;
    /// `None` without `switch.metrics`.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsServer::address)
    }

    /// Where the first lane of the data path takes packets, with the port actually
    /// bound: with one lane, where workers send all their packets.
    pub fn data_endpoint(&self) -> Endpoint {
        self.data_endpoints[0]
    }

    /// Where each lane of the data path takes packets, in lane order, as every accept
    /// announces them.
    pub fn data_endpoints(&self) -> &[Endpoint] {
        &self.data_endpoints
    }

    /// False once a lane of the data path has stopped on its own (a socket error or a
    /// panic); [`Switch::stop`] then reports why.
    pub fn is_running(&self) -> bool {
        !self.threads.datapath.is_empty() && self.threads.datapath.iter().all(|lane| !lane.is_finished())
    }

    /// A snapshot of the data path's counters, every lane's added up; `None` if a lane
    /// does not answer in time.
    pub fn counters(&self) -> Option<Counters> {
        self.lanes.counters(COUNTERS_WAIT)
    }

    /// Stops the switch and waits for its threads; the error is the data path's, if it
    /// failed.
    pub fn stop(mut self) -> Result<(), SwitchError> {
        self.shut_down()
    }

    /// Stops whatever is running; a second call finds nothing to do.
    fn shut_down(&mut self) -> Result<(), SwitchError> {
        // No scrapes first, no new connections next, then no connection threads, so that
        // nothing talks to the data path once it is told to stop.
        self.metrics = None;
        if let Some(acceptor) = self.threads.acceptor.take() {
            self.plane.stop_accepting();
            // Unwoken, the acceptor would block its joiner for ever: it is left to exit
            // with the process instead.
            if wake(self.control_addr) {
                let _ = acceptor.join();
            }
        }
        self.plane.close_connections();
        if let Some(timers) = self.threads.timers.take() {
            let _ = timers.join();
        }
        self.lanes.shut_down();
        let mut result = Ok(());
        for lane in self.threads.datapath.drain(..) {
            let ended = match lane.join() {
                Ok(Ok(())) => Ok(()),
                Ok(Err(error)) => Err(SwitchError::DataPath(error)),
                Err(_) => Err(SwitchError::DataPathPanicked),
            };
            // The first lane's error is the one reported.
            result = result.and(ended);
        }
        // The lanes' ends closed the event channel, which ends this thread.
        if let Some(events) = self.threads.events.take() {
            let _ = events.join();
        }
        result
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        if let Err(error) = self.shut_down() {
            tracing::warn!(%error, "the switch stopped with an error");
        }
    }
}

/// The engine's limits from the `[switch]` settings.
fn limits(settings: &netagg_config::Switch) -> EngineLimits {
    EngineLimits {
        max_sessions: settings.max_sessions,
        max_workers: settings.max_workers,
        max_slots: settings.max_slots,
        max_bytes: settings.max_memory,
        max_session_bytes: settings.max_session_memory,
        // The settings' zero means never; the engine's would expire every session at once.
        session_idle_timeout: match settings.idle_timeout {
            Duration::ZERO => Duration::MAX,
            timeout => timeout,
        },
        ..EngineLimits::default()
    }
}

/// The control plane's limits from the `[switch]` settings, connections capped to what
/// the process may open: a connection holds one descriptor, and the switch keeps
/// [`DESCRIPTOR_RESERVE`] for everything else.
fn control_limits(settings: &netagg_config::Switch) -> ControlLimits {
    let descriptors = rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(u64::MAX, |(soft, _)| soft);
    let room = descriptors.saturating_sub(DESCRIPTOR_RESERVE).max(1);
    let max_connections = settings.max_connections.min(usize::try_from(room).unwrap_or(usize::MAX));
    if max_connections < settings.max_connections {
        tracing::warn!(
            configured = settings.max_connections,
            allowed = max_connections,
            descriptors,
            "switch.max_connections lowered to what the descriptor limit (ulimit -n) allows"
        );
    }
    ControlLimits {
        max_connections,
        max_sessions: settings.max_sessions,
        max_workers: settings.max_workers,
        register_timeout: settings.register_timeout,
        data_networks: settings.data_networks.clone(),
        max_datagram: None,
    }
}

/// Descriptors kept for all but control connections: sockets, the listener, logs.
const DESCRIPTOR_RESERVE: u64 = 64;

fn spawn<T: Send + 'static>(
    name: &str,
    body: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<T>, SwitchError> {
    std::thread::Builder::new().name(name.into()).spawn(body).map_err(SwitchError::Start)
}

/// Unblocks the control plane's `accept` with a connection of our own: std offers no
/// other portable way to interrupt it. The acceptor sees it is stopping and drops it.
/// False if the connection failed.
fn wake(control_addr: SocketAddr) -> bool {
    let mut address = control_addr;
    // A wildcard address is not one to connect to; loopback reaches the same listener.
    if address.ip().is_unspecified() {
        address.set_ip(match address {
            SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    match TcpStream::connect_timeout(&address, Duration::from_secs(1)) {
        Ok(_) => true,
        Err(error) => {
            tracing::warn!(%error, %address, "cannot wake the control plane to stop it");
            false
        }
    }
}

#[cfg(all(test, not(all(feature = "dpdk", feature = "rdma"))))]
mod tests {
    use super::*;

    /// A transport whose feature this build left out is refused by name, before any
    /// address is bound, with the feature that brings it back.
    #[test]
    fn a_transport_left_out_of_the_build_is_refused_naming_its_feature() {
        let left_out = [
            (SwitchTransport::Dpdk, cfg!(feature = "dpdk")),
            (SwitchTransport::Rdma, cfg!(feature = "rdma")),
        ];
        for (transport, _) in left_out.into_iter().filter(|(_, built)| !built) {
            let settings = netagg_config::Switch { transport, ..netagg_config::Switch::default() };
            let Err(error) = Switch::start(&settings) else {
                panic!("{transport} started without its feature")
            };
            let message = error.to_string();
            assert!(matches!(error, SwitchError::NotBuiltIn { transport: refused } if refused == transport));
            assert!(
                message.starts_with(&format!("switch.transport = {transport} is not built into")),
                "{message}"
            );
            assert!(message.contains(&format!("the Cargo feature `{transport}`")), "{message}");
        }
    }
}

#[cfg(test)]
mod thread_tests {
    use super::*;

    /// DPDK and RDMA serve one data-path thread: more is refused by name, before any
    /// device or address is touched.
    #[test]
    fn more_than_one_thread_is_refused_for_dpdk_and_rdma_by_name() {
        for transport in [SwitchTransport::Dpdk, SwitchTransport::Rdma] {
            let settings =
                netagg_config::Switch { transport, threads: 2, ..netagg_config::Switch::default() };
            let Err(error) = Switch::start(&settings) else { panic!("{transport} started with 2 threads") };
            assert_eq!(
                error.to_string(),
                format!(
                    "switch.threads = 2, but the {transport} data path runs on one thread: only udp runs \
                     several; set switch.threads = 1"
                )
            );
        }
    }

    /// UDP lanes take consecutive ports from the configured one, and say so when the
    /// last would be past 65535.
    #[test]
    fn udp_threads_take_consecutive_ports() {
        let mut settings = netagg_config::Switch {
            control: "127.0.0.1:0".parse().unwrap(),
            threads: 2,
            ..netagg_config::Switch::default()
        };
        settings.data = "127.0.0.1:65535".parse().unwrap();
        let Err(error) = Switch::start(&settings) else { panic!("a port past 65535") };
        assert_eq!(
            error.to_string(),
            "switch.data = 127.0.0.1:65535 leaves no room for 2 data ports (one per thread) below 65536"
        );
        // A free pair: bind one port, then ask for the two after it.
        let probe = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let base = probe.local_addr().unwrap().port();
        drop(probe);
        settings.data.set_port(base);
        let Ok(switch) = Switch::start(&settings) else { return }; // Taken meanwhile: nothing to check.
        let ports: Vec<u16> = switch.data_endpoints().iter().map(|e| e.socket_addr().port()).collect();
        assert_eq!(ports, [base, base + 1]);
        switch.stop().unwrap();
    }
}
