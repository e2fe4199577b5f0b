//! The network of an emulated run: a namespace holding a bridge (the fabric), one
//! namespace for the switch, one per worker and one per switch host (a switch process
//! on a server of its own, one of a session's shards), each joined to the bridge by a veth
//! pair. Every worker's pair is shaped both ways: `tbf` for the rate (on the worker's
//! end for what it sends, on the fabric's end for what it receives), and, when the
//! link delays or loses frames, `netem` where the kernel has it, else a user-space
//! [`DelayLine`] spliced into the link inside the fabric namespace:
//!
//! ```text
//! worker ns            fabric ns                                       switch ns
//! eth0 (tbf up) ─── w<r> (tbf down) ═ delay line ═ d<r> ─── b<r> ─ br0 ─ sw ─── eth0
//! ```
//!
//! A switch host's pair is shaped by rate both ways as a worker's is (a server's NIC),
//! with no delay or loss: a path from a worker to a switch host then crosses one impaired
//! link, the worker's, as a path to the switch does.
//!
//! A network of [`Racks`] gives each rack a bridge of its own (`rk<r>`), holding its
//! workers' links and its switch hosts', joined to the core bridge by an uplink: a veth
//! pair inside the fabric namespace, shaped by rate each way (on `v<r>`, the rack's end,
//! for what goes up; on `u<r>`, the core's, for what comes down). The switch's namespace
//! and the switch hosts of no rack sit at the core, so that what a rack exchanges with
//! them, or with other racks, crosses its uplink:
//!
//! ```text
//! w0, w1, s0 ─ rk0 ─ v0 ═ u0 ─ br0 ─ sw, s2
//! w2, w3, s1 ─ rk1 ─ v1 ═ u1 ─┘
//! ```
//!
//! Everything is named `<prefix>-...`, the prefix holding the launcher's process id, so
//! that concurrent runs never meet; dropping the [`Fabric`] ends every process left in
//! its namespaces and removes them, which removes their devices with them.

use crate::delay_line::{DelayLine, DirectionStats, Impairment};
use crate::link::{format_rate, Link};
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;

/// Why an emulated network could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    #[error("an emulated network needs {}", .0.join(", "))]
    Missing(Vec<&'static str>),
    #[error("{0} workers: an emulated network holds 1 to {MAX_WORKERS}")]
    Workers(usize),
    #[error("{0} switch hosts: an emulated network holds 0 to {MAX_SWITCH_HOSTS}")]
    SwitchHosts(usize),
    #[error("the racks hold ranks {held:?}, but the workers are 0 to {last}: each rank in one rack")]
    RackRanks { held: Vec<std::ops::Range<usize>>, last: usize },
    #[error("switch host {host} is placed in rack {rack}, but there are {racks} racks")]
    SwitchHostRack { host: usize, rack: usize, racks: usize },
    #[error("cannot run {program}: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("'{command}' failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("in namespace {namespace}, {devices} did not come up within 5 s")]
    NotUp { namespace: String, devices: String },
    #[error("rank {rank}'s link: {source}")]
    DelayLine { rank: usize, source: std::io::Error },
    #[error("'{0}': expected auto, netem or user-space")]
    Impairer(String),
    #[error("in namespace {namespace}, cannot turn the bridges' netfilter hooks off: {source}")]
    BridgeNetfilter { namespace: String, source: std::io::Error },
}

/// How delay, jitter and loss are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Impairer {
    /// The kernel's `netem` qdisc.
    Netem,
    /// A user-space delay line per link, for kernels without netem.
    UserSpace,
}

impl std::fmt::Display for Impairer {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            Impairer::Netem => "netem",
            Impairer::UserSpace => "user-space delay line",
        })
    }
}

/// Which impairer to use: `auto` takes netem where the kernel has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImpairerChoice {
    #[default]
    Auto,
    Only(Impairer),
}

