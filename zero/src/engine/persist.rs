//! The engine's state leaving and entering its stream's memory: checkpoints (the format in
//! [`crate::checkpoint`], the all-or-nothing protocol in `checkpoint/protocol.rs`), the states
//! copied between the stream's memory and the host shard by shard, and [`Engine::consolidate`].

use std::borrow::Cow;
use std::path::Path;

use ringzero_collectives::{Collectives, DType, TrainStream};
use ringzero_kernels::cpu::{cast, Float};

use super::{all_gather_host, alloc, dev, DevVec, Engine};
use crate::checkpoint::protocol::{self as persist, Payload, Persist};
use crate::checkpoint::Meta;
use crate::error::ZeroError;
use crate::ledger::Ledger;

impl<T: Float, S: TrainStream + 'static> Persist for Engine<T, S> {
    fn led(&self) -> &Ledger {
        &self.led
    }
    fn own_states(&self, b: usize) -> Result<Vec<Cow<'_, [f32]>>, ZeroError> {
        if self.tier.on_nvme(b) {
            return Ok(self
                .tier
                .read_nvme(b)?
                .into_iter()
                .map(Cow::Owned)
                .collect());
        }
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
        std::iter::once(read(master, whole_master))
            .chain(self.states[b].iter().map(|x| read(x, whole_state)))
            .collect()
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
        let all = all_gather_host(&self.comm, &persist::record(&local))?;
        // Hybrid sharding: then every shard group's verdict, before any rank returns.
        let groups = match &self.replicas {
            Some(rep) => all_gather_host(rep, &[u8::from(persist::all_succeeded(&all, n))])?,
            None => Vec::new(),
        };
        let payloads = persist::agreed(local, &all, n, what)?;
        persist::replicas_agreed(&groups, what)?;
        Ok(payloads)
    }
}

