//! Links (to be written).
