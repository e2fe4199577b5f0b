//! Helpers shared by the integration tests and the examples that print their matrices.

pub mod collapse;