impl std::str::FromStr for ImpairerChoice {
    type Err = FabricError;
    fn from_str(text: &str) -> Result<Self, FabricError> {
        match text {
            "auto" => Ok(ImpairerChoice::Auto),
            "netem" => Ok(ImpairerChoice::Only(Impairer::Netem)),
            "user-space" | "userspace" => Ok(ImpairerChoice::Only(Impairer::UserSpace)),
            _ => Err(FabricError::Impairer(text.to_string())),
        }
    }
}

/// The first three bytes of every address: a private /24 that exists only inside the
/// run's namespaces, so it cannot clash with the host's networks.
const SUBNET: [u8; 3] = [10, 213, 7];
/// The most workers one /24 addresses (.1 to .200), beside the switch (.254).
pub const MAX_WORKERS: usize = 200;
/// The most switch hosts it addresses beside them (.201 to .253).
pub const MAX_SWITCH_HOSTS: usize = 53;

/// The one interface of the switch's and each worker's namespace.
pub const HOST_DEVICE: &str = "eth0";

/// A server running a switch process: its link, and the rack whose bridge it is on
/// (`None`: the core's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwitchHost {
    pub link: Link,
    pub rack: Option<usize>,
}

/// A network of racks: the ranks of each (contiguous, together all ranks once), and
/// every rack's uplink to the core (its rate, queue and burst).
#[derive(Debug, Clone, PartialEq)]
pub struct Racks {
    pub ranks: Vec<std::ops::Range<usize>>,
    pub uplink: Link,
}

/// A run's namespaces, links and delay lines; removed on drop.
pub struct Fabric {
    prefix: String,
    links: Vec<Link>,
    /// Each switch host's link.
    switch_links: Vec<Link>,
    /// Each switch host's rack, if any.
    switch_host_racks: Vec<Option<usize>>,
    /// The ranks of each rack, if the network has racks.
    rack_ranks: Vec<std::ops::Range<usize>>,
    /// Each rack's uplink.
    uplinks: Vec<Link>,
    /// What makes delay and loss, if any link has them.
    impairer: Option<Impairer>,
    delay_lines: Vec<(usize, DelayLine)>,
}

impl Fabric {
    /// Builds the namespaces and links for one worker per link of `links` and one switch
    /// host per entry of `switch_hosts` (their links' rates only), on one flat network or
    /// on `racks`. Fails, having removed whatever it made, if something it needs is
    /// missing or a command fails.
    pub fn create(
        prefix: &str,
        links: Vec<Link>,
        switch_hosts: Vec<SwitchHost>,
        racks: Option<Racks>,
        choice: ImpairerChoice,
    ) -> Result<Fabric, FabricError> {
        check_prerequisites()?;
        if links.is_empty() || links.len() > MAX_WORKERS {
            return Err(FabricError::Workers(links.len()));
        }
        if switch_hosts.len() > MAX_SWITCH_HOSTS {
            return Err(FabricError::SwitchHosts(switch_hosts.len()));
        }
        let (rack_ranks, uplinks) = match racks {
            Some(Racks { ranks, uplink }) => {
                let uplink =
                    Link { rate: uplink.rate, queue: uplink.queue, burst: uplink.burst, ..Link::default() };
                let uplinks = vec![uplink; ranks.len()];
                (ranks, uplinks)
            }
            None => (Vec::new(), Vec::new()),
        };
        let contiguous = rack_ranks.iter().try_fold(0, |next, rack| (rack.start == next).then_some(rack.end));
        if !rack_ranks.is_empty() && contiguous != Some(links.len()) {
            return Err(FabricError::RackRanks { held: rack_ranks, last: links.len() - 1 });
        }
        for (host, switch_host) in switch_hosts.iter().enumerate() {
            if let Some(rack) = switch_host.rack.filter(|&rack| rack >= rack_ranks.len()) {
                return Err(FabricError::SwitchHostRack { host, rack, racks: rack_ranks.len() });
            }
        }
        remove_abandoned();
        let switch_links =
            switch_hosts.iter().map(|host| Link { rate: host.link.rate, ..Link::default() }).collect();
        let mut fabric = Fabric {
            prefix: prefix.to_string(),
            links,
            switch_links,
            switch_host_racks: switch_hosts.iter().map(|host| host.rack).collect(),
            rack_ranks,
            uplinks,
            impairer: None,
            delay_lines: Vec::new(),
        };
        // On an error, dropping `fabric` removes what was made so far.
        fabric.build(choice)?;
        Ok(fabric)
    }

