//! Every key, declared once: its section, name, default, what it accepts (its kind) and the
//! comment above it in `configs/netagg.cfg`. Parsing, validation, error messages,
//! environment variable names, `Default` and `configs/netagg.cfg` all derive from here.
//!
//! A key is a doc comment and one line, `name = default, kind;`, in its section's block.
//! The doc comment is what `configs/netagg.cfg` shows above the key (none where the
//! comment above an earlier key speaks for it too); the kind (`kind.rs`) is what the key
//! accepts, which error messages state. To add a key: add its field to the section's
//! struct (`general.rs`, `backends.rs`, `faults.rs` or `switch.rs`), its line here, then
//! rewrite the file with `NETAGG_BLESS=1 cargo test -p netagg-config` (a test fails while
//! it differs). To add a section: its struct and its field in `Config`, a `struct_keys!`
//! block here and a line in `sections!` in the order the file shows it; its environment
//! variables follow (`NETAGG_BACKEND_RDMA__<KEY>` for `[backend.rdma]`). A field of a type
//! no key has used yet needs a `Field` impl in `kind.rs`, and a new kind of value a `Kind`
//! there; an enum of names is declared with `named_enum!` there, and its key's kind is
//! `Choice { choices: Enum::NAMES, .. }`.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netagg_faults::MAX_FAULT_DELAY;

use crate::kind::Kind::*;
use crate::kind::Unit::*;
use crate::table::{keys_at, sections, struct_keys};
use crate::{
    BackendKind, Dpdk, Dummy, Faults, General, PollMode, Rdma, RdmaPoll, SparseMode, Switch, SwitchTransport,
    Udp, WirePrecision, MAX_PACKET_NUMEL, MAX_SESSION_NAME_LEN,
};

/// The comment that opens `configs/netagg.cfg`.
pub(crate) const HEADER: &str = "\
netagg configuration: SwitchML's format, sections and key names, plus netagg's own keys.

