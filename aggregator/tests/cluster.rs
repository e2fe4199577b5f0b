//! Whole allreduces through the in-memory cluster: results, packet counts, completion,
//! over perfect and faulty links.

use std::time::Duration;

use netagg_aggregator::sim::{Cluster, ClusterConfig, LinkFaults, SimError, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn int32_inputs(workers: u16, len: usize, seed: u64) -> Vec<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..workers).map(|_| Tensor::Int32((0..len).map(|_| rng.gen()).collect())).collect()
}

fn float32_inputs(workers: u16, len: usize, seed: u64) -> Vec<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..workers).map(|_| Tensor::Float32((0..len).map(|_| rng.gen_range(-1e3..1e3)).collect())).collect()
}

/// int32 tensors whose blocks are non-zero with probability `density`, each worker placing
/// its non-zero blocks independently.
fn sparse_inputs(workers: u16, len: usize, block: usize, density: f64, seed: u64) -> Vec<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..workers)
        .map(|_| {
            let mut values = vec![0i32; len];
            for chunk in values.chunks_mut(block) {
                if rng.gen_bool(density) {
                    chunk.iter_mut().for_each(|v| *v = rng.gen_range(-1000..1000) | 1);
                }
            }
            Tensor::Int32(values)
        })
        .collect()
}

fn exact_sum(inputs: &[Tensor]) -> Vec<i32> {
    let mut sum = vec![0i32; inputs[0].len()];
    for input in inputs {
        let Tensor::Int32(values) = input else { panic!("int32 inputs expected") };
        sum.iter_mut().zip(values).for_each(|(s, v)| *s = s.wrapping_add(*v));
    }
    sum
}

fn assert_int32_results(outputs: &[Tensor], inputs: &[Tensor]) {
    let expected = exact_sum(inputs);
    for (rank, output) in outputs.iter().enumerate() {
        let Tensor::Int32(values) = output else { panic!("int32 output expected") };
        if let Some(i) = values.iter().zip(&expected).position(|(a, b)| a != b) {
            panic!("rank {rank}, element {i}: got {} expected {}", values[i], expected[i]);
        }
    }
}

fn assert_float32_results(outputs: &[Tensor], inputs: &[Tensor]) {
    let len = inputs[0].len();
    for i in 0..len {
        let terms: Vec<f64> = inputs
            .iter()
            .map(|t| match t {
                Tensor::Float32(v) => v[i] as f64,
                _ => unreachable!(),
            })
            .collect();
        let exact: f64 = terms.iter().sum();
        let magnitude: f64 = terms.iter().map(|t| t.abs()).sum();
        // Summation in any order stays within n·ε·Σ|x| of the exact sum.
        let bound = terms.len() as f64 * f32::EPSILON as f64 * magnitude + f32::MIN_POSITIVE as f64;
        for (rank, output) in outputs.iter().enumerate() {
            let Tensor::Float32(values) = output else { panic!("float32 output expected") };
            let error = (values[i] as f64 - exact).abs();
            assert!(
                error <= bound,
                "rank {rank}, element {i}: got {} expected {exact} (error {error} > {bound})",
                values[i]
            );
        }
    }
}

#[test]
fn dense_int32_sums_are_exact_for_every_size_and_cluster() {
    for workers in [2u16, 3, 8] {
        for packet in [64u16, 256, 1024] {
            let mut cluster = Cluster::new(ClusterConfig::new(workers, 8, packet)).unwrap();
            let p = packet as usize;
            for len in [0, 1, p - 1, p, p + 1, 8 * p + 3, 20 * p] {
                let inputs = int32_inputs(workers, len, len as u64);
                let report = cluster.allreduce(&inputs, false).unwrap();
                assert_int32_results(&report.outputs, &inputs);
                let blocks = len.div_ceil(p) as u64;
                for counters in &report.workers {
                    assert_eq!(counters.data_sent, blocks, "one packet per block on a perfect link");
                    assert_eq!(counters.results_received, blocks);
                    // A 48-byte header and a 4-byte checksum per packet, and every element
                    // once each way.
                    assert_eq!(counters.bytes_sent, blocks * (48 + 4) + len as u64 * 4);
                    assert_eq!(counters.bytes_received, counters.bytes_sent);
                    assert_eq!((counters.retransmissions, counters.acks_sent), (0, 0));
                }
                assert_eq!(report.switch.results_broadcast, blocks);
            }
        }
    }
}

