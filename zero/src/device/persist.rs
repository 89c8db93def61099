//! Saving and loading the device engine's state: the host engine's format and protocol
//! (`crate::engine::persist`), the states copied between device memory and the host shard by
//! shard. A checkpoint saved by either engine loads into the other (tested).

use std::borrow::Cow;
use std::path::Path;

use ringzero_collectives::{DType, TrainStream};
use ringzero_kernels::cpu::Float;

use super::{all_gather_host, dev, DevVec, DeviceEngine};
use crate::checkpoint::Meta;
use crate::engine::persist::{self, Payload, Persist};
use crate::error::ZeroError;
use crate::ledger::Ledger;

impl<S: TrainStream + 'static, T: Float> Persist for DeviceEngine<'_, S, T> {
    fn led(&self) -> &Ledger {
        &self.led
    }
    fn own_states(&self, b: usize) -> Result<[Cow<'_, [f32]>; 3], ZeroError> {
        let own = self.led.part.owned(b, self.led.rank);
        // Which buffers hold whole buckets (the owned range at its offset) rather than the owned
        // range alone: the master and moments in stage 0, f32 parameters outside stage 3.
        let whole_state = self.led.cfg.stage == 0;
        let (master, whole_master) = match &self.master[b] {
            Some(m) => (m, whole_state),
            None => (&self.params[b], self.led.cfg.stage != 3),
        };
        let read = |v: &DevVec, whole: bool| -> Result<Cow<'_, [f32]>, ZeroError> {
            let at = if whole { v.at(own.start) } else { v.addr };
            let mut out = vec![0f32; own.len()];
            // SAFETY: `v` holds f32s (a master, a moment, or f32 parameters) covering the owned
            // range from `at`.
            unsafe { self.stream().read(bytemuck::cast_slice_mut(&mut out), at) }
                .map_err(dev("reading the optimizer state".into()))?;
            Ok(Cow::Owned(out))
        };
        Ok([
            read(master, whole_master)?,
            read(&self.m[b], whole_state)?,
            read(&self.v[b], whole_state)?,
        ])
    }
    fn writes(&self) -> bool {
        self.replicas.as_ref().is_none_or(|r| r.rank() == 0)
    }
    fn agree(
        &mut self,
        local: Result<Payload, ZeroError>,
        what: &str,
    ) -> Result<Vec<Payload>, ZeroError> {
        let n = self.led.part.world;
        let all = all_gather_host(self.comm, &persist::record(&local))?;
        // Hybrid sharding: then every shard group's verdict, before any rank returns.
        let groups = match self.replicas {
            Some(rep) => all_gather_host(rep, &[u8::from(persist::all_succeeded(&all, n))])?,
            None => Vec::new(),
        };
        let payloads = persist::agreed(local, &all, n, what)?;
        persist::replicas_agreed(&groups, what)?;
        Ok(payloads)
    }
}

impl<S: TrainStream + 'static, T: Float> DeviceEngine<'_, S, T> {
    /// Refuse `call` inside an accumulation window, while gradients are being pushed, and (for a
    /// load) while anything is gathered or in flight.
    fn between_steps(&self, call: &'static str, replaces: bool) -> Result<(), ZeroError> {
        let busy = (0..self.gathered.len())
            .find(|&b| self.gathered[b].is_some() || self.inflight[b].is_some());
        persist::between_steps(
            &self.led.part,
            &self.led.cfg,
            (self.led.micro, &self.led.pushed, busy),
            call,
            replaces,
        )
    }

    /// Save this engine's state into `dir`, as [`crate::Engine::save_checkpoint`] does (same
    /// format: either engine loads it, at any world size, stage or precision).
    pub fn save_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        client_state: serde_json::Value,
    ) -> Result<(), ZeroError> {
        self.between_steps("save_checkpoint", false)?;
        persist::save(self, dir.as_ref(), client_state)
    }

    /// Load the state saved in `dir` (by either engine), as [`crate::Engine::load_checkpoint`]
    /// does: all or nothing across ranks.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<Meta, ZeroError> {
        self.between_steps("load_checkpoint", true)?;
        let (meta, states) = persist::read_agreed(self, dir.as_ref())?;
        let (stage, rank) = (self.led.cfg.stage, self.led.rank);
        for (b, [master, m, v]) in states.into_iter().enumerate() {
            let range = match stage {
                1 | 2 => self.led.part.owned(b, rank),
                _ => 0..self.params[b].elems,
            };
            let p = self.params[b].at(range.start);
            let s = self.comm.stream();
            let up = |dst: u64, x: &[f32]| {
                // SAFETY: `dst` holds `x.len()` f32s of the engine's buffers (the update range's
                // master and moments, or f32 parameters), used by no queued work (the stream
                // is waited for before each write).
                unsafe { s.write(dst, bytemuck::cast_slice(x)) }
                    .map_err(dev("uploading the checkpoint's state".into()))
            };
            match &self.master[b] {
                None => up(p, &master)?,
                Some(mb) => {
                    up(mb.addr, &master)?;
                    // SAFETY: the master and the parameters' stretch both hold `range.len()`
                    // elements (f32 and `T`), apart.
                    unsafe { s.cast(DType::F32, mb.addr, T::DTYPE, p, range.len()) }
                        .map_err(dev("rounding the master into the parameters".into()))?;
                }
            }
            up(self.m[b].addr, &m)?;
            up(self.v[b].addr, &v)?;
        }
        self.led.t = meta.step;
        self.led.skipped = meta.skipped;
        if let (Some(s), true) = (meta.scaler, persist::resumes_scaler(&meta)) {
            self.led.scaler.restore(s);
        }
        if stage == 1 || stage == 2 {
            for p in &mut self.params {
                self.comm.all_gather_in_place(p)?;
            }
        }
        self.sync("loading a checkpoint")?;
        Ok(meta)
    }
}
