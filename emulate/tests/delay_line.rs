//! The delay line between real network namespaces: needs root, skipped otherwise.
//!
//! Each test builds its own namespaces `dl-<pid>-<test>-{a,f,b}`: a and b joined through f by
//! veth pairs (a's `va` to f's `fa`, f's `fb` to b's `vb`), the delay line in f between
//! `fa` and `fb`, addresses 10.77.0.1 on `va` and 10.77.0.2 on `vb`.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use netagg_emulate::delay_line::{DelayLine, Impairment};

const A_ADDRESS: &str = "10.77.0.1";
const B_ADDRESS: &str = "10.77.0.2";
const A_MAC: &str = "02:77:00:00:00:01";
const B_MAC: &str = "02:77:00:00:00:02";

fn is_root() -> bool {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

macro_rules! skip_unless_root {
    () => {
        if !is_root() {
            eprintln!("skipped: the delay line tests need root to create network namespaces");
            return;
        }
    };
}

fn ip(args: &[&str]) {
    let output = Command::new("ip").args(args).output().expect("running ip");
    assert!(output.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
}

fn tc(args: &[&str]) {
    let output = Command::new("tc").args(args).output().expect("running tc");
    assert!(output.status.success(), "tc {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
}

/// Three namespaces a - f - b, deleted when dropped, even after a failed assertion.
struct Topology {
    a: String,
    f: String,
    b: String,
}

impl Topology {
    fn new(test: &str) -> Topology {
        let name = |end: &str| format!("dl-{}-{test}-{end}", std::process::id());
        let topology = Topology { a: name("a"), f: name("f"), b: name("b") };
        for namespace in [&topology.a, &topology.f, &topology.b] {
            ip(&["netns", "add", namespace]);
            // No IPv6: its neighbour and router solicitations would be frames the tests
            // do not expect.
            for conf in ["all", "default"] {
                let key = format!("net.ipv6.conf.{conf}.disable_ipv6=1");
                ip(&["netns", "exec", namespace, "sysctl", "-qw", &key]);
            }
            ip(&["-n", namespace, "link", "set", "lo", "up"]);
        }
        let (a, f, b) = (&topology.a, &topology.f, &topology.b);
        ip(&[
            "link", "add", "va", "netns", a, "address", A_MAC, "type", "veth", "peer", "name", "fa", "netns",
            f,
        ]);
        ip(&[
            "link", "add", "vb", "netns", b, "address", B_MAC, "type", "veth", "peer", "name", "fb", "netns",
            f,
        ]);
        for (namespace, device) in [(a, "va"), (f, "fa"), (f, "fb"), (b, "vb")] {
            ip(&["-n", namespace, "link", "set", device, "up"]);
        }
        ip(&["-n", a, "addr", "add", &format!("{A_ADDRESS}/24"), "dev", "va"]);
        ip(&["-n", b, "addr", "add", &format!("{B_ADDRESS}/24"), "dev", "vb"]);
        // Known neighbours: ARP through a lossy line would lose datagrams the tests count.
        ip(&["-n", a, "neigh", "replace", B_ADDRESS, "lladdr", B_MAC, "dev", "va", "nud", "permanent"]);
        ip(&["-n", b, "neigh", "replace", A_ADDRESS, "lladdr", A_MAC, "dev", "vb", "nud", "permanent"]);
        topology
    }

    fn start(&self, a_to_b: Impairment, b_to_a: Impairment) -> DelayLine {
        DelayLine::start(&self.f, "fa", "fb", a_to_b, b_to_a).expect("starting the delay line")
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for namespace in [&self.a, &self.f, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", namespace]).status();
        }
    }
}

/// Runs `work` on a thread of its own inside the network namespace `namespace`.
fn spawn_in<T: Send + 'static>(
    namespace: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> thread::JoinHandle<T> {
    let file = File::open(format!("/run/netns/{namespace}")).expect("opening the namespace");
    thread::spawn(move || {
        // SAFETY: setns takes no pointers; it moves only this thread.
        let entered = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(entered, 0, "setns: {}", std::io::Error::last_os_error());
        work()
    })
}

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

fn delay(millis: u64) -> Impairment {
    Impairment { delay: ms(millis), ..Impairment::default() }
}

/// A UDP echo server on b that answers `count` datagrams, ready when this returns.
fn udp_echo_on_b(topology: &Topology, count: usize) -> thread::JoinHandle<()> {
    let (ready, is_ready) = mpsc::channel();
    let server = spawn_in(&topology.b, move || {
        let socket = UdpSocket::bind((B_ADDRESS, 7000)).expect("binding the echo server");
        socket.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        ready.send(()).expect("test alive");
        let mut buffer = [0; 64];
        for _ in 0..count {
            let Ok((length, from)) = socket.recv_from(&mut buffer) else { return };
            let _ = socket.send_to(&buffer[..length], from);
        }
    });
    is_ready.recv().expect("echo server started");
    server
}

#[test]
fn a_round_trip_takes_the_two_delays() {
    skip_unless_root!();
    let topology = Topology::new("rtt");
    let line = topology.start(delay(20), delay(20));
    let echo = udp_echo_on_b(&topology, 6);
    let round_trips = spawn_in(&topology.a, || {
        let socket = UdpSocket::bind((A_ADDRESS, 0)).expect("binding the client");
        socket.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
        let mut buffer = [0; 64];
        (0..6)
            .map(|i: u8| {
                let start = Instant::now();
                socket.send_to(&[i; 32], (B_ADDRESS, 7000)).expect("sending");
                let (length, _) = socket.recv_from(&mut buffer).expect("no echo within 2 s");
                assert_eq!(&buffer[..length], &[i; 32]);
                start.elapsed()
            })
            .collect::<Vec<_>>()
    })
    .join()
    .expect("client");
    echo.join().expect("echo server");
    println!("round trips through 20 ms each way: {round_trips:?}");
    for round_trip in &round_trips {
        assert!(*round_trip >= ms(40), "round trip {round_trip:?} shorter than the two delays");
        assert!(*round_trip < ms(200), "round trip {round_trip:?} far longer than the two delays");
    }
    thread::sleep(ms(100));
    let [a_to_b, b_to_a] = line.stats();
    println!("a to b: {a_to_b:?}\nb to a: {b_to_a:?}");
    assert_eq!((a_to_b.frames, b_to_a.frames), (6, 6));
    assert_eq!(a_to_b.lost + a_to_b.overflowed + a_to_b.unreadable + a_to_b.send_failed, 0);
    assert_eq!(a_to_b.ended_by, None);
}

#[test]
fn tcp_carries_every_byte_through_the_line() {
    skip_unless_root!();
    const BYTES: usize = 20 << 20;
    let pattern = |offset: usize| (offset.wrapping_mul(2_654_435_761) >> 13) as u8;
    let topology = Topology::new("tcp");
    let line = topology.start(delay(5), delay(5));
    let (ready, is_ready) = mpsc::channel();
    let receiver = spawn_in(&topology.b, move || {
        let listener = TcpListener::bind((B_ADDRESS, 7001)).expect("listening");
        ready.send(()).expect("test alive");
        let (mut stream, _) = listener.accept().expect("accepting");
        // Bad checksums would stall the transfer: fail instead of hanging.
        stream.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut buffer = vec![0; 1 << 16];
        let (mut received, mut first_wrong) = (0, None);
        loop {
            let length = stream.read(&mut buffer).expect("reading within 20 s");
            if length == 0 {
                return (received, first_wrong);
            }
            for (i, &byte) in buffer[..length].iter().enumerate() {
                if first_wrong.is_none() && byte != pattern(received + i) {
                    first_wrong = Some(received + i);
                }
            }
            received += length;
        }
    });
    is_ready.recv().expect("receiver listening");
    let start = Instant::now();
    spawn_in(&topology.a, move || {
        let mut stream = TcpStream::connect((B_ADDRESS, 7001)).expect("connecting");
        stream.set_write_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let data: Vec<u8> = (0..BYTES).map(pattern).collect();
        stream.write_all(&data).expect("writing within 20 s");
    })
    .join()
    .expect("sender");
    let (received, first_wrong) = receiver.join().expect("receiver");
    let elapsed = start.elapsed();
    thread::sleep(ms(100));
    let [a_to_b, b_to_a] = line.stats();
    println!("{BYTES} bytes in {elapsed:?}\na to b: {a_to_b:?}\nb to a: {b_to_a:?}");
    println!("a to b: {} bytes per frame on average", a_to_b.bytes / a_to_b.frames.max(1));
    assert_eq!(received, BYTES);
    assert_eq!(first_wrong, None, "a byte arrived wrong");
    assert!(a_to_b.bytes >= BYTES as u64);
}

#[test]
fn loss_drops_about_its_share_and_counts_it() {
    skip_unless_root!();
    const DATAGRAMS: usize = 2000;
    let topology = Topology::new("loss");
    let lossy = Impairment { delay: ms(1), loss: 0.5, ..Impairment::default() };
    let line = topology.start(lossy, delay(1));
    let (ready, is_ready) = mpsc::channel();
    let receiver = spawn_in(&topology.b, move || {
        let socket = UdpSocket::bind((B_ADDRESS, 7002)).expect("binding the receiver");
        socket.set_read_timeout(Some(Duration::from_millis(500))).expect("timeout");
        ready.send(()).expect("test alive");
        let mut buffer = [0; 64];
        let mut received = 0;
        while socket.recv(&mut buffer).is_ok() {
            received += 1;
        }
        received
    });
    is_ready.recv().expect("receiver bound");
    spawn_in(&topology.a, || {
        let socket = UdpSocket::bind((A_ADDRESS, 0)).expect("binding the sender");
        for i in 0..DATAGRAMS {
            socket.send_to(&(i as u32).to_le_bytes(), (B_ADDRESS, 7002)).expect("sending");
            if i % 50 == 49 {
                thread::sleep(ms(1));
            }
        }
    })
    .join()
    .expect("sender");
    let received: u64 = receiver.join().expect("receiver");
    let [a_to_b, b_to_a] = line.stats();
    println!("{received} of {DATAGRAMS} received\na to b: {a_to_b:?}\nb to a: {b_to_a:?}");
    assert!((800..=1200).contains(&received), "{received} of {DATAGRAMS} received at loss 0.5");
    assert_eq!(a_to_b.frames, received);
    assert_eq!(a_to_b.lost, DATAGRAMS as u64 - received);
    assert_eq!(b_to_a.lost, 0);
}

#[test]
fn start_names_what_is_missing() {
    skip_unless_root!();
    let topology = Topology::new("missing");
    let error = match DelayLine::start(&topology.f, "fa", "nosuch", delay(1), delay(1)) {
        Ok(_) => panic!("started on a device that does not exist"),
        Err(error) => error.to_string(),
    };
    assert!(error.contains(&topology.f) && error.contains("device nosuch"), "{error}");
    let error = match DelayLine::start("dl-no-such-namespace", "fa", "fb", delay(1), delay(1)) {
        Ok(_) => panic!("started in a namespace that does not exist"),
        Err(error) => error.to_string(),
    };
    assert!(error.contains("/run/netns/dl-no-such-namespace"), "{error}");
    let bad_loss = Impairment { loss: 1.5, ..Impairment::default() };
    assert!(DelayLine::start(&topology.f, "fa", "fb", bad_loss, delay(1)).is_err());
}

/// Checked before anything is opened, so without root too.
#[test]
fn a_delay_past_what_a_line_holds_is_refused() {
    for too_long in [
        Impairment { delay: Duration::from_secs(7200), ..Impairment::default() },
        Impairment { delay: Duration::MAX, jitter: Duration::from_secs(1), ..Impairment::default() },
    ] {
        let error = match DelayLine::start("dl-unopened", "fa", "fb", delay(1), too_long) {
            Ok(_) => panic!("started with {too_long:?}"),
            Err(error) => error,
        };
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
        assert!(error.to_string().contains("b to a: delay"), "{error}");
    }
}

/// Whichever direction meets the removed device first (a to b sending to it, b to a
/// reading from it), the error ends the line's one thread, names the device, and both
/// directions report it.
#[test]
fn a_removed_device_ends_the_whole_line_and_is_named() {
    skip_unless_root!();
    let topology = Topology::new("removed");
    let line = topology.start(delay(1), delay(1));
    // Deleting vb in b deletes its peer fb in f, the output of a to b and input of b to a.
    ip(&["-n", &topology.b, "link", "del", "vb"]);
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut stats = line.stats();
    while stats.iter().any(|direction| direction.ended_by.is_none()) && Instant::now() < deadline {
        thread::sleep(ms(20));
        stats = line.stats();
    }
    println!("{stats:?}");
    for (name, direction) in ["a to b", "b to a"].iter().zip(&stats) {
        let ended_by = direction.ended_by.as_deref().unwrap_or_default();
        assert!(ended_by.contains(" fb: "), "{name} still running or ended by {ended_by:?}");
    }
    assert_eq!(stats[0].ended_by, stats[1].ended_by);
    drop(line); // joins its thread without hanging
}

/// Frames per second one direction forwards with no delay: run with
/// `cargo test -p netagg-emulate --test delay_line -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn forwarding_rate() {
    skip_unless_root!();
    let topology = Topology::new("rate");
    let line = topology.start(Impairment::default(), Impairment::default());
    let (ready, is_ready) = mpsc::channel();
    let receiver = spawn_in(&topology.b, move || {
        let socket = UdpSocket::bind((B_ADDRESS, 7003)).expect("binding the receiver");
        socket.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
        ready.send(()).expect("test alive");
        let mut buffer = [0; 64];
        let mut received = 0u64;
        while socket.recv(&mut buffer).is_ok() {
            received += 1;
        }
        received
    });
    is_ready.recv().expect("receiver bound");
    let blast = Duration::from_secs(2);
    let sent = spawn_in(&topology.a, move || {
        let socket = UdpSocket::bind((A_ADDRESS, 0)).expect("binding the sender");
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < blast {
            if socket.send_to(&[0; 18], (B_ADDRESS, 7003)).is_ok() {
                sent += 1;
            }
        }
        sent
    })
    .join()
    .expect("sender");
    let received = receiver.join().expect("receiver");
    let [a_to_b, _] = line.stats();
    println!(
        "sent {sent}, received {received} in {blast:?}: {:.0} frames/s forwarded\n{a_to_b:?}",
        a_to_b.frames as f64 / blast.as_secs_f64()
    );
}

/// CPU time the calling process's threads named `name` have run so far, from the
/// scheduler's own count (/proc/self/task/*/schedstat, in nanoseconds).
fn cpu_time_of_threads(name: &str) -> Duration {
    let mut nanos = 0;
    for task in std::fs::read_dir("/proc/self/task").expect("listing threads").flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() == name {
            let schedstat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
            nanos += schedstat.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    Duration::from_nanos(nanos)
}

/// The delay line's CPU per frame forwarded, with a 1 ms delay both ways, for UDP paced at
/// a few rates (1 KiB datagrams: 4, 12 and 24 thousand a second are about 35, 100 and 200
/// Mbit/s): run with `cargo test --release -p netagg-emulate --test delay_line
/// cpu_per_frame -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn cpu_per_frame() {
    skip_unless_root!();
    const PAYLOAD: usize = 1024;
    let topology = Topology::new("cpu");
    for frames_per_ms in [4, 12, 24] {
        // Paced by a rate limit a little above the offered rate, as a link's tbf paces them.
        let rate = format!("{}kbit", frames_per_ms * (PAYLOAD as u64 + 42) * 8 * 105 / 100);
        let limit = ["-n", &topology.a, "qdisc", "replace", "dev", "va", "root", "tbf", "rate", &rate];
        tc(&[&limit[..], &["burst", "4kb", "latency", "50ms"]].concat());
        let line = topology.start(delay(1), delay(1));
        let (ready, is_ready) = mpsc::channel();
        let receiver = spawn_in(&topology.b, move || {
            let socket = UdpSocket::bind((B_ADDRESS, 7004)).expect("binding the receiver");
            socket.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
            ready.send(()).expect("test alive");
            let mut buffer = [0; PAYLOAD];
            let mut received = 0u64;
            while socket.recv(&mut buffer).is_ok() {
                received += 1;
            }
            received
        });
        is_ready.recv().expect("receiver bound");
        let threads = ["delay fa=fb"];
        let cpu_before: Duration = threads.iter().map(|name| cpu_time_of_threads(name)).sum();
        let length = Duration::from_secs(2);
        spawn_in(&topology.a, move || {
            let socket = UdpSocket::bind((A_ADDRESS, 0)).expect("binding the sender");
            let start = Instant::now();
            let mut next = start;
            while next < start + length {
                for _ in 0..frames_per_ms {
                    let _ = socket.send_to(&[0; PAYLOAD], (B_ADDRESS, 7004));
                }
                next += ms(1);
                thread::sleep(next.saturating_duration_since(Instant::now()));
            }
        })
        .join()
        .expect("sender");
        let received = receiver.join().expect("receiver");
        let cpu: Duration =
            threads.iter().map(|name| cpu_time_of_threads(name)).sum::<Duration>() - cpu_before;
        let [a_to_b, _] = line.stats();
        println!(
            "cpu_per_frame: {} frames/s offered, {received} received, line CPU {:.1} % of a core, {:.2} us per frame, lateness median {:?} p99 {:?}",
            frames_per_ms * 1000,
            cpu.as_secs_f64() / length.as_secs_f64() * 100.0,
            cpu.as_secs_f64() * 1e6 / a_to_b.frames.max(1) as f64,
            a_to_b.lateness_median,
            a_to_b.lateness_p99,
        );
    }
}
