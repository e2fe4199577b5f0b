//! Runs allreduces through the in-memory cluster and prints what they cost.
//!
//! `cargo run --release -p netagg-aggregator --example simulate -- [workers] [elements]
//! [loss rate] [density]`: every worker sums int32 tensors (sparse ones when density < 1)
//! through the engine over links that lose, duplicate and reorder `loss rate` of packets.

use std::process::ExitCode;
use std::time::Instant;

use netagg_aggregator::sim::{Cluster, ClusterConfig, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |index: usize, default: f64| -> Result<f64, String> {
        match args.get(index) {
            None => Ok(default),
            Some(text) => {
                text.parse().map_err(|_| format!("argument {}: '{text}' is not a number", index + 1))
            }
        }
    };
    let parsed = (|| {
        Ok::<_, String>((arg(0, 4.0)? as u16, arg(1, 1_000_000.0)? as usize, arg(2, 0.01)?, arg(3, 1.0)?))
    })();
    let (workers, elements, loss, density) = match parsed {
        Ok(values) => values,
        Err(message) => {
            eprintln!("{message}\nusage: simulate [workers] [elements] [loss rate] [density]");
            return ExitCode::from(2);
        }
    };
    if workers == 0 || !(0.0..=1.0).contains(&loss) || !(0.0..=1.0).contains(&density) {
        eprintln!("workers must be at least 1, loss rate and density between 0 and 1");
        return ExitCode::from(2);
    }

    let packet_elements = 256u16;
    let mut config = ClusterConfig::new(workers, 64, packet_elements).with_faults(loss);
    config.depth = 8;
    let mut cluster = match Cluster::new(config) {
        Ok(cluster) => cluster,
        Err(error) => {
            eprintln!("cannot open the session: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let inputs: Vec<Tensor> = (0..workers)
        .map(|_| {
            let mut values = vec![0i32; elements];
            for block in values.chunks_mut(packet_elements as usize) {
                if rng.gen_bool(density) {
                    block.iter_mut().for_each(|v| *v = rng.gen_range(-1_000_000..1_000_000));
                }
            }
            Tensor::Int32(values)
        })
        .collect();
    let mut expected = vec![0i32; elements];
    for input in &inputs {
        let Tensor::Int32(values) = input else { unreachable!("int32 inputs") };
        expected.iter_mut().zip(values).for_each(|(e, v)| *e = e.wrapping_add(*v));
    }

    println!(
        "netagg simulation: {workers} workers, {elements} int32 elements, {} per packet, loss/dup/reorder {:.1}%, block density {:.0}%",
        packet_elements,
        loss * 100.0,
        density * 100.0
    );
    let started = Instant::now();
    let report = match cluster.allreduce(&inputs, density < 1.0) {
        Ok(report) => report,
        Err(error) => {
            eprintln!("allreduce failed: {error}");
            return ExitCode::FAILURE;
        }
    };
    let wall = started.elapsed();
    let exact = report.outputs.iter().all(|output| *output == Tensor::Int32(expected.clone()));
    for (rank, counters) in report.workers.iter().enumerate() {
        println!(
            "worker {rank}: sent {} data + {} acks ({} retransmitted, {} probes), received {} results ({} duplicates)",
            counters.data_sent,
            counters.acks_sent,
            counters.retransmissions,
            counters.probes,
            counters.results_received,
            counters.duplicates
        );
    }
    let switch = report.switch;
    println!(
        "switch: {} packets in, {} results broadcast, {} resent, {} duplicates, {} stalled",
        switch.packets_in, switch.results_broadcast, switch.results_resent, switch.duplicates, switch.stalled
    );
    println!(
        "virtual time {:?}, simulated in {:?} of wall time, results {}",
        report.elapsed,
        wall,
        if exact { "exact on every worker" } else { "WRONG" }
    );
    if exact {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
