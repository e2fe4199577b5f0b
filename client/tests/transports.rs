//! Contexts over transports of the caller's own: whole sessions through a switch whose
//! data path, and whose workers' transports, are a network in memory; and what a worker
//! says to a switch of another control protocol version.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use common::{unique_session, worker_config};
use netagg::backend::{DataPaths, SwitchTransport, Transport};
use netagg::{Config, Context, Endpoint, Error};
use netagg_switch::port::{MemoryNetwork, MemorySocket};
use netagg_switch::Switch;
use netagg_wire::{ControlMessage, RejectCode, CONTROL_VERSION};

/// A worker thread's transport over a socket of a [`MemoryNetwork`].
struct MemoryTransport {
    socket: MemorySocket,
    switch: Option<SocketAddr>,
    outgoing: Vec<u8>,
}

impl Transport for MemoryTransport {
    fn send_buffer(&mut self, len: usize) -> &mut [u8] {
        self.outgoing.resize(len.max(self.outgoing.len()), 0);
        &mut self.outgoing
    }

    fn send(&mut self, len: usize) -> std::io::Result<()> {
        let switch = self.switch.expect("connected at registration");
        self.socket.send_to(switch, &self.outgoing[..len]);
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn recv(&mut self, timeout: Duration, sink: &mut dyn FnMut(&[u8])) -> std::io::Result<usize> {
        Ok(self.socket.recv(timeout, |_, datagram| sink(datagram)))
    }
}

impl SwitchTransport for MemoryTransport {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Udp(self.socket.local_addr())
    }

    fn connect(&mut self, paths: &DataPaths) -> std::io::Result<()> {
        let (endpoint, control) = paths.single("memory")?;
        self.switch = endpoint.udp_address(control.switch);
        Ok(())
    }
}

/// Starts `workers` contexts over memory transports of `network`, one thread each.
fn contexts(
    network: &MemoryNetwork,
    switch: &Switch,
    workers: u16,
    adjust: impl Fn(&mut Config),
) -> Vec<Context> {
    let session = unique_session("memory");
    let starting: Vec<_> = (0..workers)
        .map(|rank| {
            let mut config = worker_config(switch.control_addr(), rank, workers, &session);
            config.general.num_worker_threads = 2;
            adjust(&mut config);
            let transports = (0..config.general.num_worker_threads)
                .map(|_| {
                    let socket = network.bind("127.0.0.1:0".parse().unwrap()).unwrap();
                    Box::new(MemoryTransport { socket, switch: None, outgoing: Vec::new() })
                        as Box<dyn SwitchTransport>
                })
                .collect();
            std::thread::spawn(move || Context::start_with_transports(config, transports))
        })
        .collect();
    starting.into_iter().map(|start| start.join().unwrap().expect("the context starts")).collect()
}

fn memory_switch(network: &MemoryNetwork) -> Switch {
    let mut settings = netagg_config::Config::default().switch;
    settings.control = "127.0.0.1:0".parse().unwrap();
    let port = network.bind("127.0.0.1:48864".parse().unwrap()).unwrap();
    Switch::start_with_port(&settings, port).unwrap()
}

