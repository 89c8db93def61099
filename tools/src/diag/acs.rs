//! Reading the ACS control register out of a bridge's PCI config space (as sysfs exposes it in the
//! device's `config` file), and what its bits mean for peer-to-peer traffic.
//!
//! The extended capability list starts at 0x100; each header is a little-endian u32 with the
//! capability id in bits 0–15 and the next offset in bits 20–31 (`(header >> 20) & 0xffc`). The
//! walk is bounded and remembers where it has been, so a looping or all-0xFF list cannot hang it.
//! Without root, sysfs shows only the first 64 bytes of config space: then the register cannot be
//! read at all, and the caller must infer ACS from IOMMU group splits.

/// ACS extended capability id.
pub const ACS_CAP_ID: u16 = 0x000D;

/// The ACS control bits, with their names.
pub const ACS_BITS: [(u16, &str); 7] = [
    (0x01, "Source Validation"),
    (0x02, "Translation Blocking"),
    (0x04, "P2P Request Redirect"),
    (0x08, "P2P Completion Redirect"),
    (0x10, "Upstream Forwarding"),
    (0x20, "P2P Egress Control"),
    (0x40, "Direct Translated P2P"),
];

/// Bits that send peer-to-peer traffic up to the root complex instead of across the switch.
pub const REDIRECT_BITS: u16 = 0x04 | 0x08 | 0x10 | 0x20;

/// What reading the ACS control register found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcsRead {
    /// Config space is shorter than the extended space (non-root reads see 64 bytes).
    Unreadable {
        /// Bytes of config space visible.
        len: usize,
    },
    /// The extended capability list has no ACS capability (or is empty).
    Absent,
    /// The ACS capability, at `offset`, with control register `ctrl`.
    Found {
        /// Offset of the capability header.
        offset: usize,
        /// The ACS control register.
        ctrl: u16,
    },
    /// The list is corrupt: a loop, an all-0xFF header, an offset out of range.
    Broken(String),
}

/// Walk the extended capabilities of `config` to the ACS control register.
pub fn read_acs(config: &[u8]) -> AcsRead {
    if config.len() < 0x104 {
        return AcsRead::Unreadable { len: config.len() };
    }
    let mut offset = 0x100usize;
    let mut seen = std::collections::HashSet::new();
    for _ in 0..512 {
        if offset < 0x100 || offset + 4 > config.len() {
            return AcsRead::Broken(format!(
                "capability pointer {offset:#x} is outside config space"
            ));
        }
        if !seen.insert(offset) {
            return AcsRead::Broken(format!("capability list loops back to {offset:#x}"));
        }
        let header = u32::from_le_bytes(config[offset..offset + 4].try_into().expect("4 bytes"));
        if header == 0xffff_ffff {
            return AcsRead::Broken(format!(
                "header at {offset:#x} reads all 0xFF (device gone or blocked)"
            ));
        }
        if header == 0 {
            return AcsRead::Absent;
        }
        if (header & 0xffff) as u16 == ACS_CAP_ID {
            if offset + 8 > config.len() {
                return AcsRead::Broken(format!("ACS capability at {offset:#x} is truncated"));
            }
            let ctrl = u16::from_le_bytes([config[offset + 6], config[offset + 7]]);
            return AcsRead::Found { offset, ctrl };
        }
        let next = ((header >> 20) & 0xffc) as usize;
        if next == 0 {
            return AcsRead::Absent;
        }
        offset = next;
    }
    AcsRead::Broken("capability list longer than 512 entries".into())
}

/// The names of the bits set in `ctrl`.
pub fn decode(ctrl: u16) -> Vec<&'static str> {
    ACS_BITS
        .iter()
        .filter(|(b, _)| ctrl & b != 0)
        .map(|(_, n)| *n)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4 KiB of config space with the given extended capabilities `(offset, id, next)`.
    pub fn config_with(caps: &[(usize, u16, usize)], acs_ctrl: u16) -> Vec<u8> {
        let mut c = vec![0u8; 4096];
        for &(off, id, next) in caps {
            let header = id as u32 | (1 << 16) | ((next as u32) << 20);
            c[off..off + 4].copy_from_slice(&header.to_le_bytes());
            if id == ACS_CAP_ID {
                c[off + 6..off + 8].copy_from_slice(&acs_ctrl.to_le_bytes());
            }
        }
        c
    }

    #[test]
    fn finds_acs_behind_other_capabilities_and_decodes_it() {
        let c = config_with(&[(0x100, 0x0001, 0x148), (0x148, ACS_CAP_ID, 0)], 0x001d);
        assert_eq!(
            read_acs(&c),
            AcsRead::Found {
                offset: 0x148,
                ctrl: 0x001d
            }
        );
        assert_eq!(
            decode(0x001d),
            vec![
                "Source Validation",
                "P2P Request Redirect",
                "P2P Completion Redirect",
                "Upstream Forwarding"
            ]
        );
        assert_eq!(0x001d & REDIRECT_BITS, 0x001c);
    }

    #[test]
    fn short_looping_and_all_ff_lists_are_reported_not_followed() {
        assert_eq!(read_acs(&[0u8; 64]), AcsRead::Unreadable { len: 64 });
        let looping = config_with(&[(0x100, 0x0001, 0x140), (0x140, 0x0002, 0x100)], 0);
        assert!(
            matches!(read_acs(&looping), AcsRead::Broken(m) if m.contains("loops back to 0x100"))
        );
        let mut ff = vec![0u8; 4096];
        ff[0x100..].fill(0xff);
        assert!(matches!(read_acs(&ff), AcsRead::Broken(m) if m.contains("all 0xFF")));
        assert_eq!(
            read_acs(&config_with(&[(0x100, 0x0001, 0)], 0)),
            AcsRead::Absent
        );
        assert_eq!(read_acs(&vec![0u8; 4096]), AcsRead::Absent);
    }
}
