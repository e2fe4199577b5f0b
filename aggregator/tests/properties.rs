//! Property test: any cluster shape, packet size, window, density and loss rate gives the
//! exact int32 sum on every worker, without livelock.

use netagg_aggregator::sim::{Cluster, ClusterConfig, Tensor};
use proptest::prelude::*;
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_worker_gets_the_exact_sum(case in cases()) {
        let mut config = ClusterConfig::new(case.workers, case.slots, case.packet_elements).with_faults(case.loss);
        config.depth = case.depth;
        config.seed = case.seed;
        config.max_steps = 2_000_000;
        let mut cluster = Cluster::new(config).unwrap();
        let inputs = inputs(&case);
        let mut expected = vec![0i32; case.len];
        for input in &inputs {
            let Tensor::Int32(values) = input else { unreachable!("int32 inputs") };
            expected.iter_mut().zip(values).for_each(|(e, v)| *e = e.wrapping_add(*v));
        }
        // Two jobs, so the second starts from the rounds the first left behind.
        for _ in 0..2 {
            let report = cluster.allreduce(&inputs, case.sparse).unwrap();
            for output in &report.outputs {
                prop_assert_eq!(output, &Tensor::Int32(expected.clone()));
            }
        }
    }
}
