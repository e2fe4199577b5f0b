//! `netagg-run`: starts a switch and N local worker processes of one session, on
//! loopback or on an emulated network.
//!
//! `netagg-run -n 4 [--switch HOST:PORT | --switches K] [--switch-arg ARG]... -- PROGRAM ARGS...`
//!
//! Without `--switch` it starts `netagg-switch` (found beside this program, else on the
//! PATH) on free loopback ports; with `--switches K`, K of them, each a shard of the
//! session (`general.switches`). Each worker gets `RANK`/`WORLD_SIZE`, the switch's
//! control address and a session name of its own, so any netagg program runs unchanged;
//! and, as torchrun sets them, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT` (a loopback port held for rank 0, see [`PortReservation`]), so that a
//! PyTorch program's process group (`init_process_group` from the environment) forms
//! beside netagg's session.
//! Output lines are prefixed with the rank. The exit code is that of the first worker
//! to fail (the others are then stopped), 130 after Ctrl-C, or 0.
//!
//! With `--racks R` it starts an aggregation tree instead: one upper switch, and R lower
//! switches that each serve a rack of contiguous ranks and take part in the upper
//! switch's session as one member; each rank registers at its rack's switch.
//!
//! With `--link`, `--rank-link` or `--topology`, the switch and every worker run in
//! network namespaces of their own behind shaped links (see [`emulated`]); `--mpi`
//! then runs the program with `mpirun`, one rank per worker namespace, over the same
//! links. There `--switches K` puts K switches on hosts of their own, each behind a link
//! of the workers' rate (a server's NIC), and `--colocated` one in each worker's
//! namespace, as BytePS colocates its summation servers. `--racks R` there builds a
//! network of racks, each rack's workers and switch behind an uplink of its own
//! (`--uplink`) to the core, where the upper switch sits; `--flat` runs one switch at the
//! core instead of the tree, for comparison; `--dpdk switch` there puts every switch of
//! the tree, uplinks included, on DPDK.

#![deny(unsafe_code)]

mod emulated;

use netagg_emulate::fabric::ImpairerChoice;
use netagg_emulate::link::{parse_rank_settings, LinkSettings, SwitchLinks};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

struct Options {
    workers: u16,
    switch: Option<String>,
    /// Switch processes the session spans (`--switches`), if given.
    switches: Option<u16>,
    /// One switch in each worker's namespace (`--colocated`).
    colocated: bool,
    switch_args: Vec<String>,
    /// Racks of an aggregation tree, each behind a lower switch of its own; 0 for none.
    racks: u16,
    program: Vec<String>,
    /// The emulated network, if any of these is given.
    topology: Option<PathBuf>,
    link: Option<LinkSettings>,
    rank_links: Vec<(u32, LinkSettings)>,
    impairer: ImpairerChoice,
    mpi: bool,
    /// Which side's data leaves from DPDK ports on the emulated network.
    dpdk: DpdkSides,
    /// Each rack's uplink on an emulated network of racks (`--uplink`).
    uplink: Option<LinkSettings>,
    /// What the switches' own links are on a network of racks (`--rack-switches`).
    rack_switches: Option<SwitchLinks>,
    /// One switch at the core of a network of racks instead of a tree (`--flat`).
    flat: bool,
}

/// Which processes of an emulated network run their data path on DPDK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct DpdkSides {
    workers: bool,
    switch: bool,
}

impl std::str::FromStr for DpdkSides {
    type Err = String;
    fn from_str(text: &str) -> Result<DpdkSides, String> {
        match text {
            "workers" => Ok(DpdkSides { workers: true, switch: false }),
            "switch" => Ok(DpdkSides { workers: false, switch: true }),
            "both" => Ok(DpdkSides { workers: true, switch: true }),
            _ => Err(format!("--dpdk '{text}': expected workers, switch or both")),
        }
    }
}

impl Options {
    fn emulated(&self) -> bool {
        self.topology.is_some() || self.link.is_some() || !self.rank_links.is_empty()
    }

    /// Switch processes the run starts (or names).
    fn switch_count(&self) -> u16 {
        if self.colocated {
            self.workers
        } else {
            self.switches.unwrap_or(1)
        }
    }
}

/// The most switches `--switches` starts: as many as an emulated network has hosts for.
const MAX_SWITCHES: u16 = netagg_emulate::fabric::MAX_SWITCH_HOSTS as u16;