    pub fn switch_namespace(&self) -> String {
        format!("{}-switch", self.prefix)
    }

    pub fn worker_namespace(&self, rank: usize) -> String {
        format!("{}-w{rank}", self.prefix)
    }

    pub fn switch_host_namespace(&self, host: usize) -> String {
        format!("{}-s{host}", self.prefix)
    }

    /// The namespace of the bridge and of the fabric's ends of the links.
    pub fn fabric_namespace(&self) -> String {
        format!("{}-fabric", self.prefix)
    }

    pub fn switch_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], 254)
    }

    pub fn worker_ip(&self, rank: usize) -> Ipv4Addr {
        Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], rank as u8 + 1)
    }

    pub fn switch_host_ip(&self, host: usize) -> Ipv4Addr {
        Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], (MAX_WORKERS + 1 + host) as u8)
    }

    /// The subnet, as `10.213.7.0/24`.
    pub fn subnet(&self) -> String {
        format!("{}.{}.{}.0/24", SUBNET[0], SUBNET[1], SUBNET[2])
    }

    /// The workers' links, by rank.
    pub fn links(&self) -> &[Link] {
        &self.links
    }

    /// The switch hosts' links: their rates, no delay or loss.
    pub fn switch_links(&self) -> &[Link] {
        &self.switch_links
    }

    /// Each switch host's rack, if any (`None`: at the core).
    pub fn switch_host_racks(&self) -> &[Option<usize>] {
        &self.switch_host_racks
    }

    /// Each rack's uplink to the core: its rate, no delay or loss; none on a flat network.
    pub fn uplinks(&self) -> &[Link] {
        &self.uplinks
    }

    /// The workers' links, then the switch hosts', then the uplinks: the order of the
    /// monitor's samples ([`crate::monitor::link_bytes`]) and of [`Fabric::queue_drops`].
    pub fn all_links(&self) -> Vec<Link> {
        self.links.iter().chain(&self.switch_links).chain(&self.uplinks).copied().collect()
    }

    /// The bridge a rank's link ends on: its rack's, or the core's.
    fn rank_bridge(&self, rank: usize) -> String {
        match self.rack_ranks.iter().position(|ranks| ranks.contains(&rank)) {
            Some(rack) => rack_bridge(rack),
            None => CORE_BRIDGE.into(),
        }
    }

    pub fn impairer(&self) -> Option<Impairer> {
        self.impairer
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn build(&mut self, choice: ImpairerChoice) -> Result<(), FabricError> {
        let fabric = self.fabric_namespace();
        ip(&["netns", "add", &fabric])?;
        ip(&["-n", &fabric, "link", "set", "lo", "up"])?;
        skip_bridge_netfilter(&fabric)?;
        ip(&["-n", &fabric, "link", "add", CORE_BRIDGE, "type", "bridge"])?;
        ip(&["-n", &fabric, "link", "set", CORE_BRIDGE, "up"])?;
        for (rack, uplink) in self.uplinks.iter().enumerate() {
            let (bridge, rack_end, core_end) = (rack_bridge(rack), format!("v{rack}"), format!("u{rack}"));
            ip(&["-n", &fabric, "link", "add", &bridge, "type", "bridge"])?;
            ip(&["-n", &fabric, "link", "set", &bridge, "up"])?;
            veth(&fabric, &rack_end, &core_end, None)?;
            ip(&["-n", &fabric, "link", "set", &rack_end, "master", &bridge, "up"])?;
            ip(&["-n", &fabric, "link", "set", &core_end, "master", CORE_BRIDGE, "up"])?;
            // What goes up leaves the rack's end, what comes down the core's.
            for device in [&rack_end, &core_end] {
                shape(&fabric, device, uplink, false)?;
            }
        }
        if self.links.iter().any(Link::is_impaired) {
            self.impairer = Some(match choice {
                ImpairerChoice::Only(impairer) => impairer,
                ImpairerChoice::Auto if has_netem(&fabric) => Impairer::Netem,
                ImpairerChoice::Auto => Impairer::UserSpace,
            });
        }
        self.attach(&self.switch_namespace(), "sw", self.switch_ip(), Some(CORE_BRIDGE))?;
        for rank in 0..self.links.len() {
            self.attach_worker(rank)?;
        }
        for host in 0..self.switch_links.len() {
            let (namespace, port) = (self.switch_host_namespace(host), format!("s{host}"));
            let bridge = self.switch_host_racks[host].map_or(CORE_BRIDGE.into(), rack_bridge);
            self.attach(&namespace, &port, self.switch_host_ip(host), Some(&bridge))?;
            // What it sends on its end, what it receives on the fabric's.
            for (ns, device) in
                [(namespace.as_str(), HOST_DEVICE), (self.fabric_namespace().as_str(), port.as_str())]
            {
                shape(ns, device, &self.switch_links[host], false)?;
            }
        }
        self.wait_until_up()
    }

    /// Waits until every veth of the run is up. A device set up is not up at once: until
    /// the kernel sees its carrier (within a second) it drops what is sent through it,
    /// and a program started meanwhile (OpenMPI's daemons connecting to mpirun) fails.
    fn wait_until_up(&self) -> Result<(), FabricError> {
        let mut namespaces = vec![self.fabric_namespace(), self.switch_namespace()];
        namespaces.extend((0..self.links.len()).map(|rank| self.worker_namespace(rank)));
        namespaces.extend((0..self.switch_links.len()).map(|host| self.switch_host_namespace(host)));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        for namespace in &namespaces {
            loop {
                let output = Command::new("ip")
                    .args(["-n", namespace, "-o", "link", "show", "type", "veth"])
                    .output()
                    .map_err(|source| FabricError::Spawn { program: "ip".into(), source })?;
                let listing = String::from_utf8_lossy(&output.stdout);
                let down: Vec<&str> = listing
                    .lines()
                    .filter(|line| !line.contains("state UP"))
                    .filter_map(|line| line.split(':').nth(1).map(str::trim))
                    .collect();
                if down.is_empty() {
                    break;
                }
                if std::time::Instant::now() >= deadline {
                    return Err(FabricError::NotUp {
                        namespace: namespace.clone(),
                        devices: down.join(", "),
                    });
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        Ok(())
    }

    /// A namespace joined to the fabric by a veth pair: `port` in the fabric (on
    /// `bridge`, if any), `eth0` with `address` inside.
    fn attach(
        &self,
        namespace: &str,
        port: &str,
        address: Ipv4Addr,
        bridge: Option<&str>,
    ) -> Result<(), FabricError> {
        let fabric = self.fabric_namespace();
        ip(&["netns", "add", namespace])?;
        ip(&["-n", namespace, "link", "set", "lo", "up"])?;
        veth(&fabric, port, HOST_DEVICE, Some(namespace))?;
        if let Some(bridge) = bridge {
            ip(&["-n", &fabric, "link", "set", port, "master", bridge, "up"])?;
        } else {
            ip(&["-n", &fabric, "link", "set", port, "up"])?;
        }
        ip(&["-n", namespace, "addr", "add", &format!("{address}/24"), "dev", HOST_DEVICE])?;
        ip(&["-n", namespace, "link", "set", HOST_DEVICE, "up"])
    }

    fn attach_worker(&mut self, rank: usize) -> Result<(), FabricError> {
        let link = self.links[rank];
        let fabric = self.fabric_namespace();
        let namespace = self.worker_namespace(rank);
        let port = format!("w{rank}");
        let user_space = link.is_impaired() && self.impairer == Some(Impairer::UserSpace);
        // With a delay line, the worker's veth ends unbridged in the fabric, and a second
        // pair takes the bridge's side; the delay line carries frames between the two.
        let bridge = self.rank_bridge(rank);
        self.attach(&namespace, &port, self.worker_ip(rank), (!user_space).then_some(bridge.as_str()))?;
        if user_space {
            let (line_end, bridge_port) = (format!("d{rank}"), format!("b{rank}"));
            veth(&fabric, &line_end, &bridge_port, None)?;
            ip(&["-n", &fabric, "link", "set", &bridge_port, "master", &bridge, "up"])?;
            ip(&["-n", &fabric, "link", "set", &line_end, "up"])?;
            let impairment = Impairment { delay: link.delay, jitter: link.jitter, loss: link.loss };
            let line = DelayLine::start(&fabric, &port, &line_end, impairment, impairment)
                .map_err(|source| FabricError::DelayLine { rank, source })?;
            self.delay_lines.push((rank, line));
        }
        // Up on the worker's end, down on the fabric's.
        let netem = link.is_impaired() && self.impairer == Some(Impairer::Netem);
        for (ns, device) in [(namespace.as_str(), HOST_DEVICE), (fabric.as_str(), port.as_str())] {
            shape(ns, device, &link, netem)?;
        }
        Ok(())
    }

    /// Every link's frames through its delay line so far, by rank: [up, down].
    pub fn delay_line_stats(&self) -> Vec<(usize, [DirectionStats; 2])> {
        self.delay_lines.iter().map(|(rank, line)| (*rank, line.stats())).collect()
    }

    /// Frames each rate limiter dropped because its queue was full, (up, down): by rank,
    /// then by switch host, then by uplink.
    pub fn queue_drops(&self) -> Vec<(u64, u64)> {
        let fabric = self.fabric_namespace();
        let workers = (0..self.links.len()).map(|rank| (self.worker_namespace(rank), format!("w{rank}")));
        let hosts =
            (0..self.switch_links.len()).map(|host| (self.switch_host_namespace(host), format!("s{host}")));
        let ends = workers
            .chain(hosts)
            .map(|(namespace, port)| (tbf_drops(&namespace, HOST_DEVICE), tbf_drops(&fabric, &port)));
        let uplinks = (0..self.uplinks.len())
            .map(|rack| (tbf_drops(&fabric, &format!("v{rack}")), tbf_drops(&fabric, &format!("u{rack}"))));
        ends.chain(uplinks).collect()
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // The delay lines first: their threads hold sockets in the fabric namespace.
        self.delay_lines.clear();
        remove_namespaces(&format!("{}-", self.prefix));
    }
}

/// The bridge at the fabric's core: the switch's, the racks' uplinks', and on a flat
/// network everyone's.
const CORE_BRIDGE: &str = "br0";

/// Rack `rack`'s bridge.
fn rack_bridge(rack: usize) -> String {
    format!("rk{rack}")
}

/// The switches of `br_netfilter` that send every frame a bridge forwards through iptables,
/// ip6tables and arptables.
const BRIDGE_NETFILTER_SWITCHES: [&str; 3] = [
    "/proc/sys/net/bridge/bridge-nf-call-iptables",
    "/proc/sys/net/bridge/bridge-nf-call-ip6tables",
    "/proc/sys/net/bridge/bridge-nf-call-arptables",
];

/// Stops the bridges of `namespace` passing frames to iptables, ip6tables and arptables, if
/// `br_netfilter` is loaded (else the switches do not exist and nothing needs doing).
///
/// Nothing in a fabric filters, yet with the switches on, as the module leaves them, every
/// frame a bridge forwards runs netfilter's hooks in the context of whoever sent it: at 8
/// workers and 100 Mbit/s, `br_nf_pre_routing` was the largest symbol in the delay lines'
/// threads. The switches are the namespace's own since Linux 5.3; an older kernel shows them
/// only in the host's first namespace, never in a fabric's, so the host's are never changed.
fn skip_bridge_netfilter(namespace: &str) -> Result<(), FabricError> {
    let switch_off = || -> std::io::Result<()> {
        crate::netns::enter_by_name(namespace)?;
        for path in BRIDGE_NETFILTER_SWITCHES {
            match std::fs::write(path, "0") {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                    return Err(std::io::Error::new(error.kind(), format!("{path}: {error}")));
                }
                _ => {}
            }
        }
        Ok(())
    };
    // A thread of its own enters the namespace, so that its /proc/sys/net is the fabric's.
    std::thread::scope(|scope| scope.spawn(switch_off).join())
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        .map_err(|source| FabricError::BridgeNetfilter { namespace: namespace.to_string(), source })
}

/// Root, `ip` and `tc`: all of them checked before anything is made.
fn check_prerequisites() -> Result<(), FabricError> {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root (network namespaces and qdiscs need it: run with sudo)");
    }
    for (program, package) in
        [("ip", "ip (apt-get install iproute2)"), ("tc", "tc (apt-get install iproute2)")]
    {
        if Command::new(program).arg("-V").output().is_err() {
            missing.push(package);
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(FabricError::Missing(missing))
    }
}

/// A veth pair: `name` in `namespace`, its peer in `peer_namespace` (or beside it).
///
/// Neither end takes segmentation-offload super-frames (`gso_max_segs 1`): a TCP or UDP
/// stack's 64 KB batch is cut into frames before it leaves the sender, as on a real
/// link, so that the rate limiter paces frames, and a lost frame, by netem or the delay
/// line, is one frame and not a whole batch.
fn veth(namespace: &str, name: &str, peer: &str, peer_namespace: Option<&str>) -> Result<(), FabricError> {
    let mut args = vec!["-n", namespace, "link", "add", "name", name, "gso_max_segs", "1", "type", "veth"];
    args.extend(["peer", "name", peer, "gso_max_segs", "1"]);
    if let Some(peer_namespace) = peer_namespace {
        args.extend(["netns", peer_namespace]);
    }
    ip(&args)
}

/// Runs `ip ARGS`; the error carries the command and what ip printed.
fn ip(args: &[&str]) -> Result<(), FabricError> {
    command("ip", args)
}

fn command(program: &str, args: &[&str]) -> Result<(), FabricError> {
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| FabricError::Spawn { program: program.to_string(), source })?;
    if output.status.success() {
        Ok(())
    } else {
        Err(FabricError::Command {
            command: format!("{program} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        })
    }
}

/// Whether the kernel has netem: a trial qdisc on the fabric's loopback.
fn has_netem(namespace: &str) -> bool {
    let added =
        command("tc", &["-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]);
    let _ = command("tc", &["-n", namespace, "qdisc", "del", "dev", "lo", "root"]);
    added.is_ok()
}

/// The qdiscs of one end of a link: tbf for the rate; with netem, netem at the root
/// and tbf beneath it, so that a frame is delayed and then paced.
fn shape(namespace: &str, device: &str, link: &Link, netem: bool) -> Result<(), FabricError> {
    let tc = |args: &[&str]| {
        let mut full = vec!["-n", namespace, "qdisc", "add", "dev", device];
        full.extend_from_slice(args);
        command("tc", &full)
    };
    let rate = link.rate.map(format_rate);
    let tbf = |parent: &[&'static str]| -> Result<(), FabricError> {
        let Some(rate) = &rate else { return Ok(()) };
        let burst = link.burst.to_string();
        let latency = format!("{}us", link.queue.as_micros());
        let mut args = parent.to_vec();
        args.extend(["tbf", "rate", rate, "burst", &burst, "latency", &latency]);
        tc(&args)
    };
    if !netem {
        return tbf(&["root"]);
    }
    let delay = format!("{}us", link.delay.as_micros());
    let jitter = format!("{}us", link.jitter.as_micros());
    let loss = format!("{}%", link.loss * 100.0);
    // A limit far above any window, so that netem's own queue never drops.
    tc(&["root", "handle", "1:", "netem", "delay", &delay, &jitter, "loss", &loss, "limit", "100000"])?;
    tbf(&["parent", "1:", "handle", "2:"])
}

/// Frames a device's tbf dropped (0 if it has none or tc cannot say).
fn tbf_drops(namespace: &str, device: &str) -> u64 {
    let output = Command::new("tc").args(["-n", namespace, "-s", "qdisc", "show", "dev", device]).output();
    output.map_or(0, |output| tbf_drops_of(&String::from_utf8_lossy(&output.stdout)))
}

/// The drops of the tbf in `tc -s qdisc show`'s output: "qdisc tbf 2: ... \n Sent 123
/// bytes 4 pkt (dropped 5, overlimits ...)"; a netem above it has its own line.
fn tbf_drops_of(text: &str) -> u64 {
    let mut in_tbf = false;
    for line in text.lines() {
        if line.starts_with("qdisc ") {
            in_tbf = line.starts_with("qdisc tbf");
        } else if in_tbf {
            if let Some(rest) = line.split("(dropped ").nth(1) {
                return rest.split(',').next().and_then(|n| n.trim().parse().ok()).unwrap_or(0);
            }
        }
    }
    0
}

/// Ends every process in the namespaces whose names start with `prefix`, and removes
/// the namespaces.
fn remove_namespaces(prefix: &str) {
    for namespace in namespaces().into_iter().filter(|name| name.starts_with(prefix)) {
        if let Ok(output) = Command::new("ip").args(["netns", "pids", &namespace]).output() {
            for pid in String::from_utf8_lossy(&output.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<libc::pid_t>() {
                    // SAFETY: kill has no memory preconditions; a pid that has exited
                    // meanwhile gives ESRCH, which is fine.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        let _ = ip(&["netns", "del", &namespace]);
    }
}

/// The network namespaces `ip netns` knows.
fn namespaces() -> Vec<String> {
    std::fs::read_dir(crate::netns::FOLDER)
        .map(|entries| entries.filter_map(|entry| entry.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default()
}

/// Removes the namespaces of runs whose launcher died without removing them (killed
/// with SIGKILL): `netagg-<pid>-...` where no process `pid` lives.
fn remove_abandoned() {
    let mut dead = std::collections::BTreeSet::new();
    for namespace in namespaces() {
        let Some(pid) = namespace.strip_prefix("netagg-").and_then(|rest| rest.split('-').next()) else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !Path::new(&format!("/proc/{pid}")).exists() {
            dead.insert(format!("netagg-{pid}-"));
        }
    }
    for prefix in dead {
        remove_namespaces(&prefix);
    }
}

/// The prefix of this process's namespaces.
pub fn default_prefix() -> String {
    format!("netagg-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tbf_s_drops_are_read_beneath_a_netem() {
        let shown = "qdisc netem 1: root refcnt 2 limit 100000 delay 2ms\n \
                     Sent 1000 bytes 10 pkt (dropped 7, overlimits 0 requeues 0)\n\
                     qdisc tbf 2: parent 1: rate 100Mbit burst 64Kb lat 100ms\n \
                     Sent 900 bytes 9 pkt (dropped 3, overlimits 12 requeues 0)\n";
        assert_eq!(tbf_drops_of(shown), 3);
        assert_eq!(
            tbf_drops_of("qdisc noqueue 0: root refcnt 2\n Sent 0 bytes 0 pkt (dropped 0, overlimits 0)\n"),
            0
        );
    }
}
