//! Property test: any cluster shape, packet size, window, density and loss rate gives the
//! exact int32 sum on every worker, without livelock.

use std::time::Duration;

use netagg_aggregator::sim::{Cluster, ClusterConfig, RunReport, Tensor};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone)]
struct Case {
    workers: u16,
    slots: u16,
    packet_elements: u16,
    depth: u8,
    len: usize,
    density: f64,
    sparse: bool,
    loss: f64,
    seed: u64,
}

fn cases() -> impl Strategy<Value = Case> {
    (
        1u16..=6,
        1u16..=16,
        1u16..=64,
        prop::sample::select(vec![2u8, 4, 8, 16]),
        0usize..3000,
        0.0f64..=1.0,
        any::<bool>(),
        prop::sample::select(vec![0.0, 0.01, 0.05, 0.15]),
        any::<u64>(),
    )
        .prop_map(|(workers, slots, packet_elements, depth, len, density, sparse, loss, seed)| Case {
            workers,
            slots,
            packet_elements,
            depth,
            len,
            density,
            sparse,
            loss,
            seed,
        })
}

fn inputs(case: &Case) -> Vec<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    (0..case.workers)
        .map(|_| {
            let mut values = vec![0i32; case.len];
            for block in values.chunks_mut(case.packet_elements as usize) {
                if rng.gen_bool(case.density) {
                    block.iter_mut().for_each(|v| *v = rng.gen());
                }
            }
            Tensor::Int32(values)
        })
        .collect()
}

/// Runs two jobs of `case` on one cluster (the second starts from the rounds the first left
/// behind), checking every worker's result against the exact sum; returns their reports.
fn run_twice(case: &Case) -> Result<Vec<RunReport>, TestCaseError> {
    let mut config =
        ClusterConfig::new(case.workers, case.slots, case.packet_elements).with_faults(case.loss);
    config.depth = case.depth;
    config.seed = case.seed;
    config.max_steps = 2_000_000;
    let mut cluster = Cluster::new(config).unwrap();
    let inputs = inputs(case);
    let mut expected = vec![0i32; case.len];
    for input in &inputs {
        let Tensor::Int32(values) = input else { unreachable!("int32 inputs") };
        expected.iter_mut().zip(values).for_each(|(e, v)| *e = e.wrapping_add(*v));
    }
    let mut reports = Vec::new();
    for _ in 0..2 {
        let report = cluster.allreduce(&inputs, case.sparse).unwrap();
        for output in &report.outputs {
            prop_assert_eq!(output, &Tensor::Int32(expected.clone()));
        }
        reports.push(report);
    }
    Ok(reports)
}

/// A case this property test found: at 15 % loss each way, a worker's pacer cut its rate
/// for the share of sendings lost judgment after judgment, down to the floor of 8 kB/s,
/// since the share, sampled over 64 sendings, seldom failed to fall twice in a row; the
/// second job took 11.8 s of virtual time (0.7 s unpaced) and ran out of its 2 million
/// steps. Unpaced after three cuts in a row, it took 1.5 s, and later 6.5 s: the rounds'
/// waits on the peers' loss recovery engaged it again and again. An unpaced worker that
/// loses more than the pacer tolerates is not engaged by its peers' waits: 0.77 and 0.78 s.
/// Since a sparse job's contributing slots take a later result as evidence of their loss
/// only while their path is seen losing, 0.95 and 1.48 s: at this loss nearly always, and
/// the case's course changes with the few waits that were not; over seeds 1-12 of its
/// shape, two jobs each, 19.8 s in all against 18.9 s before, the slowest 1.93 s in both
/// (benches/RESULTS.md, "Sparse time follows bytes at N = 4 (issue 29, item 3, branch
/// sparse6): false losses traced"). The bound is the floor rate's, not the case's noise.
#[test]
fn random_loss_does_not_pace_a_sparse_cluster_down_to_the_floor_rate() {
    let case = Case {
        workers: 6,
        slots: 12,
        packet_elements: 1,
        depth: 2,
        len: 1781,
        density: 0.8474677504482403,
        sparse: true,
        loss: 0.15,
        seed: 15579271367883118994,
    };
    let reports = run_twice(&case).unwrap();
    let elapsed: Vec<_> = reports.iter().map(|report| report.elapsed).collect();
    assert!(elapsed.iter().all(|&elapsed| elapsed < Duration::from_secs(2)), "{elapsed:?}");
}

proptest! {
    // A failure here is most often a livelock, which runs to the simulator's 2 million
    // steps, about 20 s a job in a debug build. Shrinking it without a bound (proptest's
    // default) reran such cases for many minutes before reporting: a stand-in failure
    // took 91 shrinking runs. 16 still simplify a case much, and report a livelock
    // within about five minutes.
    #![proptest_config(ProptestConfig { cases: 96, max_shrink_iters: 16, ..ProptestConfig::default() })]

    #[test]
    fn every_worker_gets_the_exact_sum(case in cases()) {
        run_twice(&case)?;
    }
}
