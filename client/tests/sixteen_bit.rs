//! float16 and bfloat16 through the library: 16-bit tensors, and float32 tensors sent as
//! 16 bits (`general.wire_precision`), through a real `netagg-switch` over UDP, dense and
//! sparse, and on the dummy backend, with half the bytes on the wire.

mod common;

use std::time::Duration;

use common::{contexts, dummy_config, run_verified, Switch};
use netagg::{bf16, f16, Config, Context, Element, SparseMode, WirePrecision};

/// How long the worker processes of one run may take.
const WITHIN: Duration = Duration::from_secs(120);

/// Rank `rank`'s element `i`: values of mixed magnitudes and signs, some blocks of 64
/// zero on both ranks and some on one only (for sparse jobs).
fn input(rank: usize, i: usize) -> f64 {
    let block = i / 64;
    if block % 4 == 2 || (block % 4 == 1 && rank == 0) {
        return 0.0;
    }
    let sign = if (i + rank) % 3 == 0 { -1.0 } else { 1.0 };
    sign * (1.0 + (i % 97) as f64 / 7.0) * 2f64.powi((i % 11) as i32 - 5 + rank as i32)
}

/// Runs one allreduce of `numel` elements of `T` on every context at once, in place on
/// even ranks and out of place on odd ones; returns each rank's sums.
fn allreduce_everywhere<T: Element + Default>(
    contexts: &[Context],
    numel: usize,
    from: fn(f64) -> T,
) -> Vec<Vec<T>> {
    std::thread::scope(|scope| {
        let runs: Vec<_> = contexts
            .iter()
            .enumerate()
            .map(|(rank, context)| {
                scope.spawn(move || {
                    let mut data: Vec<T> = (0..numel).map(|i| from(input(rank, i))).collect();
                    if rank % 2 == 0 {
                        context.allreduce(&mut data).unwrap();
                        data
                    } else {
                        let mut out = vec![T::default(); numel];
                        context.allreduce_into(&data, &mut out).unwrap();
                        out
                    }
                })
            })
            .collect();
        runs.into_iter().map(|run| run.join().unwrap()).collect()
    })
}

/// The switch's sum of element `i` of 16-bit inputs: their float32 sum (exact here: two
/// terms of at most 11 significant bits, 12 binades apart at most), rounded once.
fn expected_sum(i: usize, workers: usize, round: fn(f64) -> f64) -> f64 {
    round((0..workers).map(|rank| round(input(rank, i))).sum())
}

