//! [`ZeroError`]: what the engines, the configuration and the checkpoints return.

/// Errors of the engine: bad input (nothing changed) or a failed collective.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ZeroError {
    /// The configuration cannot work.
    #[error("ZeRO config: {0}")]
    Config(String),
    /// A parameter name the engine does not know.
    #[error("unknown parameter `{0}`")]
    UnknownParam(String),
    /// A gradient of the wrong length.
    #[error("gradient for `{name}` has {got} elements, the parameter has {want}")]
    GradLength {
        /// Parameter.
        name: String,
        /// Elements pushed.
        got: usize,
        /// Elements expected.
        want: usize,
    },
    /// A gradient pushed twice in one micro-step.
    #[error("gradient for `{0}` was already pushed in this micro-step")]
    GradTwice(String),
    /// `step` before every gradient was pushed.
    #[error("step: no gradient pushed for {0}")]
    MissingGrads(String),
    /// Stage 3: a parameter read while not gathered.
    #[error("parameter `{0}` is not gathered (stage 3: call gather before reading it)")]
    NotGathered(String),
    /// Stage 3: a gather of something already gathered.
    #[error("parameter `{0}` is already gathered")]
    AlreadyGathered(String),
    /// Stage 3: an optimizer step while parameters are still gathered (they would go stale).
    #[error("step: release {0} before the optimizer step (gathered copies would go stale)")]
    StillGathered(String),
    /// A call the engine's state does not allow now (nothing changed).
    #[error("{call}: {why}")]
    NotNow {
        /// The call.
        call: &'static str,
        /// Why not, and what to do.
        why: String,
    },
    /// A checkpoint could not be saved or loaded; names the file or directory.
    #[error("checkpoint {}: {msg}", path.display())]
    Checkpoint {
        /// The file or directory at fault.
        path: std::path::PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// Other ranks failed a step that every rank must pass (their own errors say why).
    #[error("{what}: rank(s) {ranks:?} failed (see their errors)")]
    PeerFailed {
        /// What failed, and what that means for this rank.
        what: String,
        /// The ranks that failed.
        ranks: Vec<usize>,
    },
    /// Hybrid sharding: other shard groups failed a step that every rank must pass (their
    /// ranks' errors say why).
    #[error("{what}: the shard group(s) of replica(s) {replicas:?} failed (see their errors)")]
    ReplicaFailed {
        /// What failed, and what that means for this rank.
        what: String,
        /// The failed groups, by their index in this rank's replica communicator.
        replicas: Vec<usize>,
    },
    /// The NVMe tier could not create, read or write its file; names the file and what to do.
    #[error("offload: {0}")]
    Offload(String),

    /// fp16's gradients overflowed with the loss scale already at `min_loss_scale` and no
    /// hysteresis left: no smaller scale is left to try (DeepSpeed stops the run here too).
    #[error(
        "optimizer step {step}: the fp16 gradients overflow with the loss scale already at \
         min_loss_scale ({scale}) and no hysteresis left, so no smaller scale is left to try \
         (DeepSpeed stops here too): lower fp16.min_loss_scale, train in bf16, or look for what \
         diverged (the learning rate, the data)"
    )]
    LossScaleAtMinimum {
        /// The loss scale (the configured minimum).
        scale: f32,
        /// The optimizer step that overflowed (1-based, skipped steps not counted).
        step: u64,
    },
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] ringzero_collectives::Error),
}