const USAGE: &str =
    "usage: netagg-run -n N [--switch HOST:PORT | --switches K | --racks R] [--switch-arg ARG]... -- PROGRAM [ARGS...]
   or: netagg-run -n N [--link SETTINGS] [--rank-link RANK:SETTINGS]... [--topology FILE]
                  [--impairer auto|netem|user-space] [--mpi] [--dpdk workers|switch|both]
                  [--switches K | --colocated] [--switch-arg ARG]... -- PROGRAM [ARGS...]

  --switches K: K switch processes (shards), each summing a share of every job's slots; the
  workers get their list (NETAGG_GENERAL__SWITCHES). On an emulated network each runs on a host
  of its own behind a link of the workers' rate (rate only). --colocated: one switch in each
  worker's namespace, sharing its link.

  an emulated network (root): the switch and each worker in a network namespace of its own,
  each worker's link shaped both ways. SETTINGS: rate=200mbit,delay=5ms,jitter=1ms,loss=1%,
  queue=100ms,burst=64kb (any of them); --rank-link 3:rate=20mbit overrides rank 3's link;
  --topology FILE gives the same as [link] and [rank.N] sections (the options win), and a
  network of racks as [racks] (count, switches) and [uplink] sections, below; [uplink] and
  [racks] switches need a count of racks, there or from --racks.
  --impairer: what makes delay, jitter and loss (auto: netem where the kernel has it, else a
  user-space delay line). --mpi: run PROGRAM with mpirun, one rank per worker namespace, and
  no switch. --dpdk: the workers' data, the switch's, or both, leave from DPDK ports (DPDK's
  af_packet driver on each namespace's interface) instead of kernel sockets, with --switches K
  too (not --colocated), and with --racks R, where switch means every switch of the tree, so
  that both the racks' hops and their uplinks run on DPDK; NETAGG_* variables set beforehand
  win.
  --racks R: an aggregation tree: an upper switch and R lower switches, rack r holding ranks
  ceil(r·N/R) to ceil((r+1)·N/R) − 1; --switch-arg goes to every switch. On loopback, or on an
  emulated network of racks ([racks] count = R in the topology file does the same): each rack's
  workers and switch on a bridge of their own, joined to the core, where the upper switch is, by
  an uplink; MPI's ring crosses the same uplinks. --uplink SETTINGS: each uplink's rate, queue
  and burst (as [uplink]; unlimited unless set). --rack-switches ideal|server: each switch is the
  network (ideal, its link never shaped; the default) or a process on a server behind a link
  shaped like the workers' (as [racks] switches). --flat: one switch at the core for every rank
  instead of the tree, on the same network.";

fn parse(args: &[String]) -> Result<Options, String> {
    let mut options = Options {
        workers: 0,
        switch: None,
        switches: None,
        colocated: false,
        switch_args: Vec::new(),
        racks: 0,
        program: Vec::new(),
        topology: None,
        link: None,
        rank_links: Vec::new(),
        impairer: ImpairerChoice::Auto,
        mpi: false,
        dpdk: DpdkSides::default(),
        uplink: None,
        rack_switches: None,
        flat: false,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().cloned().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "-n" | "--workers" => {
                options.workers = value("-n")?
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or("-n takes a number of workers from 1 to 65535")?
            }
            "--switch" => options.switch = Some(value("--switch")?),
            "--switches" => {
                options.switches =
                    Some(
                        value("--switches")?.parse().ok().filter(|k| (1..=MAX_SWITCHES).contains(k)).ok_or(
                            format!("--switches takes a number of switches from 1 to {MAX_SWITCHES}"),
                        )?,
                    )
            }
            "--colocated" => options.colocated = true,
            "--switch-arg" => options.switch_args.push(value("--switch-arg")?),
            "--racks" => {
                options.racks = value("--racks")?
                    .parse()
                    .ok()
                    .filter(|&racks| racks > 0)
                    .ok_or("--racks takes a number of racks from 1 to 65535")?
            }
            "--link" => {
                let settings = LinkSettings::parse(&value("--link")?).map_err(|e| format!("--link: {e}"))?;
                options.link = Some(settings.over(&options.link.unwrap_or_default()));
            }
            "--rank-link" => options
                .rank_links
                .push(parse_rank_settings(&value("--rank-link")?).map_err(|e| format!("--rank-link: {e}"))?),
            "--topology" => options.topology = Some(value("--topology")?.into()),
            "--impairer" => {
                options.impairer = value("--impairer")?.parse().map_err(|e| format!("--impairer: {e}"))?
            }
            "--mpi" => options.mpi = true,
            "--uplink" => {
                options.uplink =
                    Some(LinkSettings::parse(&value("--uplink")?).map_err(|e| format!("--uplink: {e}"))?)
            }
            "--rack-switches" => {
                options.rack_switches =
                    Some(value("--rack-switches")?.parse().map_err(|e| format!("--rack-switches: {e}"))?)
            }
            "--flat" => options.flat = true,
            "--dpdk" => options.dpdk = value("--dpdk")?.parse()?,
            "--" => {
                options.program = args.cloned().collect();
                break;
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown option {other}\n{USAGE}")),
        }
    }
    if options.workers == 0 || options.program.is_empty() {
        return Err(USAGE.into());
    }
    if options.emulated() && options.switch.is_some() {
        return Err("--switch: on an emulated network the switch runs in a namespace of its own; \
                    drop --switch or the link options"
            .into());
    }
    if options.racks > 0 && options.switch.is_some() {
        return Err("--racks starts the switches of a tree: drop --switch".into());
    }
    if (options.uplink.is_some() || options.rack_switches.is_some() || options.flat) && !options.emulated() {
        return Err("--uplink, --rack-switches and --flat describe an emulated network of racks: give its \
                    links (--link, --rank-link or --topology) and --racks"
            .into());
    }
    if options.racks > 0 && (options.switches.is_some() || options.colocated) {
        return Err("--racks starts a tree of single switches: drop --switches and --colocated".into());
    }
    if options.racks > options.workers {
        return Err(format!("--racks {}: more racks than the {} ranks", options.racks, options.workers));
    }
    if options.dpdk != DpdkSides::default() && (!options.emulated() || options.mpi) {
        return Err("--dpdk puts DPDK ports on an emulated network's interfaces: give its links (--link, \
                    --rank-link or --topology), without --mpi"
            .into());
    }
    if options.switch.is_some() && options.switches.is_some() {
        return Err("--switch names one running switch, --switches starts several: give one of them".into());
    }
    if options.colocated && (!options.emulated() || options.switches.is_some()) {
        return Err("--colocated puts a switch in each worker's namespace of an emulated network (one per \
                    worker, so no --switches): give its links (--link, --rank-link or --topology)"
            .into());
    }
    if options.mpi && (options.switches.is_some() || options.colocated) {
        return Err(
            "--mpi runs the program's own allreduce, with no switch: drop --switches and --colocated".into(),
        );
    }
    // A colocated shard's traffic with its own worker never crosses the interface the
    // DPDK port sits on: the kernel loops it back.
    if options.dpdk != DpdkSides::default() && options.colocated {
        return Err(
            "--dpdk with --colocated: a worker's packets to the switch in its own namespace never \
                    reach the DPDK port on its interface; use --switches K (switches on hosts of their own)"
                .into(),
        );
    }
    if options.mpi && !options.emulated() {
        return Err("--mpi runs the program across an emulated network's namespaces: \
                    give its links (--link, --rank-link or --topology)"
            .into());
    }
    Ok(options)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let options = match parse(&args) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("netagg-run: {message}");
            return ExitCode::from(2);
        }
    };
    match run(options) {
        Ok(code) => ExitCode::from(code),
        Err(message) => {
            eprintln!("netagg-run: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(options: Options) -> Result<u8, String> {
    // Ctrl-C and SIGTERM stop the ranks and the switch, and (on an emulated network)
    // remove the namespaces, instead of killing this process before it can.
    // A second one ends this process at once, leaving the namespaces to the next run.
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(signal, 130, Arc::clone(&interrupted))
            .and_then(|_| signal_hook::flag::register(signal, Arc::clone(&interrupted)))
            .map_err(|e| e.to_string())?;
    }
    if options.emulated() {
        return emulated::run(&options, &interrupted);
    }
    let mut switches = Vec::new();
    let controls = match &options.switch {
        Some(address) => Ok(vec![address.clone()]),
        None => (0..options.switch_count())
            .map(|shard| {
                let label =
                    if options.switch_count() > 1 { format!("switch {shard}") } else { "switch".into() };
                let (child, control) =
                    start_switch(Command::new(switch_program()), "127.0.0.1", &options.switch_args, &label)?;
                switches.push(child);
                Ok(control)
            })
            .collect::<Result<Vec<_>, String>>(),
    };
    // The switches each rank registers with: every shard, or in a tree its rack's.
    let rank_controls = controls.and_then(|controls| {
        start_rack_switches(&options, options.racks, &controls, &mut switches, |rack, arguments, label| {
            start_switch(Command::new(switch_program()), "127.0.0.1", arguments, label)
                .map_err(|error| format!("rack {rack}'s switch: {error}"))
        })
    });
    // The switches are stopped on every path, errors included: they must not outlive us.
    let result = rank_controls.and_then(|rank_controls| {
        let rendezvous = PortReservation::on_loopback()?;
        let session = format!("netagg-run-{}", std::process::id());
        let ranks = (0..options.workers)
            .map(|rank| {
                let mut command = Command::new(&options.program[0]);
                command.args(&options.program[1..]);
                set_rank_environment(
                    &mut command,
                    rank,
                    options.workers,
                    ("127.0.0.1", rendezvous.port),
                    &rank_controls[usize::from(rank)],
                    &session,
                )?;
                Ok((rank.to_string(), command))
            })
            .collect::<Result<Vec<_>, String>>()?;
        // Held until every rank has ended.
        let code = run_ranks(ranks, &interrupted);
        drop(rendezvous);
        code
    });
    // The lower switches of a tree first, so that each prints its counters while its
    // upper switch still runs.
    switches.into_iter().rev().for_each(stop_switch);
    result
}

/// Starts the switch of each of `racks` racks (none for 0) by `start(rack, arguments,
/// label)`, under the upper switch `controls[0]`, into `switches`, and returns the
/// switches each rank registers with: its rack's, or else all of `controls`.
fn start_rack_switches(
    options: &Options,
    racks: u16,
    controls: &[String],
    switches: &mut Vec<Child>,
    mut start: impl FnMut(u16, &[String], &str) -> Result<(Child, String), String>,
) -> Result<Vec<Vec<String>>, String> {
    let mut rank_controls = vec![controls.to_vec(); usize::from(options.workers)];
    let upper = controls.first().ok_or("no upper switch for the racks' switches")?;
    for rack in 0..racks {
        let mut arguments = options.switch_args.clone();
        let tree = ["--upstream", upper, "--rack", &rack.to_string(), "--racks", &racks.to_string()];
        arguments.extend(tree.map(String::from));
        let (child, rack_control) = start(rack, &arguments, &format!("rack {rack}"))?;
        switches.push(child);
        for rank in netagg_wire::control::rack_ranks(rack, racks, options.workers) {
            rank_controls[usize::from(rank)] = vec![rack_control.clone()];
        }
    }
    Ok(rank_controls)
}

fn switch_program() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("netagg-switch")))
        .filter(|path| path.is_file())
        .unwrap_or_else(|| PathBuf::from("netagg-switch"))
}

