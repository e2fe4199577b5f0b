//! Delay, jitter and loss in user space (to be written).
