//! `netagg-run` on an emulated network: the switch and every worker in network
//! namespaces of their own behind shaped links ([`netagg_emulate::fabric`]), watched
//! by a [`Monitor`] that says afterwards whether the links or this machine's CPU set
//! the pace, and removed on every exit, Ctrl-C included.
//!
//! Each rank also gets `EMULATED_LINK_RATES` (its world's rates, by rank) and
//! `EMULATED_LINK_DELAY` (the longest one-way delay), and, with switches on hosts of their
//! own, `EMULATED_SWITCH_HOST_RATE` (their links' rate), or with switches on the workers'
//! hosts `EMULATED_COLOCATED=true`, and on a network of racks `EMULATED_RACKS` (their
//! number), `EMULATED_UPLINK_RATE` (their uplinks' rate) and `EMULATED_TREE` (whether
//! the racks' switches sum first), from which `allreduce_benchmark` prints the cost model's
//! prediction beside its measured time; and the variables that tell PyTorch's process
//! groups which interface to use (`GLOO_SOCKET_IFNAME` and others), so that a
//! torch.distributed program runs unchanged.

use super::{
    run_ranks, set_rank_environment, start_rack_switches, start_switch, stop_switch, switch_program, Options,
};
use netagg_emulate::fabric::{Fabric, Impairer, Racks, SwitchHost, HOST_DEVICE};
use netagg_emulate::link::{format_rate, Link, SwitchLinks, Topology};
use netagg_emulate::monitor::{judge, Monitor};
use std::process::Command;
use std::sync::atomic::AtomicBool;

/// PyTorch's rendezvous port on rank 0's address: the namespaces are this run's alone.
const RENDEZVOUS_PORT: u16 = 29500;

pub(crate) fn run(options: &Options, interrupted: &AtomicBool) -> Result<u8, String> {
    let mut topology = match &options.topology {
        Some(path) => netagg_emulate::link::Topology::from_file(path).map_err(|e| e.to_string())?,
        None => Default::default(),
    };
    topology.apply(&options.link.unwrap_or_default(), &options.rank_links);
    if options.racks > 0 {
        topology.racks = Some(options.racks);
    }
    if let Some(uplink) = &options.uplink {
        topology.uplink = uplink.over(&topology.uplink);
    }
    if let Some(switch_links) = options.rack_switches {
        topology.switch_links = Some(switch_links);
    }
    let links = topology.links(u32::from(options.workers)).map_err(|e| e.to_string())?;
    let racks = rack_layout(options, &topology)?;
    let switch_hosts = switch_hosts(options, &topology);
    // An interrupt while the network is built reaches the ip and tc it runs too: it
    // ends the run as an interrupt, not as their failure.
    let interrupted_exit = || interrupted.load(std::sync::atomic::Ordering::Relaxed);
    let prefix = netagg_emulate::fabric::default_prefix();
    let fabric = match Fabric::create(&prefix, links, switch_hosts, racks, options.impairer) {
        Ok(fabric) => fabric,
        Err(_) if interrupted_exit() => return Ok(130),
        Err(error) => return Err(error.to_string()),
    };
    if interrupted_exit() {
        return Ok(130);
    }
    describe(&fabric);
    let (workers, hosts, uplinks) =
        (fabric.links().len(), fabric.switch_links().len(), fabric.uplinks().len());
    let monitor = Monitor::start(&fabric.fabric_namespace(), workers, hosts, uplinks)
        .map_err(|e| format!("cannot watch the links: {e}"))?;
    let code = if options.mpi {
        run_mpi(options, &fabric, interrupted)
    } else {
        run_netagg(options, &fabric, interrupted)
    };
    match monitor.finish() {
        Ok(samples) => report(&fabric, &samples),
        Err(error) => eprintln!("netagg-run: the link monitor failed: {error}"),
    }
    // Dropping the fabric removes the namespaces, whatever happened above.
    drop(fabric);
    code
}

