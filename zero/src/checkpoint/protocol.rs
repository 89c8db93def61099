//! The protocol that saves and loads the engine's state (the format is in [`crate::checkpoint`]).
//!
//! Both are collectives, and all-or-nothing across ranks: every phase that can fail on one rank
//! (preparing the directory, writing a shard, committing `meta.json`; reading and checking the
//! shards) ends in an agreement round (an all-gather of one small record per rank), and no rank
//! goes on, or changes anything, unless every rank succeeded. A failing rank returns its own
//! error; the others return [`ZeroError::PeerFailed`] naming it. With hybrid sharding each round
//! is also agreed over the replicas (one byte per shard group), and ranks of a group that
//! succeeded while another failed return [`ZeroError::ReplicaFailed`] naming that group.

use std::borrow::Cow;
use std::path::Path;

use crate::checkpoint::{self, plan, Checkpoint, Meta, ParamMeta, ShardMeta, FORMAT};
use crate::config::{Precision, ZeroConfig};
use crate::error::ZeroError;
use crate::ledger::{update_range, Ledger};
use crate::partition::Partition;
use crate::scaler::ScalerState;

/// A checkpoint read for this rank: its metadata and, per bucket, master and moments of the range
/// this rank updates.
pub(crate) type Staged = (Meta, Vec<Vec<Vec<f32>>>);

/// Payload of one agreement record: a shard's size (8 bytes) and SHA-256 (32).
pub(crate) type Payload = [u8; 40];

/// What saving and loading need from the engine: its bookkeeping, its states (read from its
/// stream's memory) and an agreement round over its communicators.
pub(crate) trait Persist {
    /// The engine's bookkeeping.
    fn led(&self) -> &Ledger;
    /// The layout.
    fn part(&self) -> &Partition {
        &self.led().part
    }
    /// The configuration.
    fn cfg(&self) -> &ZeroConfig {
        &self.led().cfg
    }
    /// This rank in the shard group.
    fn rank(&self) -> usize {
        self.led().rank
    }
    /// Whether this rank writes its shard (hybrid sharding: the first replica's group only).
    fn writes(&self) -> bool {
        true
    }
    /// Optimizer steps taken, steps skipped, the loss scaler's state.
    fn progress(&self) -> (u64, u64, Option<ScalerState>) {
        let l = self.led();
        (l.t, l.skipped, l.scaler.state())
    }
    /// Master, first and second moment of the range of bucket `b` this rank owns.
    fn own_states(&self, b: usize) -> Result<Vec<Cow<'_, [f32]>>, ZeroError>;
    /// One agreement round: every rank's success (with a payload) or failure. Returns every
    /// rank's payload when all succeeded; this rank's own error when it failed; else
    /// [`ZeroError::PeerFailed`] naming the ranks that failed.
    fn agree(
        &mut self,
        local: Result<Payload, ZeroError>,
        what: &str,
    ) -> Result<Vec<Payload>, ZeroError>;
}

/// Refuse `call` inside an accumulation window (`micro` > 0), while gradients are being pushed
/// (`pushed`), and (for a load, which `replaces` the parameters) while a bucket is gathered or
/// in flight (`busy`).
pub(crate) fn between_steps(
    part: &Partition,
    cfg: &ZeroConfig,
    (micro, pushed, busy): (usize, &[bool], Option<usize>),
    call: &'static str,
    replaces: bool,
) -> Result<(), ZeroError> {
    let not_now = |why: String| Err(ZeroError::NotNow { call, why });
    if micro != 0 {
        return not_now(format!(
            "inside an accumulation window (micro-step {} of {}); call it after the optimizer \
             step",
            micro + 1,
            cfg.accumulation_steps
        ));
    }
    if let Some(i) = pushed.iter().position(|&p| p) {
        return not_now(format!(
            "gradients of this micro-step are being pushed (`{}` is in); call it after the \
             optimizer step",
            part.specs[i].name
        ));
    }
    if let (true, Some(b)) = (replaces, busy) {
        let p = part.buckets[b].params[0];
        return not_now(format!(
            "`{}` is gathered or being prefetched; release it first",
            part.specs[p].name
        ));
    }
    Ok(())
}