#[test]
fn dense_float32_sums_stay_within_rounding_of_the_exact_sum() {
    let mut cluster = Cluster::new(ClusterConfig::new(4, 16, 256)).unwrap();
    let inputs = float32_inputs(4, 10_000, 7);
    let report = cluster.allreduce(&inputs, false).unwrap();
    assert_float32_results(&report.outputs, &inputs);
}

#[test]
fn window_bounds_the_packets_in_flight() {
    // With one slot the allreduce is a sequence of round trips: 20 blocks take 20 of them.
    let mut config = ClusterConfig::new(2, 1, 64);
    config.uplink = LinkFaults::perfect(Duration::from_micros(100));
    config.downlink = LinkFaults::perfect(Duration::from_micros(100));
    let mut cluster = Cluster::new(config.clone()).unwrap();
    let report = cluster.allreduce(&int32_inputs(2, 20 * 64, 1), false).unwrap();
    assert_eq!(report.elapsed, Duration::from_micros(200) * 20);
    config.slots = 20;
    let mut cluster = Cluster::new(config).unwrap();
    let report = cluster.allreduce(&int32_inputs(2, 20 * 64, 1), false).unwrap();
    assert_eq!(report.elapsed, Duration::from_micros(200));
}

#[test]
fn dense_jobs_survive_loss_duplication_and_reordering() {
    for (rate, seed) in [(0.01, 1), (0.05, 2), (0.2, 3)] {
        let mut config = ClusterConfig::new(4, 16, 64).with_faults(rate);
        config.seed = seed;
        let mut cluster = Cluster::new(config).unwrap();
        let mut retransmissions = 0;
        for job in 0..5 {
            let inputs = int32_inputs(4, 64 * 50 + job, seed * 100 + job as u64);
            let report = cluster.allreduce(&inputs, false).unwrap();
            assert_int32_results(&report.outputs, &inputs);
            retransmissions += report.workers.iter().map(|c| c.retransmissions).sum::<u64>();
        }
        assert!(retransmissions > 0, "rate {rate}: losses must have caused retransmissions");
    }
}

#[test]
fn block_exponents_are_agreed_one_round_ahead_at_the_cost_of_one_packet() {
    for (rate, seed) in [(0.0, 1), (0.05, 2)] {
        let (workers, slots, packet) = (3u16, 4u16, 16u16);
        let mut config = ClusterConfig::new(workers, slots, packet).with_faults(rate);
        config.seed = seed;
        let mut cluster = Cluster::new(config).unwrap();
        for len in [1usize, 16 * 3, 16 * 4, 16 * 37 + 5] {
            let inputs = int32_inputs(workers, len, len as u64 + seed);
            let report = cluster.allreduce_with_exponents(&inputs).unwrap();
            assert_int32_results(&report.outputs, &inputs);
            // Every block was encoded and decoded with the largest of the workers'
            // exponents for it, the same on every worker.
            for (block, start) in (0..len).step_by(16).enumerate() {
                let end = (start + 16).min(len);
                let bits = |t: &Tensor| match t {
                    Tensor::Int32(v) => {
                        v[start..end].iter().map(|x| 32 - x.unsigned_abs().leading_zeros()).max().unwrap()
                            as i8
                    }
                    _ => unreachable!(),
                };
                let own: i8 = inputs.iter().map(bits).max().unwrap();
                // The first window shares one exponent: the largest over its blocks.
                let expected = if block < slots as usize {
                    (0..slots as usize)
                        .filter(|b| b * 16 < len)
                        .map(|b| {
                            let (s, e) = (b * 16, (b * 16 + 16).min(len));
                            inputs
                                .iter()
                                .map(|t| match t {
                                    Tensor::Int32(v) => v[s..e]
                                        .iter()
                                        .map(|x| 32 - x.unsigned_abs().leading_zeros())
                                        .max()
                                        .unwrap()
                                        as i8,
                                    _ => unreachable!(),
                                })
                                .max()
                                .unwrap()
                        })
                        .max()
                        .unwrap()
                } else {
                    own
                };
                for exponents in &report.block_exponents {
                    assert_eq!(exponents[block], Some(expected), "block {block} of {len}");
                }
            }
            if rate == 0.0 {
                let blocks = len.div_ceil(16) as u64;
                for counters in &report.workers {
                    assert_eq!(
                        counters.data_sent,
                        blocks + 1,
                        "one exponent round, then one packet per block"
                    );
                }
            }
        }
    }
}

