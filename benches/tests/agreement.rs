//! The simulator agrees with the emulator: a few of the emulated runs recorded in
//! `benches/emulated-runs.csv` (faithful ones: the links set their pace), predicted by
//! the simulator within 10 %, netagg and the ring. `simulate --against` predicts them all.

use netagg_benches::predict::EmulatedRun;

const RUNS: &str = include_str!("../emulated-runs.csv");

/// Which recorded runs this test predicts: one per worker count, a long delay, and loss.
fn chosen(run: &EmulatedRun) -> bool {
    let rate = run.bits_per_second / 1_000_000;
    let delay = run.delay.as_millis();
    matches!(
        (run.workers, rate, delay, run.loss > 0.0),
        (2, 100, 1, false) | (4, 50, 5, false) | (8, 30, 1, false) | (4, 50, 1, true)
    )
}

#[test]
fn the_simulator_predicts_faithful_emulated_runs_within_ten_percent() {
    let runs: Vec<EmulatedRun> = EmulatedRun::parse_all(RUNS).unwrap().into_iter().filter(chosen).collect();
    assert_eq!(runs.len(), 4, "the chosen runs are in the file");
    for run in runs {
        assert_eq!(run.faithful(), (true, true), "{}", run.line());
        let setup = run.setup();
        let netagg = setup.netagg().unwrap().time.as_secs_f64();
        let ratio = netagg / run.netagg_s;
        assert!(
            (0.9..1.1).contains(&ratio),
            "{setup}: netagg simulated {netagg:.3} s, emulated {:.3} s",
            run.netagg_s
        );
        // The ring's model leaves TCP's loss recovery coarse: its lossy run is not held.
        if let (Some(measured), false) = (run.ring_s, run.loss > 0.0) {
            let ring = setup.ring().time.as_secs_f64();
            let ratio = ring / measured;
            assert!(
                (0.9..1.1).contains(&ratio),
                "{setup}: ring simulated {ring:.3} s, emulated {measured:.3} s"
            );
        }
    }
}