/// Save `e`'s state into `dir` (see [`crate::Engine::save_checkpoint`]), once the caller has checked
/// that it is between steps.
pub(crate) fn save<E: Persist>(
    e: &mut E,
    dir: &Path,
    client_state: serde_json::Value,
) -> Result<(), ZeroError> {
    let writes = e.writes();
    let skip = || Ok([0u8; 40]);
    let prepared = if writes {
        checkpoint::prepare_dir(dir, e.rank()).map(|()| [0u8; 40])
    } else {
        skip()
    };
    e.agree(
        prepared,
        "save_checkpoint: preparing the directory; nothing was written",
    )?;
    let (n, rank) = (e.part().world, e.rank());
    let written = if writes {
        (|| {
            let states = (0..e.part().buckets.len())
                .map(|b| e.own_states(b))
                .collect::<Result<Vec<_>, _>>()?;
            let refs: Vec<Vec<&[f32]>> = states
                .iter()
                .map(|s| s.iter().map(|x| &**x).collect())
                .collect();
            checkpoint::write_shard(dir, rank, n, &refs, e.cfg().optimizer.states())
        })()
        .map(|(bytes, sum)| {
            let mut p = [0u8; 40];
            p[..8].copy_from_slice(&bytes.to_le_bytes());
            p[8..].copy_from_slice(&sum);
            p
        })
    } else {
        skip()
    };
    let shards = e.agree(
        written,
        "save_checkpoint: writing the shards; the checkpoint was not committed",
    )?;
    let committed = if rank == 0 && writes {
        let (step, skipped, scaler) = e.progress();
        let (part, cfg) = (e.part(), e.cfg());
        let meta = Meta {
            format: FORMAT,
            world: n,
            stage: cfg.stage,
            precision: cfg.precision.to_string(),
            bucket_elems: cfg.bucket_elems,
            params: part
                .specs
                .iter()
                .map(|p| ParamMeta {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                })
                .collect(),
            buckets: part.buckets.iter().map(|b| b.len).collect(),
            optimizer: cfg.optimizer.name().into(),
            states: cfg
                .optimizer
                .states()
                .iter()
                .map(|x| x.to_string())
                .collect(),
            step,
            skipped,
            scaler,
            client_state,
            shards: shards
                .iter()
                .enumerate()
                .map(|(r, p)| ShardMeta {
                    file: checkpoint::shard_file(r, n),
                    bytes: u64::from_le_bytes(p[..8].try_into().expect("8 bytes")),
                    sha256: checkpoint::hex(&p[8..]),
                })
                .collect(),
        };
        checkpoint::write_meta(dir, &meta).map(|()| [0u8; 40])
    } else {
        Ok([0u8; 40])
    };
    e.agree(
        committed,
        "save_checkpoint: committing meta.json; the checkpoint was not committed",
    )?;
    Ok(())
}

/// `a, b`, or "no state".
fn states_list(s: &[impl AsRef<str>]) -> String {
    if s.is_empty() {
        "no state".into()
    } else {
        s.iter().map(AsRef::as_ref).collect::<Vec<_>>().join(", ")
    }
}

/// This rank's part of the checkpoint in `dir` (per bucket, the master and the optimizer's
/// states of the range it updates: all of it in stage 0), read once every rank has read its
/// own, after checking that the optimizer is the one it was saved with.
pub(crate) fn read_agreed<E: Persist>(e: &mut E, dir: &Path) -> Result<Staged, ZeroError> {
    let read = (|| {
        let mut ck = Checkpoint::open(dir)?;
        let part = e.part();
        if let Some(why) = plan::mismatch(ck.partition(), part) {
            return Err(checkpoint::err(dir, why));
        }
        let (m, o) = (ck.meta(), &e.cfg().optimizer);
        if m.optimizer != o.name() || m.states != o.states() {
            return Err(checkpoint::err(
                dir,
                format!(
                    "holds the state of {} ({}); this engine's optimizer is {} ({}): load it \
                     with the optimizer it was saved with",
                    m.optimizer,
                    states_list(&m.states),
                    o.name(),
                    states_list(o.states()),
                ),
            ));
        }
        let states = (0..part.buckets.len())
            .map(|b| ck.read_range(part, b, update_range(part, e.cfg().stage, e.rank(), b)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((ck.meta().clone(), states))
    })();
    e.agree(
        read.as_ref().map(|_| [0u8; 40]).map_err(Clone::clone),
        "load_checkpoint: reading the checkpoint; nothing was changed",
    )?;
    Ok(read.expect("agreed above"))
}

/// Bytes of one agreement record: a success byte, then the payload.
pub(crate) const REC: usize = 1 + std::mem::size_of::<Payload>();

/// This rank's agreement record for `local`.
pub(crate) fn record(local: &Result<Payload, ZeroError>) -> [u8; REC] {
    let mut mine = [0u8; REC];
    if let Ok(p) = local {
        mine[0] = 1;
        mine[1..].copy_from_slice(p);
    }
    mine
}

/// The outcome of an agreement round from this rank's `local` result and every rank's record in
/// `all` (a success byte, then the payload): this rank's error, else [`ZeroError::PeerFailed`]
/// naming the ranks that failed, else every rank's payload.
pub(crate) fn agreed(
    local: Result<Payload, ZeroError>,
    all: &[u8],
    n: usize,
    what: &str,
) -> Result<Vec<Payload>, ZeroError> {
    let rec = all.len() / n;
    local?;
    let failed: Vec<usize> = (0..n).filter(|&r| all[r * rec] == 0).collect();
    if !failed.is_empty() {
        return Err(ZeroError::PeerFailed {
            what: what.to_string(),
            ranks: failed,
        });
    }
    Ok(all
        .chunks_exact(rec)
        .map(|c| c[1..].try_into().expect("record size"))
        .collect())
}

/// Hybrid sharding: after a round in this shard group succeeded, every shard group's verdict
/// (`groups`, one byte each, all-gathered over the replicas; empty without hybrid sharding):
/// [`ZeroError::ReplicaFailed`] naming the groups that failed.
pub(crate) fn replicas_agreed(groups: &[u8], what: &str) -> Result<(), ZeroError> {
    let failed: Vec<usize> = (0..groups.len()).filter(|&k| groups[k] == 0).collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(ZeroError::ReplicaFailed {
            what: what.to_string(),
            replicas: failed,
        })
    }
}

/// Whether every rank's record in `all` says it succeeded.
pub(crate) fn all_succeeded(all: &[u8], n: usize) -> bool {
    let rec = all.len() / n;
    (0..n).all(|r| all[r * rec] != 0)
}

/// Whether a checkpoint's scaler state resumes here: fp16 to fp16.
pub(crate) fn resumes_scaler(meta: &Meta) -> bool {
    meta.precision == Precision::Fp16.to_string()
}
