//! Windows many times their path's queue: 4 workers with windows of 128 packets of 540
//! bytes behind links of 2 to 10 Mbit/s whose queues of 1 and 2 KB hold one to three of
//! them, dense and sparse, with and without 1 % random loss each way. The delay such a
//! queue adds stays below the pacer's target, so only loss can engage it; before it did
//! (issue 31, item 4), such jobs took up to 626 times the time the link allows. The
//! issue's target, 1.5 times, is met by most later jobs, dense and sparse, not by every
//! case, and by few first jobs.

mod support;

use support::collapse::Case;

/// The median of `ratios`.
fn median(mut ratios: Vec<f64>) -> f64 {
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// Every case's jobs end exact, on two seeds of the links' losses. Bounds, against the
/// largest ratio measured on four seeds (`examples/collapse_matrix.rs`, session 23: a paced
/// sparse worker takes a turn at its pacer for each round it only waits for, and books
/// the requests that draw a result; session 22's in brackets): dense, first jobs within
/// 12.5 times the time the busiest link allows (11.8; 11.8), 3.5 behind an 8 KB bucket
/// (3.27; 3.27), later ones within 3.5 (3.12; 3.12), 2 behind a bucket (1.65; 1.65),
/// their median within 1.4 on the test's seeds; sparse, every job behind a bucket within
/// 2.5 (2.13; 3.60), first jobs within 7 (6.22; 15.9), later jobs behind 2 KB queues
/// within 2.5 (1.99; 6.29) and behind 1 KB ones within 5 (4.19; 10.0), their median
/// within 1.5 on the test's seeds (1.31; 3.85). The test runs two of the four seeds, so
/// its bounds hold those seeds' largest, which may sit below a wider sweep's (twelve
/// seeds: `benches/RESULTS.md`). Sparse jobs lose results on the way down, where four
/// workers' rounds complete independently into a queue of a frame or two.
#[test]
fn windows_far_above_tiny_queues_converge_instead_of_collapsing() {
    let mut dense_later = Vec::new();
    let mut sparse_later = Vec::new();
    for case in [false, true].into_iter().flat_map(Case::all) {
        for seed in [0, 1] {
            for (job, (_, ratio)) in case.run(seed, 3).into_iter().enumerate() {
                if job > 0 {
                    if case.sparse { &mut sparse_later } else { &mut dense_later }.push(ratio);
                }
                let bucket = case.limit.burst_bytes > 0;
                let bound = match (case.sparse, bucket, case.limit.queue_bytes, job) {
                    (false, true, _, 0) => 3.5,
                    (false, false, _, 0) => 12.5,
                    (false, true, _, _) => 2.0,
                    (false, false, _, _) => 3.5,
                    (true, true, _, _) => 2.5,
                    (true, false, _, 0) => 7.0,
                    (true, false, 2000, _) => 2.5,
                    (true, false, _, _) => 5.0,
                };
                assert!(ratio < bound, "{}, seed {seed}, job {job}: {ratio:.2} of the model", case.name());
            }
        }
    }
    let median_dense = median(dense_later);
    assert!(median_dense < 1.4, "dense later jobs: median {median_dense:.2} of the model");
    let median_sparse = median(sparse_later);
    assert!(median_sparse < 1.5, "sparse later jobs: median {median_sparse:.2} of the model");
}
