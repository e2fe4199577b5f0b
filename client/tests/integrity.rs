//! Corrupted datagrams, 1 % each way, over a switch process on 127.0.0.1 (UDP) and over
//! the dummy backend: int32 sums stay exact and float32 ones within rounding, dense and
//! sparse, because every packet ends in a checksum that each side checks, and a datagram
//! that fails it is dropped, counted as corrupt and recovered as a loss.

mod common;

use common::{contexts, counter, dummy_config, Switch};
use netagg::{Config, Context, SparseMode};
use rand::{Rng, SeedableRng};

/// Elements per job: about 400 packets of 256 elements, so that 1 % corrupts several.
const NUMEL: usize = 100_000;
const JOBS: usize = 3;

/// Rank `rank`'s tensor for `job`: random over every block (dense), or over the blocks of
/// 256 elements `b` with `(b + rank) % 4 == 0`, zero elsewhere (sparse).
fn tensor(rank: usize, job: usize, sparse: bool) -> Vec<f64> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((rank * 100 + job) as u64);
    (0..NUMEL)
        .map(|i| if sparse && (i / 256 + rank) % 4 != 0 { 0.0 } else { rng.gen_range(-1000.0..1000.0) })
        .collect()
}

/// Runs `JOBS` allreduces of int32 and of float32 on each context (one thread each), dense
/// or sparse; each rank's inputs are [`tensor`] of `rank_of(context index)`, and the
/// expected sums add those of `summed` ranks (a dummy context stands for every rank).
fn check_sums(contexts: &[Context], sparse: bool, rank_of: impl Fn(usize) -> Vec<usize> + Sync) {
    std::thread::scope(|scope| {
        for (index, context) in contexts.iter().enumerate() {
            let ranks = rank_of(index);
            let own = ranks[0];
            scope.spawn(move || {
                for job in 0..JOBS {
                    let terms: Vec<Vec<f64>> = ranks.iter().map(|&rank| tensor(rank, job, sparse)).collect();
                    let mut ints: Vec<i32> = tensor(own, job, sparse).iter().map(|&x| x as i32).collect();
                    context.allreduce(&mut ints).unwrap();
                    let mut floats: Vec<f32> = tensor(own, job, sparse).iter().map(|&x| x as f32).collect();
                    context.allreduce(&mut floats).unwrap();
                    for i in 0..NUMEL {
                        let exact: i32 = terms.iter().map(|t| t[i] as i32).sum();
                        assert_eq!(ints[i], exact, "rank {own}, job {job}, int32 element {i}");
                        let exact: f64 = terms.iter().map(|t| t[i] as f32 as f64).sum();
                        let magnitude: f64 = terms.iter().map(|t| (t[i] as f32 as f64).abs()).sum();
                        let bound = terms.len() as f64 * f32::EPSILON as f64 * magnitude;
                        let error = (floats[i] as f64 - exact).abs();
                        assert!(error <= bound, "rank {own}, job {job}, float32 element {i}: error {error}");
                    }
                }
            });
        }
    });
}

/// 1 % of the datagrams this worker sends corrupted, and with `both_ways` of those it
/// receives too; the sparse mode asked for.
fn corrupting(config: &mut Config, rank: u16, both_ways: bool, sparse: bool) {
    config.faults.send.corrupt = 0.01;
    if both_ways {
        config.faults.receive.corrupt = 0.01;
    }
    config.faults.seed = 40 + u64::from(rank);
    config.general.sparse = if sparse { SparseMode::Auto } else { SparseMode::Off };
    // Loopback round trips take microseconds: a 2 ms floor recovers a loss quickly.
    config.general.timeout = std::time::Duration::from_millis(2);
}

#[test]
fn sums_through_a_switch_survive_1_percent_corruption_each_way_dense_and_sparse() {
    for sparse in [false, true] {
        // The switch corrupts 1 % of its results; each worker 1 % of its contributions.
        let switch = Switch::start(&["--faults", "send_corrupt=0.01,seed=9"]);
        let contexts = contexts(&switch, 3, |config| {
            let rank = config.general.rank;
            corrupting(config, rank, false, sparse);
        });
        check_sums(&contexts, sparse, |rank| std::iter::once(rank).chain(others(rank)).collect());
        let corrupt: u64 = contexts.into_iter().map(|context| context.stop().total().corrupt).sum();
        let stats = switch.stop();
        let engine = stats.lines().find(|l| l.starts_with("stats: datagrams")).unwrap();
        assert!(counter(engine, "corrupt") > 10, "sparse {sparse}: {engine}");
        assert!(corrupt > 10, "sparse {sparse}: the workers dropped {corrupt} corrupt results");
    }
}

/// The ranks of a 3-rank session other than `rank`.
fn others(rank: usize) -> impl Iterator<Item = usize> {
    (0..3).filter(move |&other| other != rank)
}

#[test]
fn sums_on_the_dummy_backend_survive_1_percent_corruption_each_way_dense_and_sparse() {
    for sparse in [false, true] {
        let mut config = dummy_config(3);
        corrupting(&mut config, 0, true, sparse);
        let context = Context::start(config).unwrap();
        // The dummy backend sums as if every rank held this one's tensor.
        check_sums(std::slice::from_ref(&context), sparse, |_| vec![0, 0, 0]);
        let corrupt = context.stop().total().corrupt;
        assert!(corrupt > 10, "sparse {sparse}: {corrupt} corrupt results dropped");
    }
}
