//! The errors of the candle binding: the engine's, the communicator's, candle's, and misuse.

/// What can go wrong wrapping, loading, stepping or saving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The ZeRO engine refused or failed.
    #[error(transparent)]
    Zero(#[from] ringzero_zero::ZeroError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] ringzero_collectives::Error),
    /// candle failed (a shape, a dtype, a device).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The call cannot work as made; the message says what to change.
    #[error("{0}")]
    Invalid(String),
}