/// Starts a switch (`command`: the switch program, or a command that runs it) on free
/// ports of `host`, its output lines prefixed with `label`, and returns it with its
/// control address.
fn start_switch(
    mut command: Command,
    host: &str,
    extra: &[String],
    label: &str,
) -> Result<(Child, String), String> {
    let mut child = command
        .args(["--control", &format!("{host}:0"), "--data", &format!("{host}:0")])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", command.get_program()))?;
    let Some(stdout) = child.stdout.take() else { return Err("switch has no stdout".into()) };
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    // "netagg-switch: control HOST:PORT data HOST:PORT"
    let Some(control) = first.split_whitespace().nth(2).map(str::to_string) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("the switch did not start (it printed '{first}')"));
    };
    let label = label.to_string();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            println!("[{label}] {line}");
        }
    });
    Ok((child, control))
}

/// A loopback TCP port held for rank 0 of a PyTorch process group while the ranks run.
///
/// A port found free by binding and releasing it may be taken before rank 0 binds it
/// (by another program's outgoing connection, whose source port the kernel picks from
/// the same range). This socket keeps the port bound, not listening, with
/// `SO_REUSEADDR`: the kernel then gives it to no other bind and no outgoing connection,
/// while a listener that sets `SO_REUSEADDR` too, as PyTorch's `TCPStore` (and most
/// servers) do, may bind and listen on it, since no other socket listens there.
struct PortReservation {
    /// Never read: its being open is the reservation.
    _socket: socket2::Socket,
    port: u16,
}

