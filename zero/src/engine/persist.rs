//! Saving and loading the engine's state (the format is in [`crate::checkpoint`]).
//!
//! Both are collectives, and all-or-nothing across ranks: every phase that can fail on one rank
//! (preparing the directory, writing a shard, committing `meta.json`; reading and checking the
//! shards) ends in an agreement round (an all-gather of one small record per rank), and no rank
//! goes on, or changes anything, unless every rank succeeded. A failing rank returns its own
//! error; the others return [`ZeroError::PeerFailed`] naming it. With hybrid sharding each round
//! is also agreed over the replicas (one byte per shard group), and ranks of a group that
//! succeeded while another failed return [`ZeroError::ReplicaFailed`] naming that group.

use std::path::Path;

use ringzero_kernels::cpu::{cast, Float};

use super::{Engine, ZeroError};
use crate::checkpoint::{self, plan, Checkpoint, Meta, ParamMeta, ShardMeta, FORMAT};
use crate::config::Precision;

/// A checkpoint read for this rank: its metadata and, per bucket, master and moments of the range
/// this rank updates.
type Staged = (Meta, Vec<[Vec<f32>; 3]>);

/// Payload of one agreement record: a shard's size (8 bytes) and SHA-256 (32).
type Payload = [u8; 40];

impl<T: Float> Engine<'_, T> {
    /// Save this engine's state into `dir` (a collective: every rank calls it with the same
    /// directory, on a filesystem all ranks share when they are on several hosts). `dir` must
    /// not hold a checkpoint already. `client_state` is kept as is in `meta.json` and returned by
    /// [`Engine::load_checkpoint`] (a data loader's position, an epoch, ...).
    ///
    /// Call it between optimizer steps: inside an accumulation window, or once a micro-step's
    /// gradients are being pushed, it is refused and nothing is written. When it fails on any
    /// rank, `meta.json` is not written, so the directory is not a checkpoint.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<Path>,
        client_state: serde_json::Value,
    ) -> Result<(), ZeroError> {
        let dir = dir.as_ref();
        self.between_steps("save_checkpoint", false)?;
        // Hybrid sharding: the first replica's shard group writes; the others take part in
        // every agreement, so all learn the outcome.
        let writes = self.replicas.is_none_or(|r| r.rank() == 0);
        let skip = || Ok([0u8; 40]);
        let prepared = if writes {
            checkpoint::prepare_dir(dir).map(|()| [0u8; 40])
        } else {
            skip()
        };
        self.agree(
            prepared,
            "save_checkpoint: preparing the directory; nothing was written",
        )?;
        let n = self.part.world;
        let states: Vec<[&[f32]; 3]> = (0..self.part.buckets.len())
            .map(|b| self.own_states(b))
            .collect();
        let written = if writes {
            checkpoint::write_shard(dir, self.rank, n, &states).map(|(bytes, sum)| {
                let mut p = [0u8; 40];
                p[..8].copy_from_slice(&bytes.to_le_bytes());
                p[8..].copy_from_slice(&sum);
                p
            })
        } else {
            skip()
        };
        let shards = self.agree(
            written,
            "save_checkpoint: writing the shards; the checkpoint was not committed",
        )?;
        let committed = if self.rank == 0 && writes {
            let meta = Meta {
                format: FORMAT,
                world: n,
                stage: self.cfg.stage,
                precision: self.cfg.precision.to_string(),
                bucket_elems: self.cfg.bucket_elems,
                params: self
                    .part
                    .specs
                    .iter()
                    .map(|p| ParamMeta {
                        name: p.name.clone(),
                        shape: p.shape.clone(),
                    })
                    .collect(),
                buckets: self.part.buckets.iter().map(|b| b.len).collect(),
                step: self.t,
                skipped: self.skipped,
                scaler: self.scaler.state(),
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
        self.agree(
            committed,
            "save_checkpoint: committing meta.json; the checkpoint was not committed",
        )?;
        Ok(())
    }

    /// Load the state saved in `dir` (a collective). The checkpoint may come from another world
    /// size, stage, precision or bucket size: each rank reads only the shards that hold what it
    /// now owns, matched by parameter name, and checks their size and checksum. The parameters
    /// must be the same set with the same shapes. Restores the master weights (and the 16-bit
    /// parameters, their rounding), both Adam moments, the step count and, fp16 to fp16 with
    /// dynamic scaling, the loss scale. Returns the checkpoint's metadata, `client_state`
    /// included.
    ///
    /// Call it between optimizer steps with nothing gathered. When it fails on any rank, no rank
    /// changes anything.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<Meta, ZeroError> {
        let dir = dir.as_ref();
        self.between_steps("load_checkpoint", true)?;
        let read = self.read_checkpoint(dir);
        self.agree(
            read.as_ref().map(|_| [0u8; 40]).map_err(Clone::clone),
            "load_checkpoint: reading the checkpoint; nothing was changed",
        )?;
        let (meta, states) = read.expect("agreed above");
        let stage = self.cfg.stage;
        for (b, [master, m, v]) in states.into_iter().enumerate() {
            let range = match stage {
                1 | 2 => self.part.owned(b, self.rank),
                _ => 0..self.params[b].len(),
            };
            let p = &mut self.params[b][range];
            if T::IS_F32 {
                let p: &mut [f32] = bytemuck::cast_slice_mut(p);
                p.copy_from_slice(&master);
            } else {
                cast(&master, p);
                self.master[b] = master;
            }
            self.m[b] = m;
            self.v[b] = v;
        }
        self.t = meta.step;
        self.skipped = meta.skipped;
        if let (Some(s), true) = (meta.scaler, meta.precision == Precision::Fp16.to_string()) {
            self.scaler.restore(s);
        }
        if stage == 1 || stage == 2 {
            for b in 0..self.part.buckets.len() {
                self.gather_updated(b)?;
            }
        }
        Ok(meta)
    }

    /// This rank's part of the checkpoint: per bucket, the three states of its update range.
    fn read_checkpoint(&self, dir: &Path) -> Result<Staged, ZeroError> {
        let mut ck = Checkpoint::open(dir)?;
        if let Some(why) = plan::mismatch(ck.partition(), &self.part) {
            return Err(checkpoint::err(dir, why));
        }
        let states = (0..self.part.buckets.len())
            .map(|b| ck.read_range(&self.part, b, self.update_range(b)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((ck.meta().clone(), states))
    }

    /// Master, first and second moment of the range of bucket `b` this rank owns.
    fn own_states(&self, b: usize) -> [&[f32]; 3] {
        let own = self.part.owned(b, self.rank);
        // Stage 0 keeps whole buckets; the other stages keep only the owned range.
        let cut = |v: &[f32]| -> std::ops::Range<usize> {
            if self.cfg.stage == 0 {
                own.clone()
            } else {
                0..v.len()
            }
        };
        let master: &[f32] = if T::IS_F32 {
            let p: &[f32] = bytemuck::cast_slice(&self.params[b]);
            if self.cfg.stage == 3 {
                p
            } else {
                &p[own.clone()]
            }
        } else {
            &self.master[b][cut(&self.master[b])]
        };
        [
            master,
            &self.m[b][cut(&self.m[b])],
            &self.v[b][cut(&self.v[b])],
        ]
    }

    /// Refuse `call` inside an accumulation window, while gradients are being pushed, and (for a
    /// load, which replaces the parameters) while anything is gathered or in flight.
    fn between_steps(&self, call: &'static str, replaces: bool) -> Result<(), ZeroError> {
        let not_now = |why: String| Err(ZeroError::NotNow { call, why });
        if self.micro != 0 {
            return not_now(format!(
                "inside an accumulation window (micro-step {} of {}); call it after the \
                 optimizer step",
                self.micro + 1,
                self.cfg.accumulation_steps
            ));
        }
        if let Some(i) = self.pushed.iter().position(|&p| p) {
            return not_now(format!(
                "gradients of this micro-step are being pushed (`{}` is in); call it after the \
                 optimizer step",
                self.part.specs[i].name
            ));
        }
        let busy = (0..self.gathered.len())
            .find(|&b| self.gathered[b].is_some() || self.inflight[b].is_some());
        if let (true, Some(b)) = (replaces, busy) {
            let p = self.part.buckets[b].params[0];
            return not_now(format!(
                "`{}` is gathered or being prefetched; release it first",
                self.part.specs[p].name
            ));
        }
        Ok(())
    }

    /// One agreement round: every rank's success (with a payload) or failure. Returns every
    /// rank's payload when all succeeded; this rank's own error when it failed; else
    /// [`ZeroError::PeerFailed`] naming the ranks that failed.
    fn agree(
        &self,
        local: Result<Payload, ZeroError>,
        what: &str,
    ) -> Result<Vec<Payload>, ZeroError> {
        const REC: usize = 1 + std::mem::size_of::<Payload>();
        let n = self.part.world;
        let mut mine = [0u8; REC];
        if let Ok(p) = &local {
            mine[0] = 1;
            mine[1..].copy_from_slice(p);
        }
        let mut all = vec![0u8; REC * n];
        self.comm.all_gather(&mine, &mut all)?;
        let failed: Vec<usize> = (0..n).filter(|&r| all[r * REC] == 0).collect();
        // Hybrid sharding: then every shard group's verdict, before any rank returns (a rank
        // that left early would leave its replicas waiting in this round).
        let groups = match self.replicas {
            Some(rep) => {
                let mut v = vec![0u8; rep.size()];
                rep.all_gather(&[u8::from(failed.is_empty())], &mut v)?;
                v
            }
            None => Vec::new(),
        };
        local?;
        if !failed.is_empty() {
            return Err(ZeroError::PeerFailed {
                what: what.to_string(),
                ranks: failed,
            });
        }
        let groups: Vec<usize> = (0..groups.len()).filter(|&k| groups[k] == 0).collect();
        if !groups.is_empty() {
            return Err(ZeroError::ReplicaFailed {
                what: what.to_string(),
                replicas: groups,
            });
        }
        Ok(all
            .chunks_exact(REC)
            .map(|c| c[1..].try_into().expect("record size"))
            .collect())
    }
}