impl<T: Float, S: TrainStream + 'static> Engine<T, S> {
    /// Refuse `call` inside an accumulation window, while gradients are being pushed, and (for a
    /// load) while anything is gathered or in flight.
    fn between_steps(&self, call: &'static str, replaces: bool) -> Result<(), ZeroError> {
        // Buckets that persistent parameters keep gathered are consistent between steps (and
        // gathered again after a load).
        let (part, live) = (&self.led.part, &self.led.live);
        let busy = (0..self.gathered.len()).find(|&b| {
            (self.gathered[b].is_some() && !live.pins(part, b)) || self.inflight[b].is_some()
        });
        persist::between_steps(
            &self.led.part,
            &self.led.cfg,
            (self.led.micro, &self.led.pushed, busy),
            call,
            replaces,
        )
    }

    /// Save this engine's state into `dir` (a collective: every rank calls it with the same
    /// directory, on a filesystem all ranks share when they are on several hosts). `dir` must
    /// not hold a checkpoint already. `client_state` is kept as is in `meta.json` and returned by
    /// [`Engine::load_checkpoint`] (a data loader's position, an epoch, ...). The checkpoint
    /// loads at any world size, stage, precision or bucket size, on the host or a device.
    ///
    /// Call it between optimizer steps: inside an accumulation window, or once a micro-step's
    /// gradients are being pushed, it is refused and nothing is written. When it fails on any
    /// rank, `meta.json` is not written, so the directory is not a checkpoint.
    pub fn save_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        client_state: serde_json::Value,
    ) -> Result<(), ZeroError> {
        self.between_steps("save_checkpoint", false)?;
        self.land_delayed()?;
        persist::save(self, dir.as_ref(), client_state)
    }

    /// Load the state saved in `dir` (a collective). The checkpoint may come from another world
    /// size, stage, precision or bucket size: each rank reads only the shards that hold what it
    /// now owns, matched by parameter name, and checks their size and checksum. The parameters
    /// must be the same set with the same shapes. Restores the master weights (and the 16-bit
    /// parameters, their rounding), the optimizer's states, the step count and, fp16 to fp16 with
    /// dynamic scaling, the loss scale. Returns the checkpoint's metadata, `client_state`
    /// included.
    ///
    /// Call it between optimizer steps with nothing gathered. When it fails on any rank, no rank
    /// changes anything.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<Meta, ZeroError> {
        self.between_steps("load_checkpoint", true)?;
        self.land_delayed()?;
        let (meta, states) = persist::read_agreed(self, dir.as_ref())?;
        let (stage, rank) = (self.led.cfg.stage, self.led.rank);
        for (b, saved) in states.into_iter().enumerate() {
            let (master, kept) = saved.split_first().expect("the master comes first");
            let range = match stage {
                1 | 2 => self.led.part.owned(b, rank),
                _ => 0..self.params[b].elems,
            };
            if self.tier.params_file.is_some() {
                // The shard goes to its file; the master and states to their tier below.
                self.put_loaded_shard(b, master)?;
            }
            let p = self.params[b].at(range.start);
            let s = self.comm.stream();
            let up = |dst: u64, x: &[f32]| {
                // SAFETY: `dst` holds `x.len()` f32s of the engine's buffers (the update range's
                // master and moments, or f32 parameters), used by no queued work (the stream
                // is waited for before each write).
                unsafe { s.write(dst, bytemuck::cast_slice(x)) }
                    .map_err(dev("uploading the checkpoint's state".into()))
            };
            if self.tier.on_nvme(b) {
                let mut parts: Vec<&[f32]> = vec![master];
                parts.extend(kept.iter().map(Vec::as_slice));
                self.tier.write_nvme(b, &parts)?;
                if range.is_empty() {
                    continue; // the shard went to its file above
                }
                let mut p16 = vec![T::default(); master.len()];
                cast(master, &mut p16);
                // SAFETY: the parameters' stretch holds `range.len()` elements of `T`, used by
                // no queued work (`write` waits for the stream first).
                unsafe { s.write(p, bytemuck::cast_slice(&p16)) }
                    .map_err(dev("uploading the checkpoint's parameters".into()))?;
                continue;
            }
            match &self.master[b] {
                None => up(p, master)?,
                Some(mb) => {
                    up(mb.addr, master)?;
                    // SAFETY: the master and the parameters' stretch both hold `range.len()`
                    // elements (f32 and `T`), apart.
                    unsafe {
                        if T::IS_F32 {
                            s.copy(p, mb.addr, range.len() * 4)
                        } else {
                            s.cast(DType::F32, mb.addr, T::DTYPE, p, range.len())
                        }
                    }
                    .map_err(dev("rounding the master into the parameters".into()))?;
                }
            }
            // The same optimizer saved it (checked before reading): a state per state kept.
            for (x, saved) in self.states[b].iter().zip(kept) {
                up(x.addr, saved)?;
            }
        }
        self.led.t = meta.step;
        self.led.skipped = meta.skipped;
        if let (Some(s), true) = (meta.scaler, persist::resumes_scaler(&meta)) {
            self.led.scaler.restore(s);
        }
        match stage {
            1 | 2 => self.share_updated(&(0..self.params.len()).collect::<Vec<_>>())?,
            3 => self.refresh_pinned()?,
            _ => {}
        }
        self.sync("loading a checkpoint")?;
        Ok(meta)
    }

    /// Every parameter's fp32 master values, assembled from all ranks' shards and copied to the
    /// host (a collective: call it on every rank). In the specs' order.
    pub fn consolidate(&self) -> Result<Vec<(String, Vec<f32>)>, ZeroError> {
        self.nothing_in_flight("consolidate")?;
        let (stage, n) = (self.led.cfg.stage, self.led.part.world);
        let mut full: Vec<Vec<f32>> = Vec::with_capacity(self.led.part.buckets.len());
        for b in 0..self.led.part.buckets.len() {
            let len = self.led.part.buckets[b].len;
            let mut out = alloc(self.stream(), DType::F32, len)?;
            if self.tier.on_nvme(b) {
                let master = self.tier.read_nvme(b)?.swap_remove(0);
                let mine = alloc(self.stream(), DType::F32, master.len())?;
                // SAFETY: a fresh allocation of the owned range's f32s, used by no work.
                unsafe {
                    self.stream()
                        .write(mine.addr, bytemuck::cast_slice(&master))
                }
                .map_err(dev("uploading the NVMe tier's master".into()))?;
                self.comm.all_gather(&mine, &mut out)?;
            }
            match (&self.master[b], stage) {
                _ if self.tier.on_nvme(b) => {}
                // Stage 0 keeps the whole master (16-bit) or the whole parameters (f32).
                (Some(m), 0) => self.copy(&mut out, m, len)?,
                (None, 0) => self.copy(&mut out, &self.params[b], len)?,
                (Some(m), _) => self.comm.all_gather(m, &mut out)?,
                (None, 3) => self.comm.all_gather(&self.params[b], &mut out)?,
                (None, _) => {
                    let own = self.led.part.owned(b, self.led.rank);
                    let mine = alloc(self.stream(), DType::F32, len / n)?;
                    // SAFETY: the owned range of the f32 bucket into a buffer of its length.
                    unsafe {
                        self.stream()
                            .copy(mine.addr, self.params[b].at(own.start), own.len() * 4)
                    }
                    .map_err(dev("copying the owned parameters".into()))?;
                    // (The copy is queued before the all-gather, which returns once its work
                    // is done.)
                    self.comm.all_gather(&mine, &mut out)?;
                }
            }
            let mut host = vec![0f32; len];
            // SAFETY: `out` holds `len` f32s.
            unsafe {
                self.stream()
                    .read(bytemuck::cast_slice_mut(&mut host), out.addr)
            }
            .map_err(dev("reading the consolidated weights".into()))?;
            full.push(host);
        }
        Ok(self.led.part.by_param(&full))
    }

    /// `len` f32s of `src` into `dst`, waited for.
    fn copy(&self, dst: &mut DevVec, src: &DevVec, len: usize) -> Result<(), ZeroError> {
        // SAFETY: both hold at least `len` f32s (whole buckets of f32).
        unsafe { self.stream().copy(dst.addr, src.addr, len * 4) }
            .map_err(dev("copying the master weights".into()))?;
        self.sync("copying the master weights")
    }
}