Read by every netagg program (the library's Config::load): the file named explicitly,
else $NETAGG_CONFIG, else the first of ./netagg.cfg, ./netagg-<hostname>.cfg and
/etc/netagg.cfg. Every key can be overridden from the environment as
NETAGG_<SECTION>__<KEY> (NETAGG_GENERAL__NUM_WORKERS, NETAGG_BACKEND_DUMMY__BANDWIDTH);
rank and num_workers also come from mpirun, srun and torchrun (OMPI_COMM_WORLD_RANK/SIZE,
PMI_RANK/SIZE, SLURM_PROCID/NTASKS, RANK/WORLD_SIZE). Unknown keys and bad values are
errors naming the file or variable, the key and what is allowed. Values below are the
defaults.

Written from the table of keys in config/src/keys.rs: change the comments there.";

sections! {
    "general" at general: GENERAL_KEYS;
    /// general.backend = dummy: the link is this process's memory, so packets are neither
    /// sealed with nor checked against their CRC32C unless [faults] corrupts datagrams
    /// (send_corrupt or receive_corrupt above 0); then both sides check everything.
    "backend.dummy" at dummy: DUMMY_KEYS;
    "backend.udp" at udp: UDP_KEYS;
    /// general.backend = dpdk: the worker's datagrams leave from a DPDK port, kernel bypassed,
    /// in the same UDP datagrams as backend.udp's, so that either side may use the kernel. The
    /// endpoint answers ARP for its address and resolves the switch's MAC (or takes peer_mac).
    /// The port gets a queue pair per worker thread where the device has that many (on
    /// af_packet, device option qpairs=N), else threads share them.
    "backend.dpdk" at dpdk: DPDK_KEYS, listing its own keys;
    /// general.backend = rdma: each worker thread connects one RC queue pair to the switch through
    /// rdma_cm (switch.data's address from the switch's accept) and exchanges the same datagrams as
    /// backend.udp's as RDMA SEND messages from registered buffers.
    "backend.rdma" at rdma: RDMA_KEYS, listing its own keys;
    /// Faults injected into this worker's datagrams, to test loss recovery; all 0 injects
    /// nothing (the default; keep it so in production). They wrap any backend. A corrupted
    /// datagram (a flipped bit anywhere) fails the CRC32C every packet ends with, and is
    /// dropped, counted as corrupt and recovered as a loss: results stay exact (on the dummy
    /// backend too, which checks checksums only while corruption is injected).
    "faults" at faults: FAULT_KEYS, listing its own keys;
    /// Read by netagg-switch --config FILE; its flags override these.
    "switch" at switch: SWITCH_KEYS;
    /// Faults injected into the switch's data path, as in [faults]: receive_* on the packets
    /// from the workers, send_* on the results (SwitchML's set_drop_probabilities(ingress,
    /// egress) is receive_drop and send_drop). Also netagg-switch --faults KEY=VALUE,...
    "switch.faults" at switch.faults: FAULT_KEYS, listing its own keys;
    /// switch.transport = dpdk: the data path's port, as in [backend.dpdk]; ip defaults to
    /// switch.data's address, and the UDP port is switch.data's. Workers' MACs are learned from
    /// their frames. Also NETAGG_SWITCH_DPDK__<KEY>.
    "switch.dpdk" at switch.dpdk: DPDK_KEYS, listing its own keys;
    /// switch.transport = rdma: the data path listens through rdma_cm at switch.data's address and
    /// port and accepts one queue pair per worker thread, as in [backend.rdma]. Also
    /// NETAGG_SWITCH_RDMA__<KEY>.
    "switch.rdma" at switch.rdma: RDMA_KEYS, listing its own keys;
}

struct_keys! {
    GENERAL_KEYS: General {
        /// This worker's rank, 0 to num_workers - 1 (usually set by the launcher).
        rank = 0, Integer { min: 0, max: 65534 };
        /// Workers in the session, 1 to 65535.
        num_workers = 1, Integer { min: 1, max: 65535 };
        /// Threads per worker that stream a job's packets; each owns an equal share of the slots.
        num_worker_threads = 2, Integer { min: 1, max: 1024 };
        /// Packets in flight per worker, all threads together (the slots it uses at the switch).
        /// Every thread needs at least one.
        max_outstanding_packets = 256, Integer { min: 1, max: 65535 };
        /// Elements of 4 bytes per packet, 1 to 16363 (a 64 KiB datagram): the packet's payload
        /// bytes. 16-bit packets (float16, bfloat16, wire_precision) carry twice as many.
        /// Larger packets cost fewer system calls per byte; SwitchML's hardware takes 64 or 256.
        packet_numel = 256, Integer { min: 1, max: MAX_PACKET_NUMEL as u64 };
        /// udp: through a netagg-switch. dpdk: the same, from a DPDK port ([backend.dpdk]). rdma:
        /// the same, over RDMA reliable connections ([backend.rdma]). dummy: no network, an
        /// in-process switch that sums as if every worker had sent the same data.
        backend = BackendKind::Udp, Choice { choices: BackendKind::NAMES, quoted: true };
        /// How float32 travels: native (summed as floats by the switch), or
        /// cpu_exponent_quantizer (block floating point: int32 scaled by a per-packet exponent all
        /// workers agree on, as a switch ASIC needs; a block holding an infinity or a NaN on any
        /// worker comes back NaN on every worker).
        prepostprocessor = "native".into(),
            Choice { choices: &["native", "cpu_exponent_quantizer"], quoted: true };
        /// How float32 tensors travel with prepostprocessor = native: float32, or float16 or
        /// bfloat16 (half the bytes, as PyTorch DDP's fp16_compress_hook and bf16_compress_hook
        /// send): each worker thread rounds its elements to 16 bits as it fills a packet and widens
        /// the sums as it stores them, and the switch sums them in float32, rounding once. float16
        /// keeps 11 significant bits up to 65504 (a larger sum is infinite); bfloat16 keeps 8, with
        /// float32's range. Every rank of a session must use the same setting. float16 and
        /// bfloat16 tensors always travel as they are.
        wire_precision = WirePrecision::Float32, Choice { choices: WirePrecision::NAMES, quoted: true };
        /// Retransmission timeout in milliseconds before a round trip is measured, and its floor
        /// afterwards; it then follows the measured round-trip time and doubles on each timeout.
        timeout = Duration::from_millis(10), Timeout { unit: Milliseconds, zero: None };
        /// Seconds without progress after which a job fails (a dead switch or worker).
        job_timeout = Duration::from_secs(10), Timeout { unit: Seconds, zero: None };
        /// Once the round trips show a standing queue on this worker's path that overflows (a link
        /// slower than the worker behind a buffer shorter than the window), the worker spaces its
        /// data packets at the rate the path delivers, keeping the queue near pacing_target, so
        /// that it drops next to nothing. A path that forms no queue, or one deep enough to hold
        /// the window, is never paced. false: the window alone governs.
        pacing = true, Bool;
        /// The standing queueing delay, in milliseconds, the pacer aims below; keep it under the
        /// shortest queue on the path.
        pacing_target = Duration::from_millis(2), Timeout { unit: Milliseconds, zero: None };
        /// Seconds to wait for the switch and for every rank to register.
        connect_timeout = Duration::from_secs(30), Timeout { unit: Seconds, zero: None };
        /// The switch's control address (netagg-switch --control).
        controller_ip = "127.0.0.1".into(), Host;
        controller_port = 50099, Port;
        /// Several switches (shards) for one session, their control addresses HOST:PORT,
        /// comma-separated: each sums a contiguous share of every job's slots, the first the
        /// lowest. Every rank must list the same switches in the same order. Empty: the one switch
        /// at controller_ip and controller_port.
        switches = Vec::new(), HostPorts;
        /// Session name: the ranks of one job share it; concurrent jobs use different names.
        session = "default".into(), Name { max: MAX_SESSION_NAME_LEN };
        /// Rounds each slot keeps at the switch for loss recovery, a power of two from 2 to 64.
        /// 2 is SwitchML's shadow copy; more lets sparse streams acknowledge in larger batches.
        depth = 8, PowerOfTwo { min: 2, max: 64 };
        /// auto: jobs travel as sparse block streams wherever the encoding keeps zeros zero (int32,
        /// and float32 with prepostprocessor = native): each worker sends only its blocks of
        /// packet_numel elements that are not all zero, and blocks zero on every worker never
        /// travel (OmniReduce). Block floating point float32 always travels dense. off: every block
        /// is sent, in SwitchML's dense rounds, which cost less for tensors with few zero blocks.
        /// Every rank of a session must use the same setting.
        sparse = SparseMode::Off, Choice { choices: SparseMode::NAMES, quoted: true };
    }
}

struct_keys! {
    DUMMY_KEYS: Dummy {
        /// Emulated link bandwidth in Mbit/s; 0 runs as fast as the CPU allows.
        bandwidth = 100_000.0, Real { unit: "Mbit/s", min: 1e-3, max: 1e9 };
        /// true: sum as the switch would; false: return each packet unchanged.
        process_packets = true, Bool;
    }
}

struct_keys! {
    UDP_KEYS: Udp {
        /// Local address the worker threads' sockets bind to.
        bind_ip = IpAddr::from([0, 0, 0, 0]), Ip;
        /// Kernel socket buffer size in bytes (capped by net.core.rmem_max and wmem_max).
        socket_buffer = 4 << 20, Bytes { min: 0, max: Some(1 << 30) };
    }
}

struct_keys! {
    DPDK_KEYS: Dpdk {
        /// EAL's arguments, split at white space. The default needs no hugepages and no PCI
        /// device, for virtual devices; on a real NIC with hugepages drop --no-huge, -m and
        /// --no-pci (and give -a PCI_ADDRESS to probe only that NIC). EAL starts once per process:
        /// every DPDK endpoint of a process must use the same arguments. -h, --help and
        /// --log-level=help, which make EAL exit, are refused. Without -l, -c or --lcores, EAL's one
        /// lcore is the first core the process may run on (EAL pins only the thread that starts it,
        /// a thread of netagg's own that then ends).
        eal_args = "--no-huge --no-shconf -m 128 --no-pci --no-telemetry --log-level=lib.eal:warning".into(), Text;
        /// The device, probed once EAL runs: a virtual device's arguments
        /// (net_af_packet0,iface=eth0,qdisc_bypass=0 on a kernel interface; net_tap0) or a PCI
        /// address (0000:3b:00.0). Required.
        device = String::new(), Text;
        /// The endpoint's IPv4 address. 0.0.0.0: for a worker, the address its control connection
        /// leaves from (right where the DPDK port shares its interface with the kernel); for the
        /// switch, switch.data's address.
        ip = IpAddr::from([0, 0, 0, 0]), Ip;
        /// MAC address every frame is sent to (the peer's, or a router's); empty: each peer's own,
        /// asked by ARP and learned from its frames.
        peer_mac = None, Mac;
        /// Descriptors of the receive and transmit rings (the driver may round them).
        rx_descriptors = 1024, Integer { min: 64, max: 32768 };
        tx_descriptors = 1024, Integer { min: 64, max: 32768 };
        /// Mbufs in the port's pool, for both rings and every frame being built; best 2^n - 1.
        pool_size = 8191, Integer { min: 1023, max: 1 << 24 };
        /// Frames received or sent at a time.
        burst = 32, Integer { min: 1, max: 1024 };
        /// busy: poll the receive queue without pause (a core per polling thread, the lowest
        /// latency). adaptive: poll without pause while frames come, nap between polls once the
        /// queue has been idle for 100 microseconds (cores shared with other work, tests).
        poll = PollMode::Busy, Choice { choices: PollMode::NAMES, quoted: true };
    }
}

struct_keys! {
    RDMA_KEYS: Rdma {
        /// The verbs device (rxe0, mlx5_0). Empty: the device the route to the peer goes
        /// through, chosen by rdma_cm, with the address the route gives. Named: that device, at
        /// the address held by GID gid_index of port device_port; a connection rdma_cm routes
        /// through another device is refused.
        device = String::new(), Text;
        /// The device's port, from 1.
        device_port = 1, Integer { min: 1, max: 255 };
        /// With a named device, the GID whose address the endpoint takes. RoCE v2 needs the GID
        /// of the interface's IPv4 or IPv6 address: Soft-RoCE puts IPv4 at 1; list them with
        /// netagg-rdma-devices (or show_gids).
        gid_index = 1, Integer { min: 0, max: 1023 };
        /// Messages each queue pair keeps posted for receiving, and sends in flight at most;
        /// raised to twice a worker thread's window (its share of max_outstanding_packets)
        /// where that is more, so that no send waits for a receive to be posted.
        queue_depth = 512, Integer { min: 16, max: 65536 };
        /// Bytes of each registered receive and send buffer; 0: just what a packet of
        /// packet_numel elements needs. Smaller than a packet is refused at start.
        message_size = 0, Bytes { min: 0, max: Some(1 << 20) };
        /// busy: poll the completion queue without pause (the lowest latency, a core per polling
        /// thread). event: sleep on the completion channel until the device signals a completion
        /// (cores shared with other work).
        poll = RdmaPoll::Event, Choice { choices: RdmaPoll::NAMES, quoted: true };
    }
}

// The defaults are `Faults::default()`'s: nothing injected.
keys_at! {
    FAULT_KEYS: Faults {
        /// Probabilities from 0 to 1 that a datagram is lost, arrives twice, is held back and
        /// overtaken by later ones, or has one bit flipped; and the largest random delay added to
        /// every datagram, in milliseconds (0 to 10000). send_* act on the datagrams this process
        /// sends, receive_* on those it receives, before it reads them.
        send_drop at send.drop, Probability;
        send_duplicate at send.duplicate, Probability;
        send_reorder at send.reorder, Probability;
        send_corrupt at send.corrupt, Probability;
        send_delay at send.delay, Delay { unit: Milliseconds, max: MAX_FAULT_DELAY };
        receive_drop at receive.drop, Probability;
        receive_duplicate at receive.duplicate, Probability;
        receive_reorder at receive.reorder, Probability;
        receive_corrupt at receive.corrupt, Probability;
        receive_delay at receive.delay, Delay { unit: Milliseconds, max: MAX_FAULT_DELAY };
        /// Seed of the random choices, so that a run can be repeated.
        seed at seed, Integer { min: 0, max: u64::MAX };
        /// After this many datagrams received, the connection that carried the last one fails,
        /// once, as a failing device's would: an RDMA queue pair is moved to the error state
        /// (a worker counts per thread). 0: never. RDMA only: the other transports, which have
        /// no connection to fail, refuse it.
        sever_after at sever_after, Integer { min: 0, max: u64::MAX };
    }
}

struct_keys! {
    SWITCH_KEYS: Switch + faults + dpdk + rdma {
        /// TCP address workers register at, and UDP address of the data path.
        control = SocketAddr::from(([0, 0, 0, 0], 50099)), Address;
        data = SocketAddr::from(([0, 0, 0, 0], 48864)), Address;
        /// What the data path runs on: udp, a kernel socket at data; dpdk, a DPDK port
        /// ([switch.dpdk]) answering UDP at data's port; rdma, RDMA reliable connections accepted
        /// through rdma_cm at data's address and port ([switch.rdma]).
        transport = SwitchTransport::Udp, Choice { choices: SwitchTransport::NAMES, quoted: true };
        /// Data-path threads, each with a UDP socket of its own (thread i at data's port + i, or
        /// any free port when that is 0) and a contiguous share of every session's slots, which
        /// registration tells the workers. 1 suits a host that also runs workers; a switch host
        /// of its own may give it a core each up to its workers' threads. udp only.
        threads = 1, Integer { min: 1, max: 64 };
        /// A worker's data endpoint must be at the address its registration comes from, so that
        /// no one can aim a session's results at a third party; except inside these networks
        /// (comma-separated, 10.0.0.0/24,fd00::/64), for workers whose DPDK or RDMA NIC has an
        /// address of its own while they register over another. Empty: none.
        data_networks = Vec::new(), Networks;
        /// Control connections at once; more are refused as they arrive. Each holds a
        /// descriptor: netagg-switch raises its descriptor limit to the hard limit and lowers
        /// this to fit.
        max_connections = 1024, Integer { min: 1, max: 1 << 20 };
        /// Sessions open or assembling at once, workers in one session, slots in one session.
        max_sessions = 64, Integer { min: 1, max: 65535 };
        max_workers = 1024, Integer { min: 1, max: 65535 };
        max_slots = 8192, Integer { min: 1, max: 65535 };
        /// Bytes of aggregation state all sessions together may hold.
        max_memory = 1 << 30, Bytes { min: 1, max: None };
        /// Bytes of aggregation state one session may hold (a session of 4 workers, 256 slots of
        /// 256 elements and depth 8 holds about 4.4 MB); larger sessions are refused at
        /// registration with a message saying how many bytes they need.
        max_session_memory = 256 << 20, Bytes { min: 1, max: None };
        /// Seconds without packets after which a session is closed although its workers are
        /// connected; 0 never does. A worker whose connection closes ends its session at once.
        idle_timeout = Duration::ZERO,
            Timeout { unit: Seconds, zero: Some("never closes a session whose workers are connected") };
        /// Seconds a control connection may take to register, and its session to assemble
        /// after that; a registration still waiting for other ranks then is refused and closed.
        register_timeout = Duration::from_secs(60), Timeout { unit: Seconds, zero: None };
        /// The upper switch's control address (host:port) of an aggregation tree, for a switch
        /// that serves one rack of the workers: it sums its rack's contributions and takes part
        /// in the upper switch's session as one member, rack of racks, on switch.transport udp
        /// or dpdk. Empty: no upper switch.
        upstream = String::new(), Text;
        /// With upstream: the rack this switch serves, of racks. A world of N ranks is split
        /// into racks of contiguous ranks (rack r of R holds ranks ceil(r·N/R) to
        /// ceil((r+1)·N/R) − 1); workers register at their rack's switch with their rank and
        /// world size in the whole tree.
        rack = 0, Integer { min: 0, max: 65534 };
        racks = 1, Integer { min: 1, max: 65535 };
        /// Print counters every this many seconds; 0 prints them only on exit.
        stats_interval = Duration::ZERO, Timeout { unit: Seconds, zero: Some("prints only on exit") };
        /// error, warn, info, debug or trace (RUST_LOG overrides).
        log_level = "info".into(),
            Choice { choices: &["error", "warn", "info", "debug", "trace"], quoted: false };
        /// Serve the counters in Prometheus's text format over HTTP at this address
        /// (GET /metrics), for monitoring to scrape; empty serves none.
        metrics = None, OptionalAddress;
    }
}
