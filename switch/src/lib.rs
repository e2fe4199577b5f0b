//! netagg's software switch, startable in process: the aggregation engine behind a UDP
//! data path, and a TCP control plane where workers register.
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
//! println!("workers register at {}", switch.control_addr());
//! switch.stop()?; // dropping it stops it too, ignoring a data path error
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]

mod control;
mod datapath;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use netagg_aggregator::EngineLimits;

use crate::control::ControlPlane;
use crate::datapath::{Command, DataPath};
pub use crate::datapath::{Counters, SOCKET_BUFFER as DATA_SOCKET_BUFFER};

/// Why a switch could not start, or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum SwitchError {
    #[error("cannot listen on {address}: {source}")]
    Listen { address: SocketAddr, source: io::Error },
    #[error("cannot bind UDP {address}: {source}")]
    Bind { address: SocketAddr, source: io::Error },
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
    data_addr: SocketAddr,
    commands: Sender<Command>,
    plane: Arc<ControlPlane>,
    threads: Threads,
}

/// The switch's threads; each is `None` before it starts and once it is joined.
#[derive(Default)]
struct Threads {
    datapath: Option<JoinHandle<io::Result<()>>>,
    acceptor: Option<JoinHandle<()>>,
    events: Option<JoinHandle<()>>,
}

/// How long [`Switch::counters`] waits for the data path to answer.
const COUNTERS_WAIT: Duration = Duration::from_secs(2);

impl Switch {
    /// Binds the control (TCP) and data (UDP) addresses of `settings`, port 0 choosing
    /// a free port, and starts serving with its limits and faults. `stats_interval` and
    /// `log_level` are left to the caller, who owns the output and the logger.
    pub fn start(settings: &netagg_config::Switch) -> Result<Switch, SwitchError> {
        let control = TcpListener::bind(settings.control)
            .map_err(|source| SwitchError::Listen { address: settings.control, source })?;
        let data = netagg_udp::BatchSocket::bind(settings.data, DATA_SOCKET_BUFFER)
            .map_err(|source| SwitchError::Bind { address: settings.data, source })?;
        let control_addr = control.local_addr().map_err(SwitchError::Start)?;
        let data_addr = data.local_addr().map_err(SwitchError::Start)?;

        let (commands, command_receiver) = crossbeam_channel::unbounded();
        let (events, event_receiver) = crossbeam_channel::unbounded();
        let plane = ControlPlane::new(commands.clone(), data_addr.port());
        // Built before any thread starts, so that a failed start stops what did start.
        let mut switch = Switch { control_addr, data_addr, commands, plane, threads: Threads::default() };
        if settings.faults.is_active() {
            tracing::warn!(faults = ?settings.faults, "injecting faults into the data path");
        }
        let datapath = DataPath::new(data, limits(settings), &settings.faults, command_receiver, events);
        switch.threads.datapath = Some(spawn("datapath", move || datapath.run())?);
        let plane = Arc::clone(&switch.plane);
        switch.threads.acceptor = Some(spawn("control", move || plane.serve(control))?);
        let plane = Arc::clone(&switch.plane);
        switch.threads.events = Some(spawn("control-events", move || plane.handle_events(event_receiver))?);
        tracing::info!(%control_addr, %data_addr, "switch ready");
        Ok(switch)
    }

    /// The TCP address workers register at, with the port actually bound.
    pub fn control_addr(&self) -> SocketAddr {
        self.control_addr
    }

    /// The UDP address of the data path, with the port actually bound.
    pub fn data_addr(&self) -> SocketAddr {
        self.data_addr
    }

    /// False once the data path has stopped on its own (a socket error or a panic);
    /// [`Switch::stop`] then reports why.
    pub fn is_running(&self) -> bool {
        self.threads.datapath.as_ref().is_some_and(|datapath| !datapath.is_finished())
    }

    /// A snapshot of the data path's counters; `None` if it does not answer in time.
    pub fn counters(&self) -> Option<Counters> {
        let (reply, result) = crossbeam_channel::bounded(1);
        self.commands.send(Command::Counters { reply }).ok()?;
        result.recv_timeout(COUNTERS_WAIT).ok()
    }

    /// Stops the switch and waits for its threads; the error is the data path's, if it
    /// failed.
    pub fn stop(mut self) -> Result<(), SwitchError> {
        self.shut_down()
    }

    /// Stops whatever is running; a second call finds nothing to do.
    fn shut_down(&mut self) -> Result<(), SwitchError> {
        // No new connections first, then no connection threads, so that nothing talks to
        // the data path once it is told to stop.
        if let Some(acceptor) = self.threads.acceptor.take() {
            self.plane.stop_accepting();
            // Unwoken, the acceptor would block its joiner for ever: it is left to exit
            // with the process instead.
            if wake(self.control_addr) {
                let _ = acceptor.join();
            }
        }
        self.plane.close_connections();
        let _ = self.commands.send(Command::Shutdown);
        let result = match self.threads.datapath.take().map(JoinHandle::join) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(error))) => Err(SwitchError::DataPath(error)),
            Some(Err(_)) => Err(SwitchError::DataPathPanicked),
        };
        // The data path's end closed the event channel, which ends this thread.
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
