//! How many connections may one peer address hold? Each front end's connection cap is shared
//! by every peer; without a share per address, a handful of sockets from one host (idle
//! upgrades, HTTP/2 prefaces, refused calls in a loop) fill it and lock every robot out. A
//! [`PeerShare`] gives each address at most `per_peer` of the cap, so a robot's reconnect
//! finds a slot while another host holds its share.
//!
//! The host's own address (`127.0.0.1`, `::1`) has no share: it is the board's own processes
//! (`policyd bench`, a client running beside policyd, the test suites), which can do worse to
//! the server than hold sockets; the rest of the loopback range counts as other hosts.
//!
//! The table is sized at start-up (one entry per connection the cap allows: an address has an
//! entry only while it holds a permit) and never grows.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// The per-address share of one connection cap.
#[derive(Debug)]
pub struct PeerShare {
    per_peer: usize,
    /// Addresses holding connections, and how many each holds.
    held: Mutex<Vec<(IpAddr, usize)>>,
    capacity: usize,
}

/// One connection of an address, counted until dropped (`None`: the host's own, not counted).
#[derive(Debug)]
pub struct PeerPermit {
    share: Arc<PeerShare>,
    ip: Option<IpAddr>,
}

/// An IPv4 peer seen through an IPv6 socket is the same host as over IPv4.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

impl PeerShare {
    /// `per_peer` connections per address, out of a cap of `capacity` connections.
    pub fn new(per_peer: usize, capacity: usize) -> Arc<PeerShare> {
        Arc::new(PeerShare {
            per_peer,
            held: Mutex::new(Vec::with_capacity(capacity)),
            capacity,
        })
    }

    /// A permit for one more connection from `ip`; `None` when it holds its share already.
    pub fn try_acquire(self: &Arc<Self>, ip: IpAddr) -> Option<PeerPermit> {
        let ip = canonical(ip);
        if is_this_host(ip) {
            return Some(PeerPermit {
                share: self.clone(),
                ip: None,
            });
        }
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let full = held.len() >= self.capacity;
        match held.iter_mut().find(|(a, _)| *a == ip) {
            Some((_, n)) if *n >= self.per_peer => return None,
            Some((_, n)) => *n += 1,
            // Full only if more permits are out than the cap allows connections: refuse
            // rather than grow.
            None if full => return None,
            None => held.push((ip, 1)),
        }
        Some(PeerPermit {
            share: self.clone(),
            ip: Some(ip),
        })
    }

    /// Connections `ip` holds now.
    pub fn held_by(&self, ip: IpAddr) -> usize {
        let ip = canonical(ip);
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.iter().find(|(a, _)| *a == ip).map_or(0, |&(_, n)| n)
    }
}

/// `127.0.0.1` or `::1`: a connection from this host's own processes.
fn is_this_host(ip: IpAddr) -> bool {
    ip == IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
        || ip == IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)
}

impl Drop for PeerPermit {
    fn drop(&mut self) {
        let Some(ip) = self.ip else {
            return;
        };
        let mut held = self.share.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = held.iter().position(|(a, _)| *a == ip) {
            held[i].1 -= 1;
            if held[i].1 == 0 {
                held.swap_remove(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_gets_its_share_and_gets_it_back() {
        let share = PeerShare::new(2, 4);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let a1 = share.try_acquire(a).unwrap();
        let _a2 = share.try_acquire(a).unwrap();
        assert!(share.try_acquire(a).is_none(), "a third from one address");
        let _b1 = share.try_acquire(b).expect("another address still gets in");
        assert_eq!(share.held_by(a), 2);
        drop(a1);
        assert_eq!(share.held_by(a), 1);
        assert!(share.try_acquire(a).is_some());
    }

    #[test]
    fn the_hosts_own_address_has_no_share_but_the_rest_of_loopback_does() {
        let share = PeerShare::new(1, 2);
        let local: Vec<_> = (0..5)
            .map(|_| share.try_acquire("127.0.0.1".parse().unwrap()).unwrap())
            .collect();
        assert!(share.try_acquire("::1".parse().unwrap()).is_some());
        assert_eq!(share.held_by("127.0.0.1".parse().unwrap()), 0);
        let _other = share.try_acquire("127.0.0.2".parse().unwrap()).unwrap();
        assert!(share.try_acquire("127.0.0.2".parse().unwrap()).is_none());
        drop(local);
    }

    #[test]
    fn a_mapped_ipv4_address_is_the_same_peer() {
        let share = PeerShare::new(1, 4);
        let _v4 = share.try_acquire("10.0.0.1".parse().unwrap()).unwrap();
        assert!(
            share
                .try_acquire("::ffff:10.0.0.1".parse().unwrap())
                .is_none()
        );
    }

    #[test]
    fn the_table_never_grows_past_its_capacity() {
        let share = PeerShare::new(1, 2);
        let _a = share.try_acquire("10.0.0.1".parse().unwrap()).unwrap();
        let _b = share.try_acquire("10.0.0.2".parse().unwrap()).unwrap();
        assert!(share.try_acquire("10.0.0.3".parse().unwrap()).is_none());
        assert_eq!(share.held.lock().unwrap().capacity(), 2);
    }
}