#[test]
fn sparse_jobs_send_only_non_zero_blocks() {
    let (workers, slots, packet) = (4u16, 8u16, 64u16);
    let blocks = 400usize;
    let len = blocks * packet as usize - 5;
    for density in [1.0, 0.1, 0.01, 0.0] {
        let mut cluster = Cluster::new(ClusterConfig::new(workers, slots, packet)).unwrap();
        let inputs = sparse_inputs(workers, len, packet as usize, density, (density * 1000.0) as u64);
        let report = cluster.allreduce(&inputs, true).unwrap();
        assert_int32_results(&report.outputs, &inputs);
        for (input, counters) in inputs.iter().zip(&report.workers) {
            let Tensor::Int32(values) = input else { unreachable!() };
            let nonzero: Vec<bool> =
                values.chunks(packet as usize).map(|c| c.iter().any(|&v| v != 0)).collect();
            let nonzero_count = nonzero.iter().filter(|&&b| b).count() as u64;
            let zero_starts = nonzero[..slots as usize].iter().filter(|&&b| !b).count() as u64;
            // Every non-zero block once, plus one empty report per stream whose first
            // block is zero.
            assert_eq!(counters.data_sent, nonzero_count + zero_starts, "density {density}");
            // Acknowledgements of the rounds others contribute to come in batches of
            // depth / 2 = 4 results at most.
            assert!(counters.acks_sent <= counters.results_received / 4 + slots as u64, "density {density}");
            assert_eq!((counters.retransmissions, counters.timeouts), (0, 0), "density {density}");
        }
        assert_eq!(report.switch.stalled, 0, "batched acks free every set in time");
        if density == 0.0 {
            assert_eq!(report.switch.results_broadcast, slots as u64, "one empty round per stream");
        }
    }
}

#[test]
fn sparse_results_are_exact_wherever_the_zero_blocks_lie() {
    let packet = 16usize;
    let blocks = 64usize;
    // Same placement on every worker, disjoint placements, and a tensor zero on all but one.
    let same: Vec<Tensor> = (0..3)
        .map(|w| {
            Tensor::Int32(
                (0..blocks * packet).map(|i| if (i / packet) % 5 == 0 { w + 1 } else { 0 }).collect(),
            )
        })
        .collect();
    let disjoint: Vec<Tensor> = (0..3)
        .map(|w| {
            Tensor::Int32(
                (0..blocks * packet)
                    .map(|i| if (i / packet) % 3 == w as usize { i as i32 } else { 0 })
                    .collect(),
            )
        })
        .collect();
    let lonely: Vec<Tensor> = (0..3)
        .map(|w| {
            Tensor::Int32((0..blocks * packet).map(|i| if w == 2 && i % 97 == 0 { -7 } else { 0 }).collect())
        })
        .collect();
    for inputs in [same, disjoint, lonely] {
        for slots in [1u16, 4, 64, 100] {
            let mut cluster = Cluster::new(ClusterConfig::new(3, slots, packet as u16)).unwrap();
            let report = cluster.allreduce(&inputs, true).unwrap();
            assert_int32_results(&report.outputs, &inputs);
        }
    }
}

#[test]
fn sparse_float32_sums_stay_within_rounding() {
    let mut cluster = Cluster::new(ClusterConfig::new(3, 8, 64)).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let inputs: Vec<Tensor> = (0..3)
        .map(|_| {
            Tensor::Float32(
                (0..64 * 100)
                    .map(|i| if (i / 64) % 7 == 0 { rng.gen_range(-1.0..1.0) } else { 0.0 })
                    .collect(),
            )
        })
        .collect();
    let report = cluster.allreduce(&inputs, true).unwrap();
    assert_float32_results(&report.outputs, &inputs);
}

