//! Sub-communicators: [`Communicator::split`](crate::Communicator::split).
//!
//! Every rank of the parent states a *color* (or none) and a *key*. Ranks with the same color form
//! one new communicator, ranked by key (ties by parent rank). The new communicator is a full one:
//! its own store (served by its rank 0 on an ephemeral port), its own ring, transports chosen per
//! edge as at start-up, its own sequence numbers and flight record. Two all-gathers on the parent
//! carry what the members need: the colors, keys, nodes and addresses first, then the port of each
//! new rank 0's store.
//!
//! [`place`] is the pure part (who is in which group, at which rank); the rest is IO.

use bytemuck::{Pod, Zeroable};

/// What one parent rank says in the first all-gather.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub(crate) struct Ask {
    /// The color (when `has_color` is 1).
    pub color: u32,
    /// 1 when the rank joins a group, 0 when it asks for none.
    pub has_color: u32,
    /// Order within the group.
    pub key: u32,
    /// 0: no address (a one-rank parent), 4 or 6: `ip` holds an IPv4 or IPv6 address.
    pub ip_kind: u32,
    /// A hash of the rank's node id (ranks with equal hashes share a node).
    pub node: u64,
    /// The address the rank's data connections use, where its group's store may be reached.
    pub ip: [u8; 16],
}

impl Ask {
    pub(crate) fn new(
        color: Option<u32>,
        key: u32,
        node_id: &str,
        ip: Option<std::net::IpAddr>,
    ) -> Ask {
        use sha2::Digest;
        let h = sha2::Sha256::digest(node_id.as_bytes());
        let mut node = [0u8; 8];
        node.copy_from_slice(&h[..8]);
        let (ip_kind, ip) = match ip {
            None => (0, [0; 16]),
            Some(std::net::IpAddr::V4(a)) => {
                let mut b = [0; 16];
                b[..4].copy_from_slice(&a.octets());
                (4, b)
            }
            Some(std::net::IpAddr::V6(a)) => (6, a.octets()),
        };
        Ask {
            color: color.unwrap_or(0),
            has_color: color.is_some() as u32,
            key,
            ip_kind,
            node: u64::from_le_bytes(node),
            ip,
        }
    }

    pub(crate) fn ip(&self) -> Option<std::net::IpAddr> {
        match self.ip_kind {
            4 => {
                let b: [u8; 4] = self.ip[..4].try_into().ok()?;
                Some(std::net::IpAddr::from(b))
            }
            6 => Some(std::net::IpAddr::from(self.ip)),
            _ => None,
        }
    }

    fn color(&self) -> Option<u32> {
        (self.has_color == 1).then_some(self.color)
    }
}

/// Where parent rank `me` lands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    /// The group's color.
    pub color: u32,
    /// Parent ranks of the group, in new-rank order.
    pub members: Vec<usize>,
    /// `me`'s rank in the group.
    pub rank: usize,
    /// `me`'s rank among the members on its node.
    pub local_rank: usize,
    /// Members on `me`'s node.
    pub local_size: usize,
}

/// The group of parent rank `me`, or None when it asked for no color.
pub(crate) fn place(asks: &[Ask], me: usize) -> Option<Place> {
    let color = asks[me].color()?;
    let mut members: Vec<usize> = (0..asks.len())
        .filter(|r| asks[*r].color() == Some(color))
        .collect();
    members.sort_by_key(|r| (asks[*r].key, *r));
    let rank = members.iter().position(|r| *r == me)?;
    let node = asks[me].node;
    let local: Vec<usize> = members
        .iter()
        .copied()
        .filter(|r| asks[*r].node == node)
        .collect();
    Some(Place {
        color,
        rank,
        local_rank: local.iter().position(|r| *r == me)?,
        local_size: local.len(),
        members,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asks(spec: &[(Option<u32>, u32, &str)]) -> Vec<Ask> {
        spec.iter()
            .map(|(c, k, n)| Ask::new(*c, *k, n, Some([127, 0, 0, 1].into())))
            .collect()
    }

    #[test]
    fn groups_by_color_ranked_by_key_then_parent_rank() {
        let a = asks(&[
            (Some(0), 5, "a"),
            (Some(1), 0, "a"),
            (Some(0), 1, "b"),
            (None, 0, "b"),
            (Some(0), 1, "a"),
        ]);
        let p = place(&a, 0).unwrap();
        assert_eq!(p.members, vec![2, 4, 0]);
        assert_eq!((p.rank, p.color), (2, 0));
        // Ranks 0 and 4 share node "a": local ranks in group order.
        assert_eq!((p.local_rank, p.local_size), (1, 2));
        assert_eq!(place(&a, 4).unwrap().local_rank, 0);
        assert_eq!(place(&a, 2).unwrap().local_size, 1);
        let one = place(&a, 1).unwrap();
        assert_eq!((one.members.clone(), one.rank), (vec![1], 0));
        assert_eq!(place(&a, 3), None);
    }

    #[test]
    fn addresses_round_trip() {
        let v4: std::net::IpAddr = [10, 1, 2, 3].into();
        let v6: std::net::IpAddr = "fe80::1".parse().unwrap();
        assert_eq!(Ask::new(Some(1), 0, "x", Some(v4)).ip(), Some(v4));
        assert_eq!(Ask::new(Some(1), 0, "x", Some(v6)).ip(), Some(v6));
        assert_eq!(Ask::new(Some(1), 0, "x", None).ip(), None);
    }
}
