//! netagg's benchmarks, kept in a crate of their own so that the library crates need no
//! benchmarking dependency: `benches/sum.rs` compares the engine's sum kernels with plain
//! slice additions, and `benches/engine.rs` measures how many packets per second the
//! engine aggregates in memory. Run them with `cargo bench -p netagg-benches`.