/// The network's racks, from the options and the topology file, checked against the
/// rest of the run; `None` for a flat network.
fn rack_layout(options: &Options, topology: &Topology) -> Result<Option<Racks>, String> {
    let Some(count) = topology.racks else {
        if options.flat || options.uplink.is_some() || options.rack_switches.is_some() {
            return Err("--flat, --uplink and --rack-switches describe a network of racks: give --racks \
                        (or [racks] count in the topology file)"
                .into());
        }
        topology.check_flat().map_err(|e| match &options.topology {
            Some(path) => format!("{}: {e}", path.display()),
            None => e.to_string(),
        })?;
        return Ok(None);
    };
    if count > options.workers {
        return Err(format!("{count} racks: more racks than the {} ranks", options.workers));
    }
    if options.switches.is_some() || options.colocated {
        return Err(format!(
            "a network of {count} racks places its switches itself: drop --switches and --colocated"
        ));
    }
    let ranks = (0..count).map(|rack| {
        let ranks = netagg_wire::control::rack_ranks(rack, count, options.workers);
        usize::from(ranks.start)..usize::from(ranks.end)
    });
    let uplink = topology.uplink_link().map_err(|e| e.to_string())?;
    Ok(Some(Racks { ranks: ranks.collect(), uplink }))
}

/// The servers the run's switches run on: with `--switches K`, K at the core; on a
/// network of racks, the upper (or `--flat`) switch's at the core if switches are
/// servers, and each rack's, its link shaped like a worker's or never.
fn switch_hosts(options: &Options, topology: &Topology) -> Vec<SwitchHost> {
    let server = |rack| SwitchHost { link: topology.common_link(), rack };
    let Some(racks) = topology.racks else {
        return vec![server(None); usize::from(options.switches.unwrap_or(0))];
    };
    if options.mpi {
        return Vec::new();
    }
    let servers = topology.switch_links == Some(SwitchLinks::Server);
    let rack_switch = |rack| {
        if servers {
            server(Some(rack))
        } else {
            SwitchHost { link: Link::default(), rack: Some(rack) }
        }
    };
    let core = servers.then(|| server(None));
    let rack_switches = (0..usize::from(racks)).filter(|_| !options.flat).map(rack_switch);
    core.into_iter().chain(rack_switches).collect()
}

fn describe(fabric: &Fabric) {
    println!(
        "netagg-run: emulated network: namespaces {}-*, subnet {}, switch {}",
        fabric.prefix(),
        fabric.subnet(),
        fabric.switch_ip()
    );
    for (rank, link) in fabric.links().iter().enumerate() {
        println!("netagg-run: rank {rank} at {}: {link}", fabric.worker_ip(rank));
    }
    for (host, link) in fabric.switch_links().iter().enumerate() {
        let rack = fabric.switch_host_racks()[host].map_or(String::new(), |rack| format!(" in rack {rack}"));
        println!("netagg-run: switch host s{host} at {}{rack}: {link}", fabric.switch_host_ip(host));
    }
    for (rack, link) in fabric.uplinks().iter().enumerate() {
        println!("netagg-run: rack {rack}'s uplink u{rack}: {link}");
    }
    match fabric.impairer() {
        Some(Impairer::Netem) => println!("netagg-run: delay, jitter and loss by netem"),
        Some(Impairer::UserSpace) => println!(
            "netagg-run: delay, jitter and loss by a user-space delay line on each impaired link \
             (no netem in this kernel, or --impairer user-space); rates by tbf"
        ),
        None => println!("netagg-run: rates by tbf; no delay or loss"),
    }
}

/// Where the run's switches at the core go, each a namespace and its address: the
/// switch's own (an ideal switch), the switch hosts' of no rack, or the workers'
/// (colocated).
fn switch_places(options: &Options, fabric: &Fabric) -> Vec<(String, std::net::Ipv4Addr)> {
    let core_hosts: Vec<usize> =
        (0..fabric.switch_links().len()).filter(|&host| fabric.switch_host_racks()[host].is_none()).collect();
    if options.colocated {
        let workers = 0..usize::from(options.workers);
        workers.map(|rank| (fabric.worker_namespace(rank), fabric.worker_ip(rank))).collect()
    } else if core_hosts.is_empty() {
        vec![(fabric.switch_namespace(), fabric.switch_ip())]
    } else {
        let place = |host| (fabric.switch_host_namespace(host), fabric.switch_host_ip(host));
        core_hosts.into_iter().map(place).collect()
    }
}

/// A switch in `namespace` on `address`: the command that starts it, with its DPDK
/// environment if the switch's data leaves from DPDK ports.
fn start_switch_in(
    options: &Options,
    namespace: &str,
    address: std::net::Ipv4Addr,
    arguments: &[String],
    label: &str,
) -> Result<(std::process::Child, String), String> {
    let mut switch_command = Command::new("ip");
    switch_command.args(["netns", "exec", namespace]).arg(switch_program());
    if options.dpdk.switch {
        set_dpdk_environment(&mut switch_command, "SWITCH", &[("NETAGG_SWITCH__TRANSPORT", "dpdk")]);
    }
    start_switch(switch_command, &address.to_string(), arguments, label)
}