#[test]
fn sixteen_bit_tensors_and_float32_as_16_bits_sum_through_a_switch_on_every_rank_alike() {
    const NUMEL: usize = 64 * 50 + 7;
    let switch = Switch::start(&[]);
    let round16: fn(f64) -> f64 = |x| f16::from_f64(x).to_f64();
    let round_bf16: fn(f64) -> f64 = |x| bf16::from_f64(x).to_f64();
    for sparse in [SparseMode::Off, SparseMode::Auto] {
        let setup = |config: &mut Config| {
            config.general.packet_numel = 64;
            config.general.sparse = sparse;
        };
        let ranks = contexts(&switch, 2, setup);
        let halves = allreduce_everywhere(&ranks, NUMEL, f16::from_f64);
        let brains = allreduce_everywhere(&ranks, NUMEL, bf16::from_f64);
        for i in 0..NUMEL {
            let (half, brain) = (expected_sum(i, 2, round16), expected_sum(i, 2, round_bf16));
            for rank in 0..2 {
                assert_eq!(halves[rank][i].to_f64(), half, "{sparse:?}: float16, rank {rank}, element {i}");
                assert_eq!(brains[rank][i].to_f64(), brain, "{sparse:?}: bfloat16, rank {rank}, element {i}");
            }
        }

        for (precision, round) in [(WirePrecision::Float16, round16), (WirePrecision::BFloat16, round_bf16)] {
            let ranks = contexts(&switch, 2, |config| {
                setup(config);
                config.general.wire_precision = precision;
            });
            let sums = allreduce_everywhere(&ranks, NUMEL, |x| x as f32);
            for i in 0..NUMEL {
                for (rank, sums) in sums.iter().enumerate() {
                    let got = f64::from(sums[i]);
                    assert_eq!(
                        got,
                        expected_sum(i, 2, round),
                        "{sparse:?}: {precision}, rank {rank}, element {i}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_dummy_backend_sums_16_bits_as_the_switch_rounds_them() {
    let context = Context::start(dummy_config(3)).unwrap();
    // 3 · 1.0009765625 (1 + 2^-10) = 3.0029296875 lies between float16's 3.001953125
    // and 3.00390625: a float32 sum rounded once gives the nearer, 3.00390625, where three
    // float16 additions would give 3.001953125.
    let mut halves = vec![f16::from_f32(1.000_976_6); 300];
    context.allreduce(&mut halves).unwrap();
    assert!(halves.iter().all(|x| x.to_f32() == 3.003_906_2), "{:?}", &halves[..2]);
    let mut brains = vec![bf16::from_f32(-1.5); 10];
    context.allreduce(&mut brains).unwrap();
    assert!(brains.iter().all(|x| x.to_f32() == -4.5));
    context.stop();

    let mut config = dummy_config(3);
    config.general.wire_precision = WirePrecision::BFloat16;
    let context = Context::start(config.clone()).unwrap();
    let mut floats = vec![1.0f32 + 2f32.powi(-12), 1e30];
    context.allreduce(&mut floats).unwrap();
    let rounded_input = bf16::from_f32(1e30).to_f32();
    assert_eq!(
        floats,
        [3.0, bf16::from_f32(3.0 * rounded_input).to_f32()],
        "each input rounded to bfloat16 first"
    );
    assert_eq!(
        context.stop().total().bytes_sent,
        48 + 2 * 2 + 4,
        "one packet, two 2-byte elements, a checksum"
    );

    // 1000 elements in packets of 256 4-byte elements (1024 payload bytes): 4 packets of
    // float32, and 2 of 16-bit elements, 512 to a packet, in half the bytes.
    for (precision, packets, element_bytes) in
        [(WirePrecision::Float32, 4, 4), (WirePrecision::Float16, 2, 2)]
    {
        config.general.wire_precision = precision;
        let context = Context::start(config.clone()).unwrap();
        context.allreduce(&mut vec![0.5f32; 1000]).unwrap();
        let stats = context.stop().total();
        // A 48-byte header and a 4-byte checksum per packet.
        let expected = (packets, packets * (48 + 4) + 1000 * element_bytes);
        assert_eq!((stats.packets_sent, stats.bytes_sent), expected, "{precision}");
    }
}

#[test]
fn a_16_bit_wire_with_block_floating_point_is_refused_naming_both_keys() {
    let mut config = dummy_config(2);
    config.set("general.prepostprocessor", "cpu_exponent_quantizer").unwrap();
    config.set("general.wire_precision", "float16").unwrap();
    let message = config.validate().unwrap_err();
    assert!(
        message.contains("general.wire_precision float16") && message.contains("cpu_exponent_quantizer"),
        "{message}"
    );
    let error = config.set("general.wire_precision", "float8").unwrap_err().to_string();
    assert!(error.contains("float32") && error.contains("bfloat16"), "{error}");
}

#[test]
fn worker_processes_verify_16_bit_sums() {
    let switch = Switch::start(&[]);
    for kind in ["float16", "bfloat16"] {
        run_verified(&switch, 3, &[], &["--type", kind, "--numel", "1,1000,100000", "--jobs", "3"], WITHIN);
    }
    let narrowed = [("NETAGG_GENERAL__WIRE_PRECISION", "float16"), ("NETAGG_GENERAL__SPARSE", "auto")];
    run_verified(&switch, 2, &narrowed, &["--type", "float32", "--numel", "4097,1", "--jobs", "2"], WITHIN);
}
