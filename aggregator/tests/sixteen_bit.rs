//! float16 and bfloat16 allreduces through the in-memory cluster: sums accumulated in
//! float32 and rounded once, the same bits on every rank, dense and sparse, over lossy
//! links; NaN, infinities and overflow; and accuracy against what PyTorch DDP's
//! `fp16_compress_hook` and `bf16_compress_hook` give on the same data.

use half::{bf16, f16};
use netagg_aggregator::sim::{Cluster, ClusterConfig, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One of the two 16-bit formats, for tests written once for both.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Format {
    Float16,
    BFloat16,
}

impl Format {
    const BOTH: [Format; 2] = [Format::Float16, Format::BFloat16];

    /// Rounds to the format, to nearest even, straight from float64 (one rounding).
    fn round(self, x: f64) -> f64 {
        match self {
            Format::Float16 => f16::from_f64(x).to_f64(),
            Format::BFloat16 => bf16::from_f64(x).to_f64(),
        }
    }

    /// The unit roundoff: 2^-11 (11 significant bits), 2^-8 (8).
    fn unit(self) -> f64 {
        match self {
            Format::Float16 => 2f64.powi(-11),
            Format::BFloat16 => 2f64.powi(-8),
        }
    }

    /// Half the smallest subnormal: the absolute error of a rounding below the normals.
    fn half_subnormal(self) -> f64 {
        match self {
            Format::Float16 => 2f64.powi(-25),
            Format::BFloat16 => 2f64.powi(-134),
        }
    }

    /// A tensor of values the format holds exactly (as rounded by [`Format::round`]).
    fn tensor(self, values: &[f64]) -> Tensor {
        match self {
            Format::Float16 => Tensor::Float16(values.iter().map(|&x| f16::from_f64(x)).collect()),
            Format::BFloat16 => Tensor::BFloat16(values.iter().map(|&x| bf16::from_f64(x)).collect()),
        }
    }
}

/// A 16-bit tensor's values and bit patterns.
fn values(tensor: &Tensor) -> Vec<f64> {
    match tensor {
        Tensor::Float16(v) => v.iter().map(|x| x.to_f64()).collect(),
        Tensor::BFloat16(v) => v.iter().map(|x| x.to_f64()).collect(),
        other => panic!("a 16-bit tensor expected, got {:?}", other.element_type()),
    }
}

fn bits(tensor: &Tensor) -> Vec<u16> {
    match tensor {
        Tensor::Float16(v) => v.iter().map(|x| x.to_bits()).collect(),
        Tensor::BFloat16(v) => v.iter().map(|x| x.to_bits()).collect(),
        other => panic!("a 16-bit tensor expected, got {:?}", other.element_type()),
    }
}

/// Runs the allreduce and returns rank 0's sums, after checking that every rank received
/// the same bits.
fn allreduce(cluster: &mut Cluster, inputs: &[Tensor], sparse: bool) -> Vec<f64> {
    let report = cluster.allreduce(inputs, sparse).unwrap();
    let first = bits(&report.outputs[0]);
    for (rank, output) in report.outputs.iter().enumerate() {
        assert_eq!(output.element_type(), inputs[0].element_type());
        assert!(bits(output) == first, "rank {rank}'s result differs from rank 0's");
    }
    values(&report.outputs[0])
}

/// A normal sample (Box–Muller: no distribution crate for one test).
fn normal(rng: &mut ChaCha8Rng, sigma: f64) -> f64 {
    let (u, v): (f64, f64) = (1.0 - rng.gen::<f64>(), rng.gen());
    sigma * (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// What the tests sum: uniform in [-1, 1), or gradient-like: normal with a standard
/// deviation of 10^-3 and one element in a hundred a hundred times larger.
#[derive(Debug, Clone, Copy)]
enum Data {
    Uniform,
    Gradients,
}

fn float32_inputs(data: Data, workers: u16, len: usize, seed: u64) -> Vec<Vec<f64>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..workers)
        .map(|_| {
            (0..len)
                .map(|_| {
                    let x = match data {
                        Data::Uniform => rng.gen_range(-1.0..1.0),
                        Data::Gradients if rng.gen_bool(0.01) => normal(&mut rng, 0.1),
                        Data::Gradients => normal(&mut rng, 1e-3),
                    };
                    x as f32 as f64
                })
                .collect()
        })
        .collect()
}

#[test]
fn sums_are_float32_sums_rounded_once_and_the_same_bits_on_every_rank() {
    for format in Format::BOTH {
        for workers in [2u16, 4, 8] {
            let mut cluster = Cluster::new(ClusterConfig::new(workers, 8, 64)).unwrap();
            for (len, sparse) in [(1, false), (64 * 20 + 5, false), (64 * 20 + 5, true)] {
                let mut inputs = float32_inputs(Data::Uniform, workers, len, u64::from(workers) + len as u64);
                if sparse {
                    // Every third block zero on every rank, every fifth on rank 0 alone; a
                    // 16-bit block holds 128 elements, in the bytes of 64 4-byte ones.
                    for (rank, input) in inputs.iter_mut().enumerate() {
                        for (block, chunk) in input.chunks_mut(128).enumerate() {
                            if block % 3 == 0 || (rank == 0 && block % 5 == 0) {
                                chunk.fill(0.0);
                            }
                        }
                    }
                }
                let tensors: Vec<Tensor> = inputs.iter().map(|x| format.tensor(x)).collect();
                let sums = allreduce(&mut cluster, &tensors, sparse);
                for (i, sum) in sums.iter().enumerate() {
                    let terms: Vec<f64> = tensors.iter().map(|t| values(t)[i]).collect();
                    let exact: f64 = terms.iter().sum();
                    let magnitudes: f64 = terms.iter().map(|x| x.abs()).sum();
                    // The float32 additions (in whatever order the packets came), then one
                    // rounding to the format.
                    let float32 = f64::from(workers - 1) * 2f64.powi(-24) * magnitudes;
                    let bound = float32 + format.unit() * (exact.abs() + float32) + format.half_subnormal();
                    assert!(
                        (sum - exact).abs() <= bound,
                        "{format:?}, {workers} workers, sparse {sparse}, element {i}: {sum} vs {exact}"
                    );
                }
            }
        }
    }
}

#[test]
fn sixteen_bit_packets_carry_float32s_bytes_so_a_job_takes_half_the_packets() {
    // Sessions of 256-element packets; 8 float32 packets' worth of elements.
    let config = ClusterConfig::new(2, 8, 256);
    let float32 = |x: f32| Tensor::Float32(vec![x; 2048]);
    let report32 =
        Cluster::new(config.clone()).unwrap().allreduce(&[float32(1.0), float32(2.0)], false).unwrap();
    let inputs = [Format::Float16.tensor(&[1.0; 2048]), Format::Float16.tensor(&[2.0; 2048])];
    let report16 = Cluster::new(config).unwrap().allreduce(&inputs, false).unwrap();
    for (counters32, counters16) in report32.workers.iter().zip(&report16.workers) {
        assert_eq!((counters32.data_sent, counters16.data_sent), (8, 4));
        // Every datagram the same size: a header, 1024 payload bytes and a checksum.
        assert_eq!(counters32.bytes_sent, 8 * (48 + 1024 + 4));
        assert_eq!(counters16.bytes_sent, 4 * (48 + 1024 + 4));
        assert_eq!(counters16.bytes_received, counters16.bytes_sent);
    }
    assert_eq!(values(&report16.outputs[1]), vec![3.0; 2048]);
    // A tail shorter than a packet takes its own bytes only.
    let inputs = [Format::BFloat16.tensor(&[1.0; 600]), Format::BFloat16.tensor(&[2.0; 600])];
    let report = Cluster::new(ClusterConfig::new(2, 8, 256)).unwrap().allreduce(&inputs, false).unwrap();
    for counters in &report.workers {
        assert_eq!(counters.data_sent, 2);
        assert_eq!(counters.bytes_sent, 2 * (48 + 4) + 600 * 2);
    }
    assert_eq!(values(&report.outputs[0]), vec![3.0; 600]);
}

#[test]
fn loss_duplication_and_reordering_change_no_bit() {
    // Small integers: every sum is exact in float32 and in the format, whatever the
    // order of the additions, so the expected result is exact.
    for format in Format::BOTH {
        for (rate, sparse) in [(0.05, false), (0.1, true)] {
            let mut config = ClusterConfig::new(4, 8, 32).with_faults(rate);
            config.seed = 7;
            let mut cluster = Cluster::new(config).unwrap();
            let mut rng = ChaCha8Rng::seed_from_u64(11);
            let inputs: Vec<Vec<f64>> = (0..4)
                .map(|_| {
                    (0..32 * 40)
                        .map(|i| {
                            if sparse && (i / 32) % 4 == 1 {
                                0.0
                            } else {
                                f64::from(rng.gen_range(-30..30))
                            }
                        })
                        .collect()
                })
                .collect();
            let tensors: Vec<Tensor> = inputs.iter().map(|x| format.tensor(x)).collect();
            let sums = allreduce(&mut cluster, &tensors, sparse);
            for (i, sum) in sums.iter().enumerate() {
                let exact: f64 = inputs.iter().map(|x| x[i]).sum();
                assert_eq!(*sum, exact, "{format:?}, loss {rate}, element {i}");
            }
        }
    }
}

#[test]
fn nan_and_infinities_are_float32s_and_overflow_is_infinite() {
    let inputs = [
        [1.0, f64::INFINITY, f64::INFINITY, f64::NAN, 60000.0, -60000.0, 1e30],
        [2.0, 5.0, f64::NEG_INFINITY, 1.0, 60000.0, -60000.0, 1e30],
    ];
    for format in Format::BOTH {
        let mut cluster = Cluster::new(ClusterConfig::new(2, 4, 16)).unwrap();
        let tensors: Vec<Tensor> = inputs.iter().map(|x| format.tensor(x)).collect();
        let sums = allreduce(&mut cluster, &tensors, false);
        assert_eq!(sums[..2], [3.0, f64::INFINITY]);
        assert!(sums[2].is_nan() && sums[3].is_nan(), "inf - inf and NaN + 1 are NaN: {sums:?}");
        match format {
            // 120000 is past float16's largest, 65504: rounding gives infinity, as IEEE does
            // (1e30 is infinite as a float16 input already).
            Format::Float16 => assert_eq!(sums[4..], [f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY]),
            Format::BFloat16 => {
                assert_eq!(sums[4..6], [format.round(120000.0), format.round(-120000.0)]);
                assert_eq!(sums[6], format.round(2.0 * format.round(1e30)));
            }
        }
    }
}

/// What PyTorch DDP's `fp16_compress_hook` / `bf16_compress_hook` return for element `i`:
/// each rank's float32 gradient cast to 16 bits and divided by the world size (in 16 bits),
/// then summed in 16-bit arithmetic rank after rank, as a ring reduces, every addition
/// rounded; the mean, which times the world size (a power of two: exact) is the sum.
fn compress_hook_sum(format: Format, inputs: &[Vec<f64>], i: usize) -> f64 {
    let n = inputs.len() as f64;
    let mut shares = inputs.iter().map(|x| format.round(format.round(x[i]) / n));
    let first = shares.next().unwrap();
    shares.fold(first, |sum, share| format.round(sum + share)) * n
}

/// Root-mean-square and largest absolute error of `sums` against the exact sums.
fn errors(sums: impl Iterator<Item = f64>, exact: &[f64]) -> (f64, f64) {
    let (mut squares, mut largest) = (0.0, 0.0f64);
    for (sum, exact) in sums.zip(exact) {
        let error = (sum - exact).abs();
        squares += error * error;
        largest = largest.max(error);
    }
    ((squares / exact.len() as f64).sqrt(), largest)
}

#[test]
fn errors_are_no_worse_than_pytorchs_compress_hooks_on_the_same_data() {
    let len = 64 * 200;
    for format in Format::BOTH {
        for data in [Data::Uniform, Data::Gradients] {
            for workers in [2u16, 4, 8] {
                let inputs = float32_inputs(data, workers, len, 1000 + u64::from(workers));
                let exact: Vec<f64> = (0..len).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
                // netagg with general.wire_precision: each rank's float32 rounded to 16 bits
                // by its worker threads, summed by the switch.
                let mut cluster = Cluster::new(ClusterConfig::new(workers, 16, 64)).unwrap();
                let tensors: Vec<Tensor> = inputs.iter().map(|x| format.tensor(x)).collect();
                let sums = allreduce(&mut cluster, &tensors, false);
                let (netagg_rms, netagg_max) = errors(sums.into_iter(), &exact);
                let hook = (0..len).map(|i| compress_hook_sum(format, &inputs, i));
                let (hook_rms, hook_max) = errors(hook, &exact);
                let case = format!("{format:?}, {data:?}, {workers} workers");
                assert!(
                    netagg_rms <= hook_rms,
                    "{case}: RMS error {netagg_rms:e} against the hook's {hook_rms:e}"
                );
                assert!(
                    netagg_max <= hook_max,
                    "{case}: largest error {netagg_max:e} against the hook's {hook_max:e}"
                );
                if workers > 2 {
                    // Beyond one addition the hook's roundings add up: netagg's sum is
                    // markedly closer, not merely as close.
                    assert!(netagg_rms < 0.9 * hook_rms, "{case}: {netagg_rms:e} against {hook_rms:e}");
                }
            }
        }
    }
}