fn run_netagg(options: &Options, fabric: &Fabric, interrupted: &AtomicBool) -> Result<u8, String> {
    let mut switches = Vec::new();
    let mut controls = Vec::new();
    let places = switch_places(options, fabric);
    let several = places.len() > 1;
    // Each rack's switch host, by rack: a tree's lower switches.
    let rack_hosts: Vec<usize> =
        (0..fabric.switch_links().len()).filter(|&host| fabric.switch_host_racks()[host].is_some()).collect();
    for (shard, (namespace, address)) in places.into_iter().enumerate() {
        let label = match (several, rack_hosts.is_empty()) {
            (true, _) => format!("switch {shard}"),
            (false, true) => "switch".into(),
            (false, false) => "upper switch".into(),
        };
        match start_switch_in(options, &namespace, address, &options.switch_args, &label) {
            Ok((switch, control)) => {
                switches.push(switch);
                controls.push(control);
            }
            Err(error) => {
                switches.into_iter().for_each(stop_switch);
                return Err(error);
            }
        }
    }
    let racks = rack_hosts.len() as u16;
    let rank_controls =
        start_rack_switches(options, racks, &controls, &mut switches, |rack, arguments, label| {
            let host = rack_hosts[usize::from(rack)];
            let (namespace, address) = (fabric.switch_host_namespace(host), fabric.switch_host_ip(host));
            start_switch_in(options, &namespace, address, arguments, label)
                .map_err(|error| format!("rack {rack}'s switch: {error}"))
        });
    let rank_controls = match rank_controls {
        Ok(rank_controls) => rank_controls,
        Err(error) => {
            switches.into_iter().rev().for_each(stop_switch);
            return Err(error);
        }
    };
    let session = format!("{}-session", fabric.prefix());
    let master = fabric.worker_ip(0).to_string();
    let links = fabric.links();
    let rates: Option<Vec<String>> = links.iter().map(|link| link.rate.map(format_rate)).collect();
    let longest_delay = links.iter().map(|link| link.delay).max().unwrap_or_default();
    let ranks = (0..options.workers)
        .map(|rank| {
            let mut command = Command::new("ip");
            command.args(["netns", "exec", &fabric.worker_namespace(usize::from(rank))]);
            command.args(&options.program);
            if options.dpdk.workers {
                set_dpdk_environment(&mut command, "BACKEND", &[("NETAGG_GENERAL__BACKEND", "dpdk")]);
            }
            set_interface_environment(&mut command);
            set_rank_environment(
                &mut command,
                rank,
                options.workers,
                (&master, RENDEZVOUS_PORT),
                &rank_controls[usize::from(rank)],
                &session,
            )?;
            if let Some(rates) = &rates {
                command
                    .env("EMULATED_LINK_RATES", rates.join(","))
                    .env("EMULATED_LINK_DELAY", format!("{}us", longest_delay.as_micros()));
                if let Some(rate) = fabric.switch_links().first().and_then(|link| link.rate) {
                    command.env("EMULATED_SWITCH_HOST_RATE", format_rate(rate));
                }
                if options.colocated {
                    command.env("EMULATED_COLOCATED", "true");
                }
                if !fabric.uplinks().is_empty() {
                    command.env("EMULATED_RACKS", fabric.uplinks().len().to_string());
                    command.env("EMULATED_TREE", (racks > 0).to_string());
                }
                if let Some(rate) = fabric.uplinks().first().and_then(|link| link.rate) {
                    command.env("EMULATED_UPLINK_RATE", format_rate(rate));
                }
            }
            Ok((rank.to_string(), command))
        })
        .collect::<Result<Vec<_>, String>>();
    let result = ranks.and_then(|ranks| run_ranks(ranks, interrupted));
    // The racks' switches first, so that each prints its counters while the upper one runs.
    switches.into_iter().rev().for_each(stop_switch);
    result
}

/// The variables by which gloo, TensorPipe (PyTorch's RPC) and NCCL choose an interface.
const INTERFACE_VARIABLES: [&str; 3] = ["GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"];

/// Points PyTorch's process groups at the namespace's interface, unless the user's
/// environment names one already.
///
/// Left alone, gloo binds to the address the host name resolves to, which is loopback
/// inside a namespace (every namespace shares this machine's name): its pairs then try
/// 127.0.0.1 and `init_process_group` fails with "Connection refused".
fn set_interface_environment(command: &mut Command) {
    for name in INTERFACE_VARIABLES {
        if std::env::var_os(name).is_none() {
            command.env(name, HOST_DEVICE);
        }
    }
}