#[test]
fn sparse_jobs_survive_loss_duplication_and_reordering() {
    for (rate, depth, seed) in [(0.01, 2u8, 11), (0.05, 8, 12), (0.1, 4, 13), (0.2, 16, 14)] {
        let mut config = ClusterConfig::new(4, 8, 32).with_faults(rate);
        config.depth = depth;
        config.seed = seed;
        let mut cluster = Cluster::new(config).unwrap();
        for (job, density) in [0.5, 0.1, 0.02, 0.0, 1.0].into_iter().enumerate() {
            let inputs = sparse_inputs(4, 32 * 300, 32, density, seed * 10 + job as u64);
            let report = cluster.allreduce(&inputs, true).unwrap();
            assert_int32_results(&report.outputs, &inputs);
        }
    }
}

#[test]
fn dense_and_sparse_jobs_interleave_on_the_same_slots() {
    let mut cluster = Cluster::new(ClusterConfig::new(3, 4, 64).with_faults(0.02)).unwrap();
    for job in 0..12u64 {
        let sparse = job % 2 == 1;
        let inputs = if sparse {
            sparse_inputs(3, 64 * 37, 64, 0.3, job)
        } else {
            int32_inputs(3, 64 * 9 + job as usize, job)
        };
        let report = cluster.allreduce(&inputs, sparse).unwrap();
        assert_int32_results(&report.outputs, &inputs);
    }
}

#[test]
fn a_dead_switch_fails_the_job_within_the_timeout() {
    let mut config = ClusterConfig::new(2, 4, 64);
    config.uplink.drop = 1.0;
    config.job_timeout = Duration::from_millis(50);
    let mut cluster = Cluster::new(config).unwrap();
    let error = cluster.allreduce(&int32_inputs(2, 1000, 1), false).unwrap_err();
    let SimError::Failed { reason, .. } = error else { panic!("expected a failure, got {error:?}") };
    assert!(reason.contains("no progress for 50ms"), "{reason}");
    // The session's rounds are now out of step; the worker refuses to go on silently.
    let error = cluster.allreduce(&int32_inputs(2, 1000, 1), false).unwrap_err();
    assert!(matches!(error, SimError::Failed { reason, .. } if reason.contains("open a new session")));
}

#[test]
fn sparse_allreduces_of_1m_int32_across_4_workers_stay_exact_with_1_and_5_percent_loss() {
    // The process-level loss test (client/tests/faults.rs) is dense: the library sends
    // dense jobs. Sparse streams meet the same loss here, on the same fault injector.
    for (rate, seed) in [(0.01, 21), (0.05, 22)] {
        let mut config = ClusterConfig::new(4, 64, 256).with_faults(rate);
        config.seed = seed;
        let mut cluster = Cluster::new(config).unwrap();
        for job in 0..3 {
            let inputs = sparse_inputs(4, 1 << 20, 256, 0.05, seed * 10 + job);
            let report = cluster.allreduce(&inputs, true).unwrap();
            assert_int32_results(&report.outputs, &inputs);
            let resent: u64 = report.workers.iter().map(|w| w.retransmissions).sum();
            assert!(resent > 0, "loss {rate}: nothing was lost");
        }
    }
}