impl PortReservation {
    fn on_loopback() -> Result<PortReservation, String> {
        use socket2::{Domain, Socket, Type};
        let reserve = || -> std::io::Result<PortReservation> {
            let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
            socket.set_reuse_address(true)?;
            socket.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())?;
            let port = socket.local_addr()?.as_socket().map_or(0, |address| address.port());
            Ok(PortReservation { _socket: socket, port })
        };
        reserve().map_err(|e| format!("cannot reserve a loopback port for MASTER_PORT: {e}"))
    }
}

/// What a rank needs to know: netagg's rank, world and switches (`controls`, their
/// control addresses), and PyTorch's rendezvous (`master`: rank 0's address and a port).
fn set_rank_environment(
    command: &mut Command,
    rank: u16,
    workers: u16,
    master: (&str, u16),
    controls: &[String],
    session: &str,
) -> Result<(), String> {
    let control = controls.first().ok_or("no switch to give the ranks")?;
    let (host, port) =
        control.rsplit_once(':').ok_or(format!("switch address '{control}' is not HOST:PORT"))?;
    if controls.len() > 1 {
        command.env("NETAGG_GENERAL__SWITCHES", controls.join(","));
    }
    command
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", workers.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", workers.to_string())
        .env("MASTER_ADDR", master.0)
        .env("MASTER_PORT", master.1.to_string())
        .env("NETAGG_GENERAL__CONTROLLER_IP", host)
        .env("NETAGG_GENERAL__CONTROLLER_PORT", port)
        .env("NETAGG_GENERAL__SESSION", session);
    Ok(())
}