/// Points a process's DPDK section (`NETAGG_<SECTION>_DPDK__*`) at its namespace's
/// interface and sets `selection`, unless the user's environment sets them already.
///
/// DPDK's af_packet driver shares the interface with the kernel, which keeps the address
/// (and the control connection): the DPDK endpoint then needs no address of its own.
/// `qdisc_bypass=0` sends its frames through the interface's queueing discipline, where
/// the link's rate is shaped, rather than around it. Frames are polled adaptively, since
/// the emulated network's processes share the machine's cores.
fn set_dpdk_environment(command: &mut Command, section: &str, selection: &[(&str, &str)]) {
    let device = format!("net_af_packet0,iface={HOST_DEVICE},qdisc_bypass=0");
    let section_variables = [
        (format!("NETAGG_{section}_DPDK__DEVICE"), device),
        (format!("NETAGG_{section}_DPDK__POLL"), "adaptive".into()),
    ];
    let selection = selection.iter().map(|(name, value)| (name.to_string(), value.to_string()));
    for (name, value) in section_variables.into_iter().chain(selection) {
        if std::env::var_os(&name).is_none() {
            command.env(name, value);
        }
    }
}

/// `mpirun` in the switch's namespace (joined to the bridge, its own link unshaped),
/// treating each worker namespace as a host: the hostfile lists the workers'
/// addresses, and the remote-shell agent mpirun starts each host's daemon with enters
/// that host's namespace. MPI's traffic then crosses the workers' shaped links.
fn run_mpi(options: &Options, fabric: &Fabric, interrupted: &AtomicBool) -> Result<u8, String> {
    // A folder of this run's own (mode 0700, a fresh random name): root runs the script
    // in it, so nobody else may have put or changed anything there.
    let folder = tempfile::Builder::new()
        .prefix(&format!("{}-mpi-", fabric.prefix()))
        .tempdir()
        .map_err(|e| format!("cannot make a folder for mpirun's files: {e}"))?;
    let hostfile = folder.path().join("hostfile");
    let agent = folder.path().join("rsh-agent");
    let workers = usize::from(options.workers);
    let hosts: String = (0..workers).map(|rank| format!("{} slots=1\n", fabric.worker_ip(rank))).collect();
    let cases: String = (0..workers)
        .map(|rank| format!("  {}) namespace={} ;;\n", fabric.worker_ip(rank), fabric.worker_namespace(rank)))
        .collect();
    // Each host's daemon and ranks keep their session files (`orte_tmpdir_base`) in a
    // folder of that host's own, as on machines of their own. In one shared /tmp the
    // daemons of every namespace, all on a host of the same name, made and removed the
    // same session folders at once: about one start in ten failed with "mkdir ... File
    // exists" or "No such file or directory" from orte_session_dir.
    let script = format!(
        "#!/bin/sh\n# mpirun's remote shell for this run: HOST COMMAND... runs COMMAND in HOST's namespace.\n\
         host=$1\nshift\ncase $host in\n{cases}  *) echo \"rsh-agent: no namespace for $host\" >&2; exit 1 ;;\nesac\n\
         sessions='{folder}'/$namespace\nmkdir -p \"$sessions\"\n\
         exec ip netns exec \"$namespace\" env OMPI_MCA_orte_tmpdir_base=\"$sessions\" sh -c \"$*\"\n",
        folder = folder.path().display()
    );
    std::fs::write(&hostfile, hosts).map_err(|e| format!("{}: {e}", hostfile.display()))?;
    std::fs::write(&agent, script).map_err(|e| format!("{}: {e}", agent.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("{}: {e}", agent.display()))?;
    let subnet = fabric.subnet();
    let mut command = Command::new("ip");
    command.args(["netns", "exec", &fabric.switch_namespace(), "mpirun", "-np", &workers.to_string()]);
    command.arg("--hostfile").arg(&hostfile).arg("--mca").arg("plm_rsh_agent").arg(&agent);
    command.args(["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", &subnet]);
    command.args(["--mca", "oob_tcp_if_include", &subnet, "--allow-run-as-root", "--bind-to", "none"]);
    // A rank waiting for data yields its core rather than spin on it: the ranks of
    // an emulated network share this machine's cores with each other and with the links.
    command.args(["--mca", "mpi_yield_when_idle", "1"]);
    // Every namespace has this machine's host name, which confuses the daemons'
    // routing tree ("does not know how to route a message to the specified
    // daemon"): each daemon talks to mpirun directly.
    command.args(["--mca", "routed", "direct"]);
    // hwloc's probe of the machine through /sys crashed a daemon (a segmentation fault
    // in hwloc_alloc_setup_object) in about one run in ten inside these namespaces.
    // The ranks are not bound to cores, so its generic topology serves as well.
    command.env("HWLOC_COMPONENTS", "-linux");
    command.args(&options.program);
    run_ranks(vec![("mpirun".into(), command)], interrupted)
}

/// Each link's traffic, its queues' drops, its delay line's losses and lateness, and
/// whether the links or the CPU set the pace.
fn report(fabric: &Fabric, samples: &[netagg_emulate::monitor::Sample]) {
    let all_links = fabric.all_links();
    let judgement = judge(samples, &all_links);
    let drops = fabric.queue_drops();
    let lines: std::collections::BTreeMap<usize, _> = fabric.delay_line_stats().into_iter().collect();
    println!(
        "netagg-run: {:<4} {:>9} {:>19} {:>21} {:>13} {:>13} {:>19}",
        "rank",
        "link",
        "carried MB up/down",
        "Mbit/s in use up/down",
        "queue drops",
        "lost",
        "late med/p99 us"
    );
    let (workers, hosts) = (fabric.links().len(), fabric.switch_links().len());
    for (index, link) in all_links.iter().enumerate() {
        // Switch hosts follow the ranks, named by their namespace's suffix, and uplinks
        // the switch hosts, named by their core end.
        let label = match index {
            _ if index < workers => index.to_string(),
            _ if index < workers + hosts => format!("s{}", index - workers),
            _ => format!("u{}", index - workers - hosts),
        };
        let (up, down) = judgement.bytes[index];
        let (rate_up, rate_down) = judgement.mean_rates[index];
        let (lost, late) = match lines.get(&index) {
            Some([up_line, down_line]) => (
                format!("{}/{}", up_line.lost, down_line.lost),
                format!(
                    "{}/{}",
                    up_line.lateness_median.max(down_line.lateness_median).as_micros(),
                    up_line.lateness_p99.max(down_line.lateness_p99).as_micros()
                ),
            ),
            None => ("-".into(), "-".into()),
        };
        println!(
            "netagg-run: {:<4} {:>9} {:>19} {:>21} {:>13} {:>13} {:>19}",
            label,
            link.rate.map(format_rate).unwrap_or_else(|| "unlimited".into()),
            format!("{:.1}/{:.1}", up as f64 / 1e6, down as f64 / 1e6),
            format!("{:.1}/{:.1}", rate_up / 1e6, rate_down / 1e6),
            format!("{}/{}", drops[index].0, drops[index].1),
            lost,
            late
        );
    }
    if let Some(lagging) = lagging_delay_line(fabric, &lines) {
        println!("netagg-run: {lagging}");
    }
    println!("netagg-run: pace: {}", judgement.verdict());
}

/// Whether each delay line held its delay: a frame sent later than due by more than a
/// tenth of the delay (and 100 us) at the median, or a quarter of it (and 500 us) at the
/// 99th percentile, means the host could not keep up. Judged on 1000 frames or more
/// each way.
fn lagging_delay_line(
    fabric: &Fabric,
    lines: &std::collections::BTreeMap<usize, [netagg_emulate::delay_line::DirectionStats; 2]>,
) -> Option<String> {
    use std::time::Duration;
    let lagging: Vec<String> = lines
        .iter()
        .filter(|(rank, directions)| {
            let link: &Link = &fabric.links()[**rank];
            let median_allowed = link.delay / 10 + Duration::from_micros(100);
            let tail_allowed = link.delay / 4 + Duration::from_micros(500);
            directions.iter().any(|direction| {
                direction.frames >= 1000
                    && (direction.lateness_median > median_allowed || direction.lateness_p99 > tail_allowed)
            })
        })
        .map(|(rank, _)| rank.to_string())
        .collect();
    (!lagging.is_empty()).then(|| {
        format!(
            "DELAY NOT HELD on the links of ranks {}: their delay lines sent frames later than due by more \
             than a tenth of the delay (+100 us) at the median or a quarter (+500 us) at the 99th \
             percentile; the host could not keep up, and those links' delays were longer than set",
            lagging.join(", ")
        )
    })
}