/// Every worker's packets, and the switch's duplicates, when the last rank starts each of
/// three jobs `late` after the others, against the same jobs with every rank on time.
fn late_rank_costs(workers: u16, sparse: bool, late: Duration) -> Vec<(u64, u64)> {
    let config = ClusterConfig::new(workers, 16, 64);
    let inputs = if sparse {
        sparse_inputs(workers, 64 * 16 * 10, 64, 0.3, workers as u64)
    } else {
        int32_inputs(workers, 64 * 16 * 10, workers as u64)
    };
    let mut on_time = Cluster::new(config.clone()).unwrap();
    let mut delays = vec![Duration::ZERO; workers as usize];
    delays[workers as usize - 1] = late;
    let mut straggling = Cluster::new(ClusterConfig { start_delays: delays, ..config }).unwrap();
    let mut costs = vec![(0, 0); workers as usize];
    for job in 0..3 {
        let expected = on_time.allreduce(&inputs, sparse).unwrap();
        let report = straggling.allreduce(&inputs, sparse).unwrap();
        assert_int32_results(&report.outputs, &inputs);
        assert!(report.elapsed >= late, "job {job} waited for the late rank");
        assert_eq!(report.switch.duplicates, 0, "job {job}: nothing was contributed twice");
        for (rank, (late, on_time)) in report.workers.iter().zip(&expected.workers).enumerate() {
            assert_eq!(late.retransmissions, 0, "{workers} workers, rank {rank}, job {job}");
            assert_eq!(late.data_sent, on_time.data_sent);
            costs[rank].0 += late.packets_sent - on_time.packets_sent;
            costs[rank].1 += late.probes;
        }
    }
    costs
}

#[test]
fn a_late_rank_costs_a_few_probes_not_a_window_of_retransmissions() {
    let timeout = ClusterConfig::new(2, 1, 1).retransmit_timeout;
    for workers in [2u16, 4, 8] {
        for sparse in [false, true] {
            // Late by several timeouts, and by more than the largest backoff.
            for late in [timeout * 6, timeout * 60] {
                let costs = late_rank_costs(workers, sparse, late);
                for (rank, &(extra, probes)) in costs.iter().enumerate() {
                    let case = format!("{workers} workers, sparse {sparse}, late {late:?}, rank {rank}");
                    // Three jobs; each of the waiting ranks probes with one packet per
                    // (doubling) timeout, up to the largest timeout.
                    assert!(extra <= 3 * 8, "{case}: {extra} packets beyond the on-time jobs");
                    assert_eq!(extra, probes, "{case}: the probes are the only extra packets");
                    if rank == workers as usize - 1 {
                        assert_eq!(probes, 0, "{case}: the late rank itself waits for nobody");
                    } else {
                        assert!(probes >= 3, "{case}: each waiting job probes");
                    }
                }
            }
        }
    }
}

#[test]
fn a_probe_that_finds_its_contribution_lost_sends_it_at_once() {
    // Every packet of rank 0's first window is lost on the way up, and nothing answers
    // anything until the probes learn so.
    let mut config = ClusterConfig::new(2, 4, 16).with_faults(0.0);
    config.uplink.drop = 0.3;
    config.seed = 11;
    let mut cluster = Cluster::new(config).unwrap();
    for seed in 0..20 {
        let inputs = int32_inputs(2, 16 * 4 * 8, seed);
        let report = cluster.allreduce(&inputs, false).unwrap();
        assert_int32_results(&report.outputs, &inputs);
    }
}

/// `inputs` summed over a lossless cluster and over one that loses the results of the
/// job's last `lost` blocks on their way to rank 0, which no later packet reveals: how
/// much longer the lossy run took, and rank 0's counters in it.
fn tail_loss_cost(config: ClusterConfig, inputs: &[Tensor], sparse: bool, lost: u32) -> (Duration, u64) {
    let lossless = Cluster::new(config.clone()).unwrap().allreduce(inputs, sparse).unwrap();
    let blocks = inputs[0].len().div_ceil(config.packet_elements as usize) as u32;
    let lost_results = (blocks - lost..blocks).map(|block| (0, block)).collect();
    let mut lossy = Cluster::new(ClusterConfig { lost_results, ..config }).unwrap();
    let report = lossy.allreduce(inputs, sparse).unwrap();
    assert_int32_results(&report.outputs, inputs);
    assert!(report.workers[0].results_received < lossless.workers[0].results_received + lost as u64);
    (report.elapsed - lossless.elapsed, report.workers[0].probes)
}