/// Starts each labelled command with its output prefixed by its label, and waits for
/// all: the first failure stops the others (after 5 s to finish on their own), and so
/// does an interrupt (at once). Returns the first failure's exit code, or 130 after an
/// interrupt, or 0.
fn run_ranks(commands: Vec<(String, Command)>, interrupted: &AtomicBool) -> Result<u8, String> {
    let (exits, exited) = mpsc::channel();
    let mut running = Vec::new();
    for (label, mut command) in commands {
        let spawned = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut running);
                return Err(format!("cannot start {:?}: {e}", command.get_program()));
            }
        };
        for (stream, is_err) in [
            (child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>), false),
            (child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>), true),
        ] {
            let Some(stream) = stream else { continue };
            let label = label.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if is_err {
                        eprintln!("[{label}] {line}");
                    } else {
                        println!("[{label}] {line}");
                    }
                }
            });
        }
        running.push((label, child));
    }
    let mut code = 0u8;
    let mut stop_by: Option<Instant> = None;
    while !running.is_empty() {
        running.retain_mut(|(label, child)| match child.try_wait() {
            Ok(Some(status)) => {
                let _ = exits.send((label.clone(), status));
                false
            }
            Ok(None) => true,
            Err(_) => false,
        });
        // An interrupt first: the ranks it reached too then exit, and are no failures.
        if interrupted.load(Ordering::Relaxed) && code != 130 {
            eprintln!("netagg-run: interrupted; stopping the ranks");
            code = 130;
            stop_by = Some(Instant::now());
        }
        while let Ok((label, status)) = exited.try_recv() {
            if !status.success() && code == 0 {
                code = status.code().map_or(1, |c| c.clamp(1, 255) as u8);
                eprintln!("netagg-run: rank {label} failed ({status}); stopping the others");
                stop_by = Some(Instant::now() + Duration::from_secs(5));
            }
        }
        if stop_by.is_some_and(|deadline| Instant::now() >= deadline) {
            stop_all(&mut running);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(code)
}

fn stop_all(running: &mut Vec<(String, Child)>) {
    for (_, child) in running.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
    running.clear();
}

fn stop_switch(mut switch: Child) {
    // SIGTERM lets the switch print its final counters.
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_child(&switch),
        rustix::process::Signal::TERM,
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while switch.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = switch.kill();
    let _ = switch.wait();
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream};

    use socket2::{Domain, Socket, Type};

    use super::*;

    #[test]
    fn a_reserved_port_is_given_to_no_other_bind_but_a_reusing_listener_takes_it() {
        let reservation = PortReservation::on_loopback().unwrap();
        let address = SocketAddr::from(([127, 0, 0, 1], reservation.port));
        let plain = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        let error = plain.bind(&address.into()).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse, "a bind without SO_REUSEADDR");
        // The kernel's own picks, for binds to port 0 and for connections' source ports.
        let picked: Vec<u16> = (0..500)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port())
            .collect();
        assert!(!picked.contains(&reservation.port));
        // Rank 0's listener, with SO_REUSEADDR as PyTorch's TCPStore and Rust's std set it.
        let listener = TcpListener::bind(address).unwrap();
        let mut client = TcpStream::connect(address).unwrap();
        client.write_all(b"rendezvous").unwrap();
        let mut received = [0u8; 10];
        listener.accept().unwrap().0.read_exact(&mut received).unwrap();
        assert_eq!(&received, b"rendezvous");
    }
}