#[test]
fn allreduces_over_memory_transports_are_exact_dense_and_sparse() {
    let network = MemoryNetwork::new();
    let switch = memory_switch(&network);
    for sparse in [netagg::SparseMode::Off, netagg::SparseMode::Auto] {
        let contexts = contexts(&network, &switch, 3, |config| config.general.sparse = sparse);
        let numel: usize = 1_000_003;
        let outcomes: Vec<Vec<i32>> = std::thread::scope(|scope| {
            let jobs: Vec<_> = (0..)
                .zip(&contexts)
                .map(|(rank, context)| {
                    scope.spawn(move || {
                        // Every third block of 256 is zero on every rank: sparse skips it.
                        let mut data: Vec<i32> = (0..numel as i32)
                            .map(|i| if (i / 256) % 3 == 0 { 0 } else { i % 1000 + rank })
                            .collect();
                        context.allreduce(&mut data).unwrap();
                        data
                    })
                })
                .collect();
            jobs.into_iter().map(|job| job.join().unwrap()).collect()
        });
        let expected: Vec<i32> =
            (0..numel as i32).map(|i| if (i / 256) % 3 == 0 { 0 } else { 3 * (i % 1000) + 3 }).collect();
        for sums in outcomes {
            assert!(sums == expected, "sparse = {sparse:?}: a sum differs");
        }
        // A dense job sends every block once (and again only on a timeout); a sparse one
        // the two thirds that are not zero, and an empty packet to start each slot whose
        // first block is zero.
        let blocks = numel.div_ceil(256) as u64;
        for context in &contexts {
            let threads = context.stats().threads;
            let fresh = threads.iter().map(|thread| thread.data_sent - thread.retransmissions).sum::<u64>();
            if sparse == netagg::SparseMode::Auto {
                assert!(fresh < blocks * 8 / 10, "{fresh} packets sent for {blocks} blocks, a third zero");
            } else {
                assert_eq!(fresh, blocks, "every block sent once");
            }
        }
    }
    assert_eq!(switch.counters().unwrap().engine.sessions_opened, 2);
}

#[test]
fn float32_over_memory_transports_is_within_the_encoding_s_bound() {
    let network = MemoryNetwork::new();
    let switch = memory_switch(&network);
    let contexts = contexts(&network, &switch, 2, |_| {});
    let numel = 10_000;
    let results: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let jobs: Vec<_> = (0..)
            .zip(&contexts)
            .map(|(rank, context)| {
                scope.spawn(move || {
                    let input: Vec<f32> = (0..numel).map(|i| (i as f32 * 0.37).sin() + rank as f32).collect();
                    let mut output = vec![0f32; numel];
                    context.allreduce_into(&input, &mut output).unwrap();
                    output
                })
            })
            .collect();
        jobs.into_iter().map(|job| job.join().unwrap()).collect()
    });
    for result in results {
        for (i, sum) in result.iter().enumerate() {
            let expected = 2.0 * (i as f32 * 0.37).sin() + 1.0;
            assert!((sum - expected).abs() <= 1e-5 * 4.0, "element {i}: {sum} against {expected}");
        }
    }
}

#[test]
fn a_transport_count_that_differs_from_the_threads_is_a_config_error() {
    let mut config = Config::default();
    config.general.num_worker_threads = 2;
    let error = Context::start_with_transports(config, Vec::new()).err().unwrap();
    assert_eq!(error, Error::InvalidConfig("0 transports for general.num_worker_threads = 2".into()));
}

#[test]
fn a_switch_of_the_previous_control_version_is_named_as_such() {
    // A switch of the previous control protocol version: it refuses this version's
    // register with its own version's reject, as such a switch does.
    let (ours, old) = (CONTROL_VERSION, CONTROL_VERSION - 1);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let control = listener.local_addr().unwrap();
    let old_switch = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut header = [0u8; 8];
        stream.read_exact(&mut header).unwrap();
        assert_eq!(header[0], ours, "the library speaks version {ours}");
        let message = format!("protocol version {ours} is not supported (this side speaks {old})");
        let message = message.as_bytes();
        let mut reject = vec![old, 3];
        reject.extend_from_slice(&(4 + message.len() as u16).to_le_bytes());
        reject.extend_from_slice(&[0; 4]);
        reject.extend_from_slice(&(RejectCode::Version as u16).to_le_bytes());
        reject.extend_from_slice(&(message.len() as u16).to_le_bytes());
        reject.extend_from_slice(message);
        stream.write_all(&reject).unwrap();
    });
    let mut config = worker_config(control, 0, 1, "old");
    config.general.backend = netagg::BackendKind::Udp;
    let error = Context::start(config).err().unwrap();
    old_switch.join().unwrap();
    assert_eq!(
        error.to_string(),
        format!(
            "the switch at {control} speaks control protocol version {old}, this library version {ours}: use a \
             switch and a library of the same release"
        )
    );
    // What the switch sent is read as nothing else.
    assert!(ControlMessage::parse(&[3, 3, 0, 0, 0, 0, 0, 0]).is_err());
}
