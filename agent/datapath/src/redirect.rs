//! The redirect maps: which Service addresses the connect hooks send to which balancer
//! listener. One generic path for both families ([`Family`]); IPv4 Services, also when reached
//! through IPv4-mapped addresses, are in `REDIRECT4`, native IPv6 ones in `REDIRECT6`.

use std::net::SocketAddr;

use aya::{
    Ebpf, Pod,
    maps::{HashMap, MapData, MapError},
};
use skewless_common::{Redirect, ServiceKey};
use tracing::debug;

use crate::{Datapath, Error, programs::take_map, wire::Family};

/// One family's redirect map.
pub(crate) struct RedirectMap<F: Family> {
    map: HashMap<MapData, ServiceKey<F::Wire>, Redirect<F::Wire>>,
    name: &'static str,
    capacity: u32,
}

impl<F: Family> RedirectMap<F>
where
    ServiceKey<F::Wire>: Pod,
    Redirect<F::Wire>: Pod,
{
    pub(crate) fn take(ebpf: &mut Ebpf, name: &'static str, capacity: u32) -> Result<Self, Error> {
        Ok(Self {
            map: take_map(ebpf, name)?,
            name,
            capacity,
        })
    }

    fn set(&mut self, service: F, target: F) -> Result<(), Error> {
        let (addr, port) = service.to_wire();
        let key = ServiceKey::new(addr, port);
        let (addr, port) = target.to_wire();
        let value = Redirect {
            addr,
            port,
            _pad: 0,
            enabled: 1,
        };
        self.map.insert(key, value, 0).map_err(|source| {
            if is_full(&source) {
                Error::RedirectMapFull {
                    addr: service.into(),
                    capacity: self.capacity,
                }
            } else {
                Error::Map {
                    name: self.name,
                    source,
                }
            }
        })?;
        debug!(%service, %target, "redirect set");
        Ok(())
    }

    fn remove(&mut self, service: F) -> Result<(), Error> {
        let (addr, port) = service.to_wire();
        match self.map.remove(&ServiceKey::new(addr, port)) {
            Ok(()) | Err(MapError::KeyNotFound) => {
                debug!(%service, "redirect removed");
                Ok(())
            }
            Err(source) => Err(Error::Map {
                name: self.name,
                source,
            }),
        }
    }

    fn entries(&self) -> impl Iterator<Item = (SocketAddr, SocketAddr)> + '_ {
        self.map
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, v)| v.enabled != 0)
            .map(|(k, v)| {
                (
                    F::from_wire(k.addr, k.port).into(),
                    F::from_wire(v.addr, v.port).into(),
                )
            })
    }
}

impl Datapath {
    /// Makes the next connect() to `service` from an attached cgroup go to `target` (an
    /// address of the same family) instead. An IPv4 Service is also redirected when a
    /// dual-stack socket reaches it through its IPv4-mapped address.
    ///
    /// # Errors
    /// When the map is full (the entry is not added and the Service stays plain L4), the
    /// addresses are of different families, or the update fails.
    pub fn set_redirect(
        &mut self,
        service: impl Into<SocketAddr>,
        target: impl Into<SocketAddr>,
    ) -> Result<(), Error> {
        match (service.into(), target.into()) {
            (SocketAddr::V4(service), SocketAddr::V4(target)) => {
                self.redirect4.set(service, target)
            }
            (SocketAddr::V6(service), SocketAddr::V6(target)) => {
                self.redirect6.set(service, target)
            }
            (service, target) => Err(Error::FamilyMismatch { service, target }),
        }
    }

    /// Stops redirecting `service`; the next connect() goes through the VIP as before.
    /// Removing an address that is not redirected is not an error.
    ///
    /// # Errors
    /// When the kernel refuses the deletion for another reason than a missing key.
    pub fn remove_redirect(&mut self, service: impl Into<SocketAddr>) -> Result<(), Error> {
        match service.into() {
            SocketAddr::V4(service) => self.redirect4.remove(service),
            SocketAddr::V6(service) => self.redirect6.remove(service),
        }
    }

    /// The redirect entries currently in the kernel maps, as (service, target) pairs: the
    /// IPv4 ones first, then the IPv6 ones.
    #[must_use]
    pub fn redirects(&self) -> Vec<(SocketAddr, SocketAddr)> {
        self.redirect4
            .entries()
            .chain(self.redirect6.entries())
            .collect()
    }
}

pub(crate) fn is_full(err: &MapError) -> bool {
    matches!(
        err,
        MapError::SyscallError(e) if e.io_error.raw_os_error() == Some(E2BIG)
    )
}

/// What the kernel returns when inserting a new key into a full hash map.
const E2BIG: i32 = 7;
