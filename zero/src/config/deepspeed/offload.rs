//! `zero_optimization.offload_optimizer`, `zero_optimization.offload_param` and `aio`, as
//! DeepSpeed's reference spells them, into [`Offload`].

use std::path::PathBuf;

use serde_json::Value;

use super::{boolean, for_each, num, uint, Reader};
use crate::config::{bad, Aio, Offload, OffloadDevice};
use crate::error::ZeroError;

/// `offload_optimizer` or `offload_param` (`key` is the full key) into `o`.
pub(super) fn read_offload(
    r: &mut Reader<'_>,
    o: &mut Offload,
    key: &str,
    v: &Value,
) -> Result<(), ZeroError> {
    let optimizer = key.ends_with("offload_optimizer");
    for_each(r, key, v, |_, k2, v2| {
        let full = format!("{key}.{k2}");
        let (opt, par) = (&mut o.optimizer, &mut o.param);
        // The three keys both settings have, in the one this is.
        let (dev, nvme, pin) = if optimizer {
            (&mut opt.device, &mut opt.nvme_path, &mut opt.pin_memory)
        } else {
            (&mut par.device, &mut par.nvme_path, &mut par.pin_memory)
        };
        match (k2, optimizer) {
            ("device", _) => *dev = device(&full, v2)?,
            ("nvme_path", _) => *nvme = path(&full, v2)?,
            ("pin_memory", _) => *pin = boolean(&full, v2)?,
            ("buffer_count", true) => opt.buffer_count = uint(&full, v2)? as usize,
            ("ratio", true) => opt.ratio = num(&full, v2)? as f32,
            ("buffer_count", false) => par.buffer_count = uint(&full, v2)? as usize,
            ("buffer_size", false) => par.buffer_size = uint(&full, v2)? as usize,
            ("max_in_cpu", false) => par.max_in_cpu = uint(&full, v2)? as usize,
            _ => return Ok(false),
        }
        Ok(true)
    })
}

/// `aio` into `a`.
pub(super) fn read_aio(r: &mut Reader<'_>, a: &mut Aio, v: &Value) -> Result<(), ZeroError> {
    let key = "aio";
    for_each(r, key, v, |_, k2, v2| {
        let full = format!("{key}.{k2}");
        match k2 {
            "block_size" => a.block_size = uint(&full, v2)? as usize,
            "queue_depth" => a.queue_depth = uint(&full, v2)? as usize,
            "thread_count" | "intra_op_parallelism" => a.thread_count = uint(&full, v2)? as usize,
            "single_submit" => a.single_submit = boolean(&full, v2)?,
            "overlap_events" => a.overlap_events = boolean(&full, v2)?,
            "use_gds" => {
                if boolean(&full, v2)? {
                    return Err(bad(format!(
                        "`{full}` = true: GPUDirect Storage is not supported; the NVMe tier \
                         reads into host memory (set it to false)"
                    )));
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    })
}

fn device(key: &str, v: &Value) -> Result<OffloadDevice, ZeroError> {
    let s = v.as_str().ok_or_else(|| {
        bad(format!(
            "`{key}` must be \"none\", \"cpu\" or \"nvme\", got {v}"
        ))
    })?;
    s.parse().map_err(|e: String| bad(format!("`{key}`: {e}")))
}

fn path(key: &str, v: &Value) -> Result<Option<PathBuf>, ZeroError> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) if !s.is_empty() => Ok(Some(PathBuf::from(s))),
        _ => Err(bad(format!("`{key}` must be a directory's path, got {v}"))),
    }
}