#[test]
fn results_lost_at_a_jobs_end_cost_one_timeout_and_two_round_trips_not_a_timeout_each() {
    let (workers, slots, packet) = (4u16, 16u16, 64u16);
    let config = ClusterConfig::new(workers, slots, packet);
    let round_trip = config.uplink.latency + config.downlink.latency;
    let len = 64 * 16 * 6;
    // Dense, and sparse with rank 0 silent in the last 8 blocks: it asks for results
    // it contributed nothing to.
    let mut sparse = sparse_inputs(workers, len, 64, 0.5, 3);
    for (rank, tensor) in sparse.iter_mut().enumerate() {
        let Tensor::Int32(values) = tensor else { unreachable!() };
        values[len - 8 * 64..].fill(if rank == 0 { 0 } else { 1 });
    }
    // (Sparse: one result lost per slot. Where a silent slot lost two in a row and a
    // later packet's result showed the loss, its request recovers the first, and the
    // second costs another timeout.)
    for (inputs, is_sparse, losses) in
        [(int32_inputs(workers, len, 5), false, &[1, 4, 8, 16][..]), (sparse, true, &[1, 4, 8][..])]
    {
        for &lost in losses {
            let (extra, probes) = tail_loss_cost(config.clone(), &inputs, is_sparse, lost);
            // The thread waits a timeout from its last result, probes once, and asks for
            // every lost result at once; a timeout per lost result would take 200 µs
            // each.
            assert!(
                extra <= config.retransmit_timeout + 4 * round_trip,
                "sparse {is_sparse}, {lost} results lost: {extra:?} more than without loss"
            );
            assert!(probes <= 1, "sparse {is_sparse}, {lost} results lost: {probes} probes");
        }
    }
}

#[test]
fn one_element_slots_probe_eight_a_timeout_and_still_recover_a_lost_tail_in_one() {
    // A report covers one slot of one element: a probe per stretch was a probe per slot.
    let (workers, slots) = (4u16, 128u16);
    let config = ClusterConfig::new(workers, slots, 1);
    // Rank 0 silent (all zero, sparse), rank 3 late by 50 ms: the others wait as a whole,
    // probing at each doubling timeout.
    let mut inputs = sparse_inputs(workers, 20_000, 1, 1.0, 7);
    inputs[0] = Tensor::Int32(vec![0; 20_000]);
    let mut delays = vec![Duration::ZERO; workers as usize];
    delays[3] = Duration::from_millis(50);
    let late = ClusterConfig { start_delays: delays, ..config.clone() };
    let report = Cluster::new(late).unwrap().allreduce(&inputs, true).unwrap();
    assert_int32_results(&report.outputs, &inputs);
    for (rank, counters) in report.workers.iter().enumerate().take(3) {
        // 13 probing timeouts (1664 probes before, one per slot).
        let (probes, timeouts) = (counters.probes, counters.timeouts);
        assert!(
            timeouts > 0 && probes <= 8 * timeouts,
            "rank {rank}: {probes} probes in {timeouts} timeouts"
        );
    }
    // The results of the last window lost on their way to rank 0: the first probes go to
    // the slot sent last, whose recovered result shows the others lost.
    let round_trip = config.uplink.latency + config.downlink.latency;
    let inputs = int32_inputs(workers, 1280, 3);
    for lost in [40, 128] {
        let (extra, probes) = tail_loss_cost(config.clone(), &inputs, false, lost);
        assert!(extra <= config.retransmit_timeout + 4 * round_trip, "{lost} results lost: {extra:?} more");
        assert!(probes <= 8, "{lost} results lost: {probes} probes");
    }
}

#[test]
fn a_cluster_opens_its_session_through_the_control_registry_which_says_why_it_refuses_one() {
    // The registry's own check, then the engine's, passed on by the registry.
    let no_slots = ClusterConfig::new(2, 0, 4);
    let reason = "the switch refused the session: 0 slots do not divide among 1 threads";
    assert_eq!(Cluster::new(no_slots).err().map(|e| e.to_string()).as_deref(), Some(reason));
    let mut odd_depth = ClusterConfig::new(2, 4, 4);
    odd_depth.depth = 3;
    let reason = "depth 3 requested, it must be a power of two from 2 to 64";
    assert_eq!(Cluster::new(odd_depth).err(), Some(SimError::Refused(reason.into())));
    let cluster = Cluster::new(ClusterConfig::new(3, 4, 4)).unwrap();
    assert!(cluster.engine().session(cluster.session()).is_some(), "open in the engine");
}
